"""The task family: tokenizer, seeded tasks, hidden tests, reward-hacking guards."""

from __future__ import annotations

import random

import pytest

from rlstream.envs import fx_tasks as tasks
from rlstream.envs import protocol
from rlstream.envs.fx_tasks import Task


def test_tokenizer_round_trip_and_single_token_tags() -> None:
    text = "f(x): add 3\nf(2)=5\n<run>print(1)</run><out>1\n</out>x=x+3;return x"
    ids = protocol.encode(text)
    assert protocol.decode(ids) == text
    assert protocol.encode("<run></run><out></out><sum></sum>") == [
        protocol.RUN,
        protocol.RUN_END,
        protocol.OUT,
        protocol.OUT_END,
        protocol.SUM,
        protocol.SUM_END,
    ]
    assert max(protocol.encode("".join(chr(c) for c in range(32, 127)))) < protocol.VOCAB_SIZE
    assert protocol.decode(protocol.encode("é")) == "?"
    assert protocol.decode([protocol.BOS, *protocol.encode("a"), protocol.EOS, protocol.PAD]) == "a"


def test_tasks_are_a_function_of_the_seed_and_eval_is_held_out() -> None:
    assert tasks.sample_task(42) == tasks.sample_task(42)
    assert tasks.sample_task(42).hidden_x == tasks.sample_task(42).hidden_x
    assert tasks.sample_task(42) != tasks.sample_task(43)
    held_out = tasks.eval_tasks(20)
    assert all(t.seed >= tasks.EVAL_SEED_BASE for t in held_out)
    assert held_out == tasks.eval_tasks(20)


def test_prompt_shows_the_visible_example_but_no_hidden_input() -> None:
    task = tasks.sample_task(7)
    prompt = task.prompt
    assert f"f({task.visible_x})={task.expected(task.visible_x)}" in prompt
    assert len(task.hidden_x) == tasks.TaskConfig().n_hidden
    assert task.visible_x not in task.hidden_x
    assert all(f"f({x})" not in prompt for x in task.hidden_x)


@pytest.mark.parametrize("seed", range(6))
def test_reference_answer_passes(seed: int) -> None:
    task = tasks.sample_task(seed)
    passed, details = tasks.score(task, task.reference())
    assert passed, details
    assert details["hidden_passed"] == details["hidden_total"]


DOUBLE = Task("t-double", 0, (("double", None),), visible_x=2, hidden_x=(-3, 5, 7, 11, -8))


def test_echo_of_the_visible_output_is_rejected() -> None:
    passed, details = tasks.score(DOUBLE, "return 4")
    assert not passed and "guard" in str(details["reason"])
    passed, details = tasks.score(DOUBLE, "return 4 if x==2 else x")
    assert not passed and "echoes" in str(details["reason"])


def test_a_program_that_fits_the_visible_example_fails_the_hidden_tests() -> None:
    passed, details = tasks.score(DOUBLE, "x=x**2;return x")  # 2**2 == 2*2
    assert not passed
    assert details["visible_ok"] is True and details["hidden_passed"] == 0


def test_type_must_match_and_crashes_fail() -> None:
    half = Task("t-half", 0, (("half", None),), visible_x=4, hidden_x=(3, -5, 9))
    assert tasks.score(half, "x=x//2;return x")[0]
    passed, details = tasks.score(half, "x=x/2;return x")  # 2.0 is not 2
    assert not passed and details["visible_ok"] is False
    assert not tasks.score(half, "x=x//0;return x")[0]


def test_hidden_expected_values_never_reach_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = tasks.sandbox.run

    def spy(code: str, cfg: object = None) -> object:
        seen.append(code)
        return real(code, cfg)  # type: ignore[arg-type]

    monkeypatch.setattr(tasks.sandbox, "run", spy)
    tasks.score(DOUBLE, "x=x*2;return x")
    assert seen and all(repr(DOUBLE.expected(x)) not in seen[0] for x in (5, 11, -8))


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        ("x=x+1;return x", True),
        ("return x*2", True),
        ("", False),
        ("x=x+1", False),
        ("return (x", False),
        ("<run>1</run>", False),
        ("return x" + "+1" * 100, False),
    ],
)
def test_format_check(answer: str, ok: bool) -> None:
    assert tasks.format_check(answer)[0] is ok


def test_final_answer_takes_the_text_after_the_last_observation() -> None:
    text = "<run>print(1)</run><out>1\n</out>x=x+1;return x\nignored"
    assert protocol.final_answer(text) == "x=x+1;return x"
    assert protocol.final_answer("<sum>2 runs</sum>return x") == "return x"


def test_demonstrations_follow_the_teacher() -> None:
    rng = random.Random(0)
    perfect = tasks.TeacherConfig(p_correct=1.0, p_hack=0.0)
    hacker = tasks.TeacherConfig(p_correct=1.0, p_hack=1.0)
    for seed in range(4):
        task = tasks.sample_task(seed)
        assert tasks.demonstration(task, rng, perfect) == task.reference()
        hack = tasks.demonstration(task, rng, hacker)
        assert str(task.expected(task.visible_x)) in hack
        assert not tasks.score(task, hack)[0], "an echo never earns reward"
    weak = tasks.TeacherConfig(p_correct=0.0, p_hack=0.0)
    task = Task("t", 0, (("add", 3), ("inc", None)), visible_x=1, hidden_x=(2, 9))
    assert tasks.demonstration(task, rng, weak) != task.reference()

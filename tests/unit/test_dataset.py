"""The dataset family: HumanEval/MBPP-shaped JSONL, its own tests in the sandbox, `env score`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from rlstream.envs import dataset, sandbox
from rlstream.envs.dataset import DatasetConfig, DatasetError, DatasetFamily, Problem, answer_of
from rlstream.envs.family import FamilySpec
from rlstream.envs.judges import Judge, JudgeConfig, judge_format, judge_tests
from rlstream.ops.cli import main

BOX = "userns"  # the weakest mode these tests accept; as root (CI) every run here is "full"


@pytest.fixture(scope="module")
def mini() -> DatasetFamily:
    return DatasetFamily("mini", DatasetConfig())


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_every_shipped_canonical_solution_passes_and_a_wrong_one_fails(mini: DatasetFamily) -> None:
    assert dataset.shipped() == ["builtin:mini_humaneval.jsonl", "builtin:pyfuncs.jsonl"]
    assert len(mini.problems) == 16
    for problem in mini.problems.values():
        assert problem.canonical_solution is not None
        verdict = mini.score_problem(problem, answer_of(problem.canonical_solution), BOX)
        assert verdict.passed, (problem.task_id, verdict.rationale)
        assert verdict.isolation in ("full", "userns") and verdict.error is None
    wrong = mini.score_problem(mini.problems["mini/0"], "    return x + 2\n", BOX)
    assert not wrong.passed and wrong.score == 0.0
    assert wrong.rationale == "assertion failed: assert candidate(0) == 3 (test line 2)"


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        (["{"], r":1: not JSON"),
        ([[1]], r":1: expected a JSON object"),
        ([{"task_id": "a", "prompt": "p", "entry_point": "f"}], r":1: field 'test' must be"),
        ([{"task_id": "a", "prompt": "p", "entry_point": "f-g", "test": "t"}], "not an identifier"),
        (
            [{"task_id": "a", "prompt": "p", "entry_point": "f", "test": "t"}] * 2,
            r":2: duplicate task_id 'a'",
        ),
        ([""], "no problems in the file"),
    ],
)
def test_a_bad_dataset_file_names_the_line(tmp_path: Path, rows: list[object], error: str) -> None:
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=error):
        dataset.load(str(path))


def test_answers_are_extracted_and_bodies_indented() -> None:
    assert answer_of("    return x\n") == "    return x\n"
    assert answer_of("return x") == "    return x\n"
    assert answer_of("x=x+3;return x") == "    x=x+3;return x\n"
    assert answer_of("<run>@test</run><out>0 failed</out>return 1") == "    return 1\n"
    assert answer_of("```python\ndef f(x):\n    return x\n```") == "def f(x):\n    return x\n"
    assert answer_of("def f(x):\n    return x") == "def f(x):\n    return x\n"
    assert answer_of("   \n") == ""


SECRET = "SECRET-7f3a"
SNEAKY = Problem(
    "sneaky/0",
    'def f():\n    """Return the right word."""\n',
    "f",
    f"def check(candidate):\n    assert candidate() == {SECRET!r}\n",
)


@pytest.mark.parametrize(
    "answer",
    [
        "    import sys; sys.exit(0)\n",  # exit 0 before the tests run
        "    import os; os._exit(0)\n",
        "    import os, signal; os.kill(os.getppid(), signal.SIGKILL)\n",  # kill the verdict
        "    print('pass'); print('0' * 32 + ' pass'); return ''\n",  # a fake verdict line
        "    import builtins; builtins.AssertionError = KeyError; return ''\n",
    ],
)
def test_the_answer_cannot_forge_a_pass(answer: str) -> None:
    fam = DatasetFamily.__new__(DatasetFamily)
    fam.cfg = DatasetConfig(wall_timeout_s=5)
    verdict = fam.score_problem(SNEAKY, answer, BOX)
    assert not verdict.passed and verdict.error is None, verdict


def test_the_hidden_tests_stay_out_of_the_answers_sight() -> None:
    """The answer hunts for the expected value everywhere it can read; it is nowhere."""
    hunt = textwrap.indent(
        textwrap.dedent(
            """
            import os, sys
            seen = [sys.stdin.read()]
            for top in ('/work', '/tmp', '/dev/shm', '/proc'):
                for root, dirs, files in os.walk(top):
                    dirs[:] = [d for d in dirs if not d.isdigit() or top != '/proc'][:50]
                    for name in files[:200]:
                        try:
                            seen.append(open(os.path.join(root, name), errors='replace').read(100000))
                        except OSError:
                            pass
            for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
                for part in ('cmdline', 'environ', 'fd/0', 'mem'):
                    try:
                        seen.append(open(f'/proc/{pid}/{part}', errors='replace').read(100000))
                    except OSError:
                        pass
            text = ' '.join(seen)
            at = text.find('SECRET-')
            return text[at:at + 11] if at >= 0 else 'not found'
            """
        ),
        "    ",
    )
    fam = DatasetFamily.__new__(DatasetFamily)
    fam.cfg = DatasetConfig(wall_timeout_s=10, cpu_limit_s=5)
    verdict = fam.score_problem(SNEAKY, hunt, BOX)
    assert not verdict.passed
    assert "not found" in verdict.rationale or "assertion failed" in verdict.rationale


def test_prose_prompts_are_mbpp_style(mini: DatasetFamily) -> None:
    problem = mini.problems["mini/14"]  # prompt in prose, tests call the function by name
    with pytest.raises(SyntaxError):
        compile("Write a function that" + problem.prompt, "<p>", "exec")
    good = "def unique_in_order(items):\n    return [x for i, x in enumerate(items) if i == 0 or items[i - 1] != x]\n"
    assert mini.score_problem(problem, good, BOX).passed
    bad = mini.score_problem(problem, "def unique_in_order(items):\n    return list(items)\n", BOX)
    assert "assertion failed: assert unique_in_order" in bad.rationale


def test_tools_read_write_and_visible_tests(mini: DatasetFamily) -> None:
    task = mini.sample(0)
    problem = mini.problem(task.task_id)
    env = DatasetFamily.environment(task.spec)
    assert [t.name for t in env.tools] == ["python", "test", "read", "write", "ls"]
    ws = env.workspace()
    box = sandbox.SandboxConfig(isolation=BOX)
    _, stub = env.call(ws, "@test", box)
    assert stub.status == "error" and "1 failed" in stub.output
    body = problem.prompt + (problem.canonical_solution or "")
    name, wrote = env.call(ws, "@write solution.py\n" + body, box)
    assert (name, wrote.status) == ("write", "ok")
    assert env.call(ws, "@read solution.py", box)[1].output == body
    _, ok = env.call(ws, "@test", box)
    assert ok.status == "ok" and "0 failed" in ok.output, ok.output
    _, ran = env.call(ws, "import solution\nprint(open('solution.py').read()[:3])", box)
    assert ran.output.startswith("def") and ran.isolation in ("full", "userns")
    env.call(ws, "@python open('notes.txt', 'w').write('kept')", box)
    assert env.call(ws, "@read notes.txt", box)[1].output == "kept", "the workspace persists"
    assert "notes.txt 4" in env.call(ws, "@ls", box)[1].output
    assert env.call(ws, "@read ../../etc/passwd", box)[1].status == "error"
    assert env.call(ws, "@nope", box)[1].output.startswith("unknown tool @nope")


def test_the_tests_judge_records_the_failing_assertion_and_isolation(mini: DatasetFamily) -> None:
    cfg = JudgeConfig(kind="tests", families={"mini": FamilySpec(plugin="dataset")}, isolation=BOX)
    task = mini.sample(3)
    problem = mini.problem(task.task_id)
    good = judge_tests({"task_id": task.task_id, "completion": problem.canonical_solution}, cfg)
    bad = judge_tests({"task_id": task.task_id, "completion": "    return None\n"}, cfg)
    assert good["passed"] and good["score"] == 1.0
    assert {k for k in good["details"] if k.startswith("isolation.")} <= {
        "isolation.full",
        "isolation.userns",
    }
    assert not bad["passed"] and bad["rationale"].startswith("assertion failed: assert candidate(")
    fmt = judge_format({"task_id": task.task_id, "completion": "return ("}, cfg)
    assert fmt["score"] == 0.0 and "does not compile" in fmt["rationale"]


def test_a_refusing_sandbox_is_a_recorded_judge_error(
    mini: DatasetFamily, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the accepted isolation the judge writes an error reward and stays up."""
    from rlstream.consumers.admission_rules import AdmissionConfig, PendingGroup, decide

    found = {"full": "needs root", "userns": "disabled", "rlimits": ""}
    monkeypatch.setattr(sandbox, "probe_mode", found.__getitem__)
    cfg = JudgeConfig(kind="tests", families={"mini": FamilySpec(plugin="dataset")})
    task = mini.sample(1)
    reward = judge_tests({"task_id": task.task_id, "completion": "    return 1\n"}, cfg)
    assert reward["score"] == 0.0 and reward["error"].startswith(
        "sandbox refused: isolation 'full'"
    )
    group = PendingGroup(task.task_id, task.task_id, 2, 0)
    for i in range(2):
        group.add_sample({"sample_index": i, "policy_version": 3})
        group.add_reward({"sample_index": i, "judge": "tests", **reward})
        group.add_reward({"sample_index": i, "judge": "format", "score": float(i)})
    verdict = decide(group, 1, 3, AdmissionConfig())
    assert verdict is not None and verdict.reason == "judge_error"
    assert "tests: sandbox refused" in verdict.detail


def test_the_judge_scores_each_distinct_answer_once(mini: DatasetFamily) -> None:
    cfg = JudgeConfig(kind="tests", families={"mini": FamilySpec(plugin="dataset")}, isolation=BOX)
    judge = Judge("r", "tests", cfg)
    task = mini.sample(2)
    traj = {"task_id": task.task_id, "completion": "    return 0\n"}
    first, _ = judge.score(traj)
    second, ms = judge.score({**traj, "completion": "<run>1</run><out>1</out>return 0"})
    assert second == first and ms < 50 and len(judge.memo) == 1


def test_env_score_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answers = _write(
        tmp_path / "answers.jsonl",
        [
            {"task_id": "mini/0", "completion": "    return x + 3\n"},
            {"task_id": "mini/1", "completion": "    return 0\n"},
            "not json",
            {"task_id": "nope/1", "completion": "return 1"},
        ],
    )
    tasks = "builtin:mini_humaneval.jsonl"
    argv = ["env", "score", "--tasks", tasks, "--answers", str(answers), "--json"]
    argv += ["--isolation", BOX]
    assert main(argv) == 1  # some lines were errors
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [ln.get("task_id") for ln in lines[:4]] == ["mini/0", "mini/1", None, "nope/1"]
    assert (
        lines[0]["passed"]
        and lines[0]["reward"] == 1.0
        and lines[0]["isolation"] in ("full", "userns")
    )
    assert set(lines[0]) == {"task_id", "passed", "reward", "isolation", "detail", "error"}
    assert "assertion failed" in lines[1]["detail"] and not lines[1]["error"]
    assert lines[2]["error"] and "answers.jsonl:3: not JSON" in lines[2]["detail"]
    assert lines[3]["error"] and "unknown task_id 'nope/1'" in lines[3]["detail"]
    assert lines[4] == {"tasks": 4, "passed": 1, "errors": 2}
    assert main(["env", "score", "--tasks", tasks, "--canonical", "--isolation", BOX]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "16 tasks, 16 passed, 0 errors, 0 broken"
    assert main(["env", "score", "--tasks", str(tmp_path / "missing.jsonl"), "--canonical"]) == 2


def test_a_task_that_cannot_pass_fails_the_self_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--canonical`` exits 1 naming each task whose reference fails: tests importing a missing
    module, a syntax error in the tests, a wrong entry point, no canonical solution."""
    good = json.loads(dataset.DATA.joinpath("mini_humaneval.jsonl").read_text().splitlines()[0])
    rows = [
        good,
        {**good, "task_id": "b/import", "test": "import no_such_module\n" + good["test"]},
        {**good, "task_id": "b/syntax", "test": "def check(candidate:\n    pass\n"},
        {**good, "task_id": "b/entry", "entry_point": "add_four"},
        {k: v for k, v in {**good, "task_id": "b/none"}.items() if k != "canonical_solution"},
    ]
    tasks = _write(tmp_path / "tasks.jsonl", rows)
    assert main(["env", "score", "--tasks", str(tasks), "--canonical", "--isolation", BOX]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines()[-1].endswith("4 broken")
    named = [line for line in out.err.splitlines() if "its reference solution fails" in line]
    assert sorted(line.split(":")[1].strip() for line in named) == sorted(
        ["b/import", "b/syntax", "b/entry", "b/none"]
    )

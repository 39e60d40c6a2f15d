"""Held-out splits are disjoint from training by construction, for every task family.

The property: nothing of an eval task's content (fx: its spec, its prompt; dataset: its prompt
and tests) is among the tasks the scheduler releases for training or the warm start learns from.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlstream.envs import family
from rlstream.envs import fx_tasks as tasks
from rlstream.envs.dataset import DatasetConfig, DatasetError, DatasetFamily, Problem, split_of
from rlstream.envs.family import FamilySpec
from rlstream.ops.run.config import load_run_config
from rlstream.rollout.scheduler import SchedulerConfig, task_record


def _fx_spec(prompt: str) -> str:
    return prompt.split("\n", 1)[0].removeprefix("f(x): ")


def test_fx_eval_specs_never_appear_among_training_tasks() -> None:
    cfg = load_run_config().role("scheduler")
    assert isinstance(cfg, SchedulerConfig)
    fx = family.families({"fx": FamilySpec(options=cfg.tasks.model_dump())})["fx"]
    held_out = fx.eval_tasks(64)
    assert len({t.task_id for t in held_out}) == 64
    eval_specs = {_fx_spec(t.prompt) for t in held_out}
    assert len(eval_specs) == 64, "each held-out spec counts once"
    eval_prompts = {t.prompt for t in held_out}
    released = [task_record("r", cfg, i, 0) for i in range(4000)]
    train_specs = {_fx_spec(r["prompt"]) for r in released}
    assert len(train_specs) > 500, "the training draw covers most training specs"
    assert not eval_specs & train_specs, "a held-out spec was released for training"
    assert not eval_prompts & {r["prompt"] for r in released}
    # the warm start's demonstrations draw from the same training split
    rng = random.Random(0)
    warm = {
        tasks.spec_text(tasks.sample_task(rng.randrange(tasks.EVAL_SEED_BASE), cfg.tasks).steps)
        for _ in range(4000)
    }
    assert not eval_specs & warm
    # the rule itself: every spec of a split, whatever the seed
    for t in held_out:
        steps = tasks.sample_task(t.seed, cfg.tasks).steps
        assert tasks.split_of_steps(steps, cfg.tasks.eval_fraction) == "eval"


def test_fx_split_is_by_spec_and_covers_the_configured_share() -> None:
    cfg = tasks.TaskConfig()
    every = {((op.word, k),) for op in tasks.OPS for k in (op.params or (None,))}
    pairs = {a + b for a in every for b in every}
    specs = every | pairs
    held = [s for s in specs if tasks.split_of_steps(s, cfg.eval_fraction) == "eval"]
    assert 0.10 < len(held) / len(specs) < 0.20
    assert all(tasks.split_of_steps(s, cfg.eval_fraction) == "eval" for s in held), "stable"


def test_dataset_split_field_wins_else_a_stable_hash(tmp_path: Path) -> None:
    rows = []
    for i in range(40):
        row = {
            "task_id": f"p/{i}",
            "prompt": f"def f(x):\n    '''problem {i}'''\n",
            "entry_point": "f",
            "test": f"def check(candidate):\n    assert candidate({i}) == {i}\n",
        }
        if i < 10:
            row["split"] = "test" if i % 2 else "train"
        rows.append(row)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fam = DatasetFamily("p", DatasetConfig(path=str(path), eval_fraction=0.3))
    held_out = fam.eval_tasks(100)
    eval_rows = {t.spec["row"] for t in held_out}
    assert {f"p/{i}" for i in range(10) if i % 2} <= eval_rows
    assert not {f"p/{i}" for i in range(10) if not i % 2} & eval_rows
    hashed = [r for r in eval_rows if int(r.split("/")[1]) >= 10]
    assert 0 < len(hashed) < 30
    again = DatasetFamily("p", DatasetConfig(path=str(path), eval_fraction=0.3))
    assert [t.task_id for t in again.eval_tasks(100)] == [t.task_id for t in held_out]
    trained = [fam.sample(seed) for seed in range(2000)]
    problems = {r["task_id"]: r for r in rows}
    train_content = {
        (problems[t.spec["row"]]["prompt"], problems[t.spec["row"]]["test"]) for t in trained
    }
    eval_content = {(problems[r]["prompt"], problems[r]["test"]) for r in eval_rows}
    assert not eval_content & train_content, "a held-out problem was released for training"
    assert len(train_content) == 40 - len(eval_rows), "every training problem is drawn"


def test_shipped_dataset_holds_out_some_problems() -> None:
    mini = DatasetFamily("mini", DatasetConfig())
    held = {t.spec["row"] for t in mini.eval_tasks(16)}
    assert held and len(held) < 16
    assert not held & {mini.sample(s).spec["row"] for s in range(500)}
    p = Problem("x", "p", "f", "t", split="validation")
    assert split_of(p, 0.0) == "eval"


def test_held_out_task_ids_are_refused_outside_evaluation() -> None:
    """A held-out problem is never scored, format-checked or judged as a training task."""
    import pytest

    from rlstream.envs.judges import JudgeConfig, judge_format, judge_tests
    from rlstream.envs.sandbox.attacks import heldout_task_ids

    mini = DatasetFamily("mini", DatasetConfig())
    train_id, eval_id = heldout_task_ids(mini)
    held = mini.problems[train_id.split(":", 1)[1]]
    assert split_of(held, mini.cfg.eval_fraction) == "eval"
    answer = held.canonical_solution or ""
    with pytest.raises(ValueError, match="held-out"):
        mini.score(train_id, answer, "userns")
    with pytest.raises(ValueError, match="held-out"):
        mini.format_check(train_id, answer)
    specs = {"mini": FamilySpec(plugin="dataset"), "fx": FamilySpec()}
    judge = JudgeConfig(families=specs, isolation="userns")
    for task_id in (train_id, eval_id):
        for rubric in (judge_tests, judge_format):
            reward = rubric({"task_id": task_id, "completion": answer}, judge)
            assert reward.get("error") and not reward["passed"], (task_id, rubric, reward)
    fx_fam = family.families({"fx": FamilySpec()})["fx"]
    for task_id in heldout_task_ids(fx_fam):  # type: ignore[arg-type]
        reward = judge_tests({"task_id": task_id, "completion": "return x"}, judge)
        assert reward.get("error") and "held-out" in reward["error"], reward
    # evaluation scores the held-out set, and the same ids are accepted there
    evaluation = judge.model_copy(update={"evaluation": True})
    assert judge_tests({"task_id": eval_id, "completion": answer}, evaluation)["passed"]
    first = mini.eval_tasks(16)[0]
    canonical = mini.problem(first.task_id).canonical_solution or ""
    assert mini.score(first.task_id, canonical, "userns").passed
    assert {mini.split_of_task(t.task_id) for t in mini.eval_tasks(16)} == {"eval"}
    assert {mini.split_of_task(mini.sample(s).task_id) for s in range(50)} == {"train"}


def test_an_unknown_split_is_refused_not_trained(tmp_path: Path) -> None:
    row = {
        "task_id": "p/0",
        "prompt": "def f(x):\n    '''x'''\n",
        "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(1) == 1\n",
        "split": "evall",
    }
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"p.jsonl:1: split 'evall' is none of"):
        DatasetFamily("p", DatasetConfig(path=str(path)))

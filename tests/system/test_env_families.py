"""A run whose only task family is a user's JSONL dataset trains through the whole pipeline.

Every role is its own process on a real broker (scheduler, rollout, the tests and format judges,
admission, learner). The recipe names one family, ``ds``: the dataset plugin on a small
HumanEval-shaped file. Checked from the topics: every released task is a ``ds`` problem; every
``tests`` reward ran the problem's own test code in the sandbox and records the isolation and
the verdict (the failing assertion or error, or a pass); every group is decided once; and the
learner publishes new policy versions from admitted dataset groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import (
    PIPELINE_ROLES,
    decisions,
    decode_all,
    manifest_records,
    start_recipe_roles,
    stop_procs,
    wait_for,
)

from rlstream.producers.client.admin import ensure_run_topics
from rlstream.schemas import topics

pytestmark = pytest.mark.slow

TASKS = 6
PROBLEMS = [
    ("add_three", "x", "add 3", "x + 3", [(1, 4), (-3, 0)]),
    ("double", "x", "double", "x * 2", [(2, 4), (0, 0)]),
    ("negate", "x", "negate", "-x", [(5, -5), (0, 0)]),
    ("square", "x", "square", "x * x", [(3, 9), (-2, 4)]),
]


def _dataset(path: Path) -> Path:
    with path.open("w") as fh:
        for i, (name, arg, doc, body, cases) in enumerate(PROBLEMS):
            test = "def check(candidate):\n" + "".join(
                f"    assert candidate({a}) == {want}\n" for a, want in cases
            )
            row = {
                "task_id": f"tiny/{i}",
                "prompt": f'def {name}({arg}):\n    """{doc}"""\n',
                "entry_point": name,
                "test": test,
                "canonical_solution": f"    return {body}\n",
            }
            fh.write(json.dumps(row) + "\n")
    return path


def _recipe(tmp: Path) -> Path:
    data = _dataset(tmp / "tiny.jsonl")
    recipe = tmp / "dataset.toml"
    recipe.write_text(
        f"""
seed = 3
group_size = 4
groups_per_step = 2
max_staleness = 2
isolation = "userns"  # the strongest mode available is used: full as root (CI)

[families.ds]
plugin = "dataset"
options = {{ path = "{data}", wall_timeout_s = 5.0 }}

[scheduler]
max_tasks = {TASKS}

[rollout.harness]
max_new_tokens = 24

[learner]
lr = 0.0005
keyframe_every = 4
state_dir = "{tmp / "learner"}"
warm_start_cache = "{tmp / "warm.pt"}"

[learner.warm_start]
steps = 30

[admission]
reject_no_signal = false
timeout_s = 120.0

[judges.tests]
kind = "tests"

[judges.format]
kind = "format"
"""
    )
    return recipe


def test_a_dataset_family_trains_through_the_pipeline(kafka, unique_run, tmp_path):
    run = unique_run
    recipe = str(_recipe(tmp_path))
    ensure_run_topics(kafka, run)
    procs = start_recipe_roles(kafka, run, tmp_path, recipe, PIPELINE_ROLES)
    try:
        wait_for(lambda: len(decisions(kafka, run)) >= TASKS, 150, procs)
        wait_for(lambda: any(v["version"] >= 2 for v in manifest_records(kafka, run)), 60, procs)
        decided = decisions(kafka, run)
        assert len(decided) == TASKS and all(len(v) == 1 for v in decided.values())
        released = [d.record for d in decode_all(kafka, topics.topic_name(run, "tasks"))]
        assert {t["family"] for t in released} == {"ds"}
        assert all(t["task_id"].startswith("ds-") for t in released)
        assert all("test" not in json.loads(t["spec_json"]) for t in released)
        rewards = [d.record for d in decode_all(kafka, topics.topic_name(run, "rewards"))]
        tests = [r for r in rewards if r["judge"] == "tests"]
        assert len(tests) >= TASKS * 4
        expected = "isolation.full" if os.geteuid() == 0 else "isolation.userns"
        for r in tests:
            assert r["error"] is None, r
            assert r["details"].get(expected) == 1.0 or "isolation.not_run" in r["details"], r
            ran = "isolation.not_run" not in r["details"]
            assert not ran or r["rationale"] == "all tests pass" or r["rationale"].startswith(
                ("assertion failed: assert candidate(", "the answer does not load", "Runtime",
                 "TypeError", "NameError", "ZeroDivisionError", "timeout", "killed")
            ), r["rationale"]  # fmt: skip
        trajectories = decode_all(kafka, topics.topic_name(run, "trajectories"))
        assert all(d.record["task_id"].startswith("ds-") for d in trajectories)
        admitted = {g for g, v in decided.items() if v == ["admitted"]}
        trained = {
            (ref["topic"], ref["partition"], ref["offset"])
            for m in manifest_records(kafka, run)
            if m["version"] > 0
            for ref in m["step_inputs"]
        }
        assert admitted and trained, "the learner trained on admitted dataset groups"
    finally:
        stop_procs(procs)

"""A run whose only task family is ``repo`` (the shipped repository tasks) trains through the
whole pipeline, every role its own process on a real broker.

Checked from the topics: every released task is a repo task whose spec names the task file and
instance (never the reference patch nor the tests to pass); every trajectory's completion is the
workspace's diff (a patch, possibly empty); every ``tests`` reward ran the repository's tests in
the sandbox (isolation recorded, no error), a patch that changes nothing failing; every group is
decided once, and the learner publishes versions trained on admitted repo groups. Learning is
not expected of the tiny character model.
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

from rlstream.envs import patches
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.schemas import topics

pytestmark = pytest.mark.slow

TASKS = 4


def _recipe(tmp: Path) -> Path:
    recipe = tmp / "repo.toml"
    recipe.write_text(
        f"""
seed = 5
group_size = 2
groups_per_step = 2
max_staleness = 2
isolation = "userns"  # the strongest mode available is used: full as root

[policy]
max_seq_len = 1024

[families.repo]
plugin = "repo"
options = {{ path = "builtin:repo/tasks.jsonl", eval_fraction = 0.0, wall_timeout_s = 60.0 }}

[scheduler]
max_tasks = {TASKS}

[rollout.harness]
max_new_tokens = 16
max_turns = 1

[learner]
lr = 0.0005
keyframe_every = 4
state_dir = "{tmp / "learner"}"
warm_start_cache = "{tmp / "warm.pt"}"

[learner.warm_start]
steps = 0

[admission]
reject_no_signal = false
timeout_s = 240.0

[judges.tests]
kind = "tests"

[judges.format]
kind = "format"
"""
    )
    return recipe


def test_a_repo_only_run_trains_through_the_pipeline(kafka, unique_run, tmp_path):
    run = unique_run
    recipe = str(_recipe(tmp_path))
    ensure_run_topics(kafka, run)
    procs = start_recipe_roles(kafka, run, tmp_path, recipe, PIPELINE_ROLES)
    try:
        wait_for(lambda: len(decisions(kafka, run)) >= TASKS, 420, procs)
        wait_for(lambda: any(v["version"] >= 1 for v in manifest_records(kafka, run)), 120, procs)
        decided = decisions(kafka, run)
        assert len(decided) == TASKS and all(len(v) == 1 for v in decided.values())
        released = [d.record for d in decode_all(kafka, topics.topic_name(run, "tasks"))]
        assert {t["family"] for t in released} == {"repo"}
        for t in released:
            spec = json.loads(t["spec_json"])
            assert set(spec) == {"plugin", "path", "instance_id"} and spec["plugin"] == "repo"
        trajectories = [d.record for d in decode_all(kafka, topics.topic_name(run, "trajectories"))]
        assert trajectories and all(t["task_id"].startswith("repo-") for t in trajectories)
        for t in trajectories:
            patches.parse(t["completion"])  # a diff (empty when nothing was changed)
        rewards = [d.record for d in decode_all(kafka, topics.topic_name(run, "rewards"))]
        assert len([r for r in rewards if r["judge"] == "tests"]) >= TASKS * 2
        expected = "isolation.full" if os.geteuid() == 0 else "isolation.userns"
        tests = [r for r in rewards if r["judge"] == "tests"]
        for r in tests:
            assert r["error"] is None, r
            assert r["details"].get(expected) == 1.0 or "patch.does_not_apply" in r["details"], r
        unchanged = {t["task_id"] for t in trajectories if not t["completion"].strip()}
        assert all(not r["passed"] for r in tests if r["task_id"] in unchanged)
        admitted = {g for g, v in decided.items() if v == ["admitted"]}
        trained = [
            ref
            for m in manifest_records(kafka, run)
            if m["version"] > 0
            for ref in m["step_inputs"]
        ]
        assert admitted and trained, "the learner trained on admitted repo groups"
    finally:
        stop_procs(procs)

"""A run's recorded config on a real broker: the first role records it, a role with the same
config (local values aside) starts, a role with another is refused naming the keys that differ,
and the supervisor does not restart it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlstream.consumers.run_log import run_manifest
from rlstream.ops.demo.demo import credentials_env
from rlstream.ops.run import recorded
from rlstream.ops.run.config import load_run_config
from rlstream.producers.client.admin import ensure_run_topics


def _check(kafka, run: str, *sets: str) -> str:
    config = load_run_config(None, list(sets))
    return recorded.check_config(kafka, run, config, region="trainer", trainer="trainer")


def test_the_first_role_records_and_the_others_are_checked(kafka, unique_run) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    assert "recorded for run" in _check(kafka, run, "learner.lr=0.02")
    manifest = run_manifest(kafka, run)
    assert manifest is not None and '"lr":0.02' in manifest["config_json"].replace(" ", "")
    assert "the run's" in _check(kafka, run, "learner.lr=0.02")
    # a value of this host only (a path, threads) is not the run's to decide
    assert "the run's" in _check(kafka, run, "learner.lr=0.02", "learner.state_dir=/x")
    with pytest.raises(recorded.ConfigMismatch) as refused:
        _check(kafka, run, "learner.lr=0.5", "group_size=4")
    text = str(refused.value)
    assert "learner.lr: recorded 0.02, here 0.5" in text
    assert "group_size: recorded 8, here 4" in text


def test_demo_and_launch_refuse_to_reuse_a_run_with_another_config(kafka, unique_run) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    base = load_run_config(None, [])
    digest = recorded.create_run(kafka, run, base, ["trainer"])
    assert recorded.create_run(kafka, run, base, ["trainer"]) == digest  # the same: a restart
    with pytest.raises(recorded.ConfigMismatch, match="seed: recorded 0, here 3"):
        recorded.create_run(kafka, run, load_run_config(None, ["seed=3"]), ["trainer"])


def test_a_role_started_with_another_config_exits_2_and_is_not_restarted(kafka, unique_run):
    run = unique_run
    ensure_run_topics(kafka, run)
    recorded.create_run(kafka, run, load_run_config(None, []), ["trainer"])
    cmd = [sys.executable, "-m", "rlstream", "run", "scheduler", "--run", run]
    cmd += ["--bootstrap", kafka.bootstrap_servers, "--set", "max_staleness=5"]
    env = {**os.environ, **credentials_env(kafka)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "max_staleness: recorded 2, here 5" in out.stderr
    assert out.stderr.count("started (pid") == 1  # the supervisor gave up at once
    assert "refused its configuration" in out.stderr

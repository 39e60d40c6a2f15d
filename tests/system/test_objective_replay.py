"""The learner role under objectives other than the default, in the asynchronous pipeline on a
real broker (every role its own process): it trains versions, and replaying the recorded
admitted stream reproduces every version bit-exactly (several optimizer steps per version, the
proximal and reference policies, the entropy bonus and over-long handling included)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from helpers import stop_procs, wait_for

from rlstream.consumers.weights.manifest_log import read_manifests
from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics

pytestmark = pytest.mark.slow

BASE = [
    "groups_per_step=2",
    "group_size=4",
    "max_staleness=2",
    "scheduler.max_tasks=10",
    "learner.warm_start.steps=30",
    "learner.keyframe_every=3",
    "admission.reject_no_signal=false",
    "rollout.harness.max_new_tokens=24",
]
OBJECTIVES = {
    "decoupled_ppo": [
        "learner.loss.kind=decoupled_ppo",
        "learner.loss.minibatches=2",
        "learner.loss.kl_coef=0.05",
        "learner.loss.entropy_coef=0.01",
        "learner.loss.overlong.mode=penalty",
        "learner.loss.overlong.max_len=24",
    ],
    "masked_is": [
        "learner.loss.kind=masked_is",
        "learner.loss.minibatches=2",
        "learner.loss.overlong.mode=mask",
    ],
}


def _sets(kind: str, tmp: Path) -> list[str]:
    return [
        *BASE,
        *OBJECTIVES[kind],
        f"learner.state_dir={tmp / 'learner'}",
        f"learner.warm_start_cache={tmp / 'warm.pt'}",
    ]


def _start(role: str, run: str, kafka, tmp: Path, kind: str, *extra: str) -> subprocess.Popen:
    name = "-".join([role, *[e for e in extra if not e.startswith("-")]])
    args = [a for s in _sets(kind, tmp) for a in ("--set", s)]
    return start_role(role, run, kafka, tmp, [*args, *extra], name).proc


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_the_learner_trains_and_replays_bit_exactly_under_an_objective(
    kafka, unique_run, tmp_path, kind: str
):
    run = unique_run
    ensure_run_topics(kafka, run)
    procs = {
        "learner": _start("learner", run, kafka, tmp_path, kind),
        "admission": _start("admission", run, kafka, tmp_path, kind),
        "judge-tests": _start("judge", run, kafka, tmp_path, kind, "--name", "tests"),
        "judge-format": _start("judge", run, kafka, tmp_path, kind, "--name", "format"),
        "rollout": _start("rollout", run, kafka, tmp_path, kind, "--member", "0"),
        "scheduler": _start("scheduler", run, kafka, tmp_path, kind),
    }
    try:
        wait_for(lambda: len(_deltas(kafka, run)) >= 3, 400, procs)
    finally:
        stop_procs(procs)
    deltas = _deltas(kafka, run)
    assert all(m["stats"]["minibatches"] == 2.0 for m in deltas), [m["stats"] for m in deltas]
    _check_replay(kafka, run, tmp_path, kind, deltas[-1]["version"])


def _deltas(kafka, run: str) -> list[dict]:
    return [m for m in read_manifests(kafka, run, "policy") if m["kind"] == "delta"]


def _check_replay(kafka, run: str, tmp: Path, kind: str, last_version: int) -> None:
    from rlstream.ops.forensics.replay import replay
    from rlstream.ops.run.config import load_run_config
    from rlstream.ops.run.recorded import record_run_manifest

    config = load_run_config(None, _sets(kind, tmp))
    record_run_manifest(kafka, run, config, "finished", int(time.time() * 1000), ["trainer"])
    result = replay(kafka, run, log=lambda _: None)
    assert result.diverged_at is None, result.detail
    assert result.versions >= last_version >= 3

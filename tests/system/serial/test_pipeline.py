"""The asynchronous GRPO pipeline on a real broker, every role its own process.

One short run checks what must hold whatever the numbers:
- killing the learner, admission, a judge, a rollout worker and the scheduler with SIGKILL
  mid-run and restarting them loses no group and trains none twice (checked from the topics,
  by group id);
- the learner resumes from its last version (versions are consecutive, none published twice);
- a group whose samples are too old is rejected with the reason ``stale``;
- replaying the recorded admitted stream reproduces every version bit-exactly, across the
  learner's crash and restart.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import decisions, decode_all, stop_procs, wait_for

from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.schemas import topics

pytestmark = pytest.mark.slow

TASKS = 16
SETTINGS = [
    "--set",
    "groups_per_step=2",
    "--set",
    "group_size=4",
    "--set",
    "max_staleness=1",
    "--set",
    f"scheduler.max_tasks={TASKS}",
    "--set",
    "learner.warm_start.steps=30",
    "--set",
    "learner.keyframe_every=3",
    "--set",
    "admission.reject_no_signal=false",
    "--set",
    "rollout.harness.max_new_tokens=24",
]


def _start(role: str, run: str, kafka, tmp: Path, *extra: str) -> subprocess.Popen:
    name = "-".join([role, *[e for e in extra if not e.startswith("-")]])
    sets = [
        *SETTINGS,
        "--set",
        f"learner.state_dir={tmp / 'learner'}",
        "--set",
        f"learner.warm_start_cache={tmp / 'warm.pt'}",
    ]
    return start_role(role, run, kafka, tmp, [*sets, *extra], name).proc


def test_roles_killed_and_restarted_lose_nothing_and_train_nothing_twice(
    kafka, unique_run, tmp_path
):
    run = unique_run
    ensure_run_topics(kafka, run)
    procs = {
        "learner": _start("learner", run, kafka, tmp_path),
        "admission": _start("admission", run, kafka, tmp_path),
        "judge-tests": _start("judge", run, kafka, tmp_path, "--name", "tests"),
        "judge-format": _start("judge", run, kafka, tmp_path, "--name", "format"),
        "rollout": _start("rollout", run, kafka, tmp_path, "--member", "0"),
        "scheduler": _start("scheduler", run, kafka, tmp_path),
    }
    try:
        wait_for(lambda: len(decisions(kafka, run)) >= 4, 240, procs)
        restart = {
            "learner": ("learner",),
            "admission": ("admission",),
            "rollout": ("rollout", "--member", "0"),
            "judge-tests": ("judge", "--name", "tests"),
            "scheduler": ("scheduler",),
        }
        for name in restart:  # every kind of role dies at once, mid-run
            os.kill(procs[name].pid, signal.SIGKILL)
            procs[name].wait()
        for name, (role, *extra) in restart.items():
            procs[name] = _start(role, run, kafka, tmp_path, *extra)
        wait_for(lambda: len(decisions(kafka, run)) >= TASKS, 300, procs)
        decided = decisions(kafka, run)
        n_admitted = sum(v == ["admitted"] for v in decided.values())
        wait_for(lambda: _trained_groups(kafka, run)[1] >= n_admitted // 2 * 2, 120, procs)
        assert len(decided) == TASKS, "a group was lost"
        assert all(len(v) == 1 for v in decided.values()), "a group was decided twice"
        trained, _ = _trained_groups(kafka, run)
        counts = collections.Counter(trained)
        assert max(counts.values()) == 1, (
            f"trained twice: {[g for g, c in counts.items() if c > 1]}"
        )
        admitted = {g for g, v in decided.items() if v == ["admitted"]}
        assert set(counts) <= admitted
        versions = [
            d.record["version"]
            for d in decode_all(kafka, topics.topic_name(run, "weights.manifests"))
            if d.record["kind"] == "delta" or d.record["version"] == 0
        ]
        assert versions == list(range(len(versions))), f"versions not consecutive: {versions}"
        _check_stale_rejected(kafka, run, procs)
        _check_replay_is_bit_exact(kafka, run, tmp_path, versions[-1])
    finally:
        stop_procs(procs)


def _trained_groups(kafka, run: str) -> tuple[list[str], int]:
    """Group ids behind every step's inputs (from the manifests), and how many there are."""
    from rlstream.ops.observe.ledger import trained_groups

    groups = trained_groups(kafka, run)
    return groups, len(groups)


def _check_stale_rejected(kafka, run: str, procs: dict) -> None:
    """Samples from version 0 arriving when the learner is past max_staleness: rejected."""
    from test_events import examples

    from rlstream.rollout.scheduler import SchedulerConfig, task_record

    traj = examples()["trajectory"]
    # released to this region, as the scheduler releases: admission takes released groups only
    task = {**task_record(run, SchedulerConfig(), 0, 0), "task_id": "old-group"}
    with EventProducer.connect(kafka) as producer:
        producer.produce(
            topics.topic_name(run, "tasks"),
            "task",
            {**task, "tags": {"region": "trainer"}},
            "old-group",
        )
        for i in range(4):
            producer.produce(
                topics.topic_name(run, "trajectories"),
                "trajectory",
                {
                    **traj,
                    "run": run,
                    "group_id": "old-group",
                    "task_id": "old-group",
                    "sample_index": i,
                    "group_size": 4,
                    "segment_index": 0,
                    "segment_count": 1,
                    "token_offset": 0,
                    "policy_version": 0,
                },
                "old-group",
            )
    wait_for(lambda: decisions(kafka, run).get("old-group") == ["stale"], 60, procs)


def _check_replay_is_bit_exact(kafka, run: str, tmp: Path, last_version: int) -> None:
    from rlstream.ops.forensics.replay import replay
    from rlstream.ops.run.config import load_run_config
    from rlstream.ops.run.recorded import record_run_manifest

    sets = [v for i, v in enumerate(SETTINGS) if SETTINGS[i - 1] == "--set"]
    sets += [f"learner.state_dir={tmp / 'learner'}", f"learner.warm_start_cache={tmp / 'warm.pt'}"]
    config = load_run_config(None, sets)
    record_run_manifest(kafka, run, config, "finished", int(time.time() * 1000), ["trainer"])
    result = replay(kafka, run, log=lambda _: None)
    assert result.diverged_at is None, result.detail
    assert result.versions >= last_version >= 4

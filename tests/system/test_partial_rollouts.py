"""Partial rollouts in the pipeline (``torch`` engine), every role its own process, on a real
broker: a new version does not wait for the task in progress.

Checks, with ``rollout.swap = "partial"`` (the default): some trajectories span more than one
version; every trajectory's spans cover its tokens in order with ascending versions, and its
``policy_version`` is the oldest span; admission's staleness and behaviour versions are taken
from the spans (oldest, newest). With ``rollout.swap = "between_tasks"`` (the old behaviour,
chosen by the recipe) every trajectory is one version.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from helpers import decode_all, stop_procs, wait_for

from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.schemas import arrays, topics

pytestmark = pytest.mark.slow

SETS = [
    "groups_per_step=1",
    "group_size=4",
    "max_staleness=3",
    "scheduler.max_tasks=200",
    "learner.warm_start.steps=20",
    "learner.keyframe_every=4",
    "admission.reject_no_signal=false",
    "rollout.harness.max_new_tokens=48",
]


def _trajectories(kafka, run: str) -> list[dict]:
    pieces = [d.record for d in decode_all(kafka, topics.topic_name(run, "trajectories"))]
    whole = {}
    for p in pieces:
        whole.setdefault((p["group_id"], p["sample_index"], p["worker_id"]), []).append(p)
    return [arrays.join_segments(parts) for parts in whole.values()]


def _spanning(kafka, run: str) -> int:
    return sum(len(t["version_spans"]) > 1 for t in _trajectories(kafka, run))


def _run(kafka, run: str, tmp: Path, swap: str, until) -> None:
    ensure_run_topics(kafka, run)
    sets = [
        *SETS,
        f"rollout.swap={swap}",
        f"learner.state_dir={tmp / 'learner'}",
        f"learner.warm_start_cache={tmp / 'warm.pt'}",
    ]
    extra = [a for s in sets for a in ("--set", s)]
    roles = {
        "learner": ("learner",),
        "admission": ("admission",),
        "judge-tests": ("judge", "--name", "tests"),
        "judge-format": ("judge", "--name", "format"),
        "rollout": ("rollout", "--member", "0"),
        "scheduler": ("scheduler",),
    }
    procs = {}
    try:
        for name, (role, *rest) in roles.items():
            procs[name] = start_role(role, run, kafka, tmp, [*rest, *extra], name).proc
        wait_for(until, 600, procs, what=f"the pipeline ({swap})")
    finally:
        stop_procs(procs)


def _max_version(kafka, run: str) -> int:
    manifests = decode_all(kafka, topics.topic_name(run, "weights.manifests"))
    return max((d.record["version"] for d in manifests), default=-1)


@pytest.mark.unsecured_only("the roles are given a bare bootstrap")
def test_new_versions_reach_rollouts_in_progress(kafka, unique_run, tmp_path):
    run = unique_run
    _run(kafka, run, tmp_path, "partial", lambda: _spanning(kafka, run) >= 2)
    trajectories = _trajectories(kafka, run)
    for t in trajectories:
        spans = t["version_spans"]
        n = arrays.unpack_tokens(t).n_tokens
        assert spans[0]["token_start"] == 0 and spans[-1]["token_end"] == n
        assert all(a["token_end"] == b["token_start"] for a, b in itertools.pairwise(spans))
        assert all(a["version"] < b["version"] for a, b in itertools.pairwise(spans))
        assert t["policy_version"] == spans[0]["version"]
        assert t["learner_epoch"] == 1  # the run's first learner published every version
    oldest = {}
    for t in trajectories:
        old = oldest.get(t["group_id"], (10**9, -1))
        spans = t["version_spans"]
        oldest[t["group_id"]] = (
            min(old[0], spans[0]["version"]),
            max(old[1], spans[-1]["version"]),
        )
    decisions = [
        d.record
        for d in decode_all(kafka, topics.topic_name(run, "admitted"))
        if d.record["part_index"] == 0
    ]
    spanned = {t["group_id"] for t in trajectories if len(t["version_spans"]) > 1}
    assert decisions and spanned
    for d in decisions:
        low, high = oldest[d["group_id"]]
        assert d["min_behaviour_version"] == low and d["max_behaviour_version"] == high
        assert d["staleness"] == max(0, d["learner_version"] - low)


@pytest.mark.unsecured_only("the roles are given a bare bootstrap")
def test_between_tasks_keeps_one_version_per_trajectory(kafka, unique_run, tmp_path):
    run = unique_run

    def versions() -> set[int]:
        return {t["policy_version"] for t in _trajectories(kafka, run)}

    # until the learner is at version 6 and a worker has generated with a newer version than
    # the first (on a loaded machine admission may take six steps of version-0 groups first)
    _run(
        kafka,
        run,
        tmp_path,
        "between_tasks",
        lambda: _max_version(kafka, run) >= 6 and len(versions()) >= 2,
    )
    trajectories = _trajectories(kafka, run)
    assert len({t["policy_version"] for t in trajectories}) >= 2  # versions did change
    assert all(len(t["version_spans"]) == 1 for t in trajectories)

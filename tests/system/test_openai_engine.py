"""A rollout worker on the ``openai`` engine trains in the pipeline, against ``rlstream serve
policy --weights push`` over real HTTP, every role its own process, on a real broker.

Checks: the worker pushes each version it applied and verified to the server (SGLang's
``POST /update_weights_from_disk`` shape) and the server serves it, at least one after v0; every
trajectory carries a version the server reported in its answers (the served stream records
every answer with its version); groups are admitted and trained once each; the learner publishes
new versions.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import decode_all, stop_procs, wait_for

from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.schemas import topics

pytestmark = pytest.mark.slow

VERSIONS = 2
SETS = [
    "policy.architecture=qwen3_moe",
    "groups_per_step=2",
    "group_size=4",
    "max_staleness=2",
    f"scheduler.max_tasks={2 * VERSIONS + 4}",
    "learner.warm_start.steps=20",
    "learner.keyframe_every=2",
    "admission.reject_no_signal=false",
    "rollout.harness.max_new_tokens=16",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthz(base: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
            return dict(json.loads(resp.read()))
    except OSError:
        return None


def _start_server(run: str, kafka, tmp: Path, port: int) -> subprocess.Popen:
    (tmp / "pushed").mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "rlstream",
        "serve",
        "policy",
        "--run",
        run,
        "--bootstrap",
        kafka.bootstrap_servers,
        "--port",
        str(port),
        "--weights",
        "push",
        "--push-dir",
        str(tmp / "pushed"),
        *[a for s in SETS for a in ("--set", s)],
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(tmp / "serve.log", "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _max_version(kafka, run: str) -> int:
    manifests = decode_all(kafka, topics.topic_name(run, "weights.manifests"))
    return max((d.record["version"] for d in manifests), default=-1)


@pytest.mark.unsecured_only("the server and roles are given a bare bootstrap")
def test_openai_engine_worker_trains_against_serve_policy(kafka, unique_run, tmp_path, monkeypatch):
    run = unique_run
    # the push token, in the environment of the server and the worker (rollout.push_auth)
    monkeypatch.setenv("RLSTREAM_POLICY_PUSH_TOKEN", f"push-{run}-0123456789abcdef")
    ensure_run_topics(kafka, run)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    procs = {"serve": _start_server(run, kafka, tmp_path, port)}
    sets = [
        *SETS,
        f"learner.state_dir={tmp_path / 'learner'}",
        f"learner.warm_start_cache={tmp_path / 'warm.pt'}",
        "rollout.engine=openai",
        f"rollout.engine_url={base}",
        f"rollout.engine_weights_dir={tmp_path / 'pushed'}",
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
    try:
        for name, (role, *rest) in roles.items():
            procs[name] = start_role(role, run, kafka, tmp_path, [*rest, *extra], name).proc
        wait_for(lambda: _max_version(kafka, run) >= VERSIONS, 300, procs)
        # The worker applies (and pushes) a new version before its next task, so when the
        # learner's last version appears the server may still serve v0 for a task in progress.
        wait_for(
            lambda: (_healthz(base) or {}).get("policy_version", 0) >= 1,
            180,
            procs,
            what="the server serving a version pushed after v0",
        )
        health = _healthz(base)
        assert health is not None and health["following"] == "pushed", health
    finally:
        stop_procs(procs)

    served = decode_all(kafka, topics.topic_name(run, "served"))
    served_versions = {d.record["policy_version"] for d in served}
    trajectories = [
        d.record
        for d in decode_all(kafka, topics.topic_name(run, "trajectories"))
        if d.record.get("part_index", 0) == 0
    ]
    assert trajectories and served_versions
    assert {t["policy_version"] for t in trajectories} <= served_versions
    assert max(served_versions) >= 1, "the server was never pushed a version after v0"
    assert all(t["n_layers"] > 0 for t in trajectories), "routes came back from the server"
    log = (tmp_path / "serve.log").read_text()
    pushed = {int(v) for v in re.findall(r"serving pushed version (\d+) ", log)}
    assert 0 in pushed and max(pushed) >= 1, pushed  # the worker moves to the newest it has
    assert served_versions <= pushed

    from rlstream.ops.observe.ledger import trained_groups

    admitted = {
        d.record["group_id"]
        for d in decode_all(kafka, topics.topic_name(run, "admitted"))
        if d.record["part_index"] == 0
    }
    trained = collections.Counter(trained_groups(kafka, run))
    assert len(trained) >= 2 * VERSIONS, trained
    assert set(trained) <= admitted and max(trained.values()) == 1

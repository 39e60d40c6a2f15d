"""``bench chaos`` at a tiny size, on a temporary cluster of its own (its broker is killed): two
roles and the broker killed with SIGKILL, one round of poison, one of forged manifests, one
feedback replay, one round of every attack; the run must still lose nothing and train nothing
twice, the faults must show in what the roles wrote and logged, and every attack kind must be
tried and refused every time. Success figures at this size mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.ops.chaos.faults import ATTACKS

pytestmark = pytest.mark.slow

TASKS = 6
KINDS = (
    *("unsigned_manifest", "wrong_key", "version_jump", "epoch_jump", "replayed_manifest"),
    *("weak_hash", "unauthenticated_policy_push", "forged_feedback_tokens", "unreleased_task"),
    *("heldout_task", "planted_stdlib_module", "repo_report_forge", "repo_shadow_pytest"),
    *("repo_plugin_autoload", "file_under_file", "stop_iteration", "setup_failure_veto"),
    *("feedback_replay", "mirrored_trust_anchor"),
)
TINY = [
    "--tasks", str(TASKS), "--rollout-workers", "1", "--chaos-seconds", "20", "--role-kills", "2",
    "--broker-kills", "1", "--broker-down", "2", "--poison-rounds", "1", "--forged-rounds", "1",
    "--timeout", "300",
    "--set", "learner.warm_start.steps=5", "--set", "rollout.harness.max_new_tokens=16",
    "--set", "group_size=4", "--set", "groups_per_step=2",
    "--set", "admission.reject_no_signal=false",  # a weak policy's groups train too: version 1
]  # fmt: skip


@pytest.mark.unsecured_only("bench chaos starts its own unsecured cluster")
def test_chaos_bench_loses_nothing_and_shows_every_fault(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "RLSTREAM_RESULTS": str(tmp_path),
        "RLSTREAM_HUNG_TRANSACTION_S": "15",  # a role stuck by the broker restart exits sooner
    }
    for var in (
        "RLSTREAM_BOOTSTRAP",
        "RLSTREAM_WEIGHTS_SIGNING_KEY",
        "RLSTREAM_WEIGHTS_VERIFY_KEY",
    ):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "rlstream", "bench", "chaos", "--json", *TINY]
    cmd += ["--out", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["finished"] and r["groups_released"] == r["groups_decided"] == TASKS, r
    assert r["groups_lost"] == 0 and r["groups_decided_twice"] == 0, r
    assert r["groups_trained"] > 0 and r["groups_trained_twice"] == 0, r
    assert r["inputs_trained"] >= r["groups_trained"] and r["inputs_trained_twice"] == 0, r
    # the run replayed from its record: version 0 at least, and a divergence is named
    assert r["replay_reproduced_through"] >= 0, r
    assert (r["replay_diverged_at"] is None) == (r["replay_detail"] == ""), r
    assert r["poison_dead_lettered"] > 0 and r["poison_missed"] == 0 and r["poison_trained"] == 0
    assert r["forged_refused"] == r["forged_injected"] == len(ATTACKS), r
    assert r["genuine_refused"] == 0, r
    assert r["role_kills"] > 0 and r["role_restarts"] >= r["role_kills"], r
    assert r["broker_kills"] == 1 and r["roles_given_up"] == 0, r
    assert r["feedback_stored"] == 1 and r["feedback_replays_refused"] >= 4, r
    # every attack kind tried and refused every time, counted from what the run wrote
    from rlstream.ops.chaos import engine_attack

    # a vLLM engine's weights corrupted in place, where `make vllm` ran (CI runs it)
    engine = ("engine_weights_corrupted",) if engine_attack.available() else ()
    assert set(r["attacks"]) == {*KINDS, *engine}, r["attacks"]
    assert all(a["tried"] > 0 and a["refused"] == a["tried"] for a in r["attacks"].values()), r
    assert json.loads((tmp_path / "bench-chaos.json").read_text())["result"] == r

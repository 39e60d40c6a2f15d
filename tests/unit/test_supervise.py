"""Supervision of roles: restart rules, and a real child process restarted or given up on."""

from __future__ import annotations

import random
import subprocess
import sys

from rlstream.ops.run.supervise import RestartPolicy, supervise


def test_restart_delays_double_with_jitter_up_to_the_cap() -> None:
    policy, rng = RestartPolicy(base_s=1.0, cap_s=8.0), random.Random(0)
    for failures, nominal in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        delays = [policy.delay(failures, rng) for _ in range(200)]
        assert nominal * 0.75 <= min(delays) and max(delays) <= nominal * 1.25
        assert max(delays) - min(delays) > 0.2 * nominal  # jittered, not in lockstep


def test_gives_up_only_after_max_fast_failures_in_a_row() -> None:
    policy = RestartPolicy(max_fast=3)
    assert [policy.give_up(n) for n in range(5)] == [False, False, False, True, True]


def test_a_child_that_keeps_failing_fast_is_given_up_with_a_clear_message() -> None:
    lines: list[str] = []
    policy = RestartPolicy(base_s=0.01, max_fast=3)
    code = supervise(
        "judge.x (r1)", [sys.executable, "-c", "raise SystemExit(3)"], policy, lines.append
    )
    assert code == 3
    assert sum("started" in line for line in lines) == 3
    assert "failed 3 times in a row" in lines[-1] and "last exit code 3" in lines[-1]


def test_a_failed_child_is_restarted_and_a_clean_exit_ends_supervision(tmp_path) -> None:
    marker = tmp_path / "tries"
    script = (
        f"import pathlib, os, signal; p = pathlib.Path({str(marker)!r}); n = len(p.read_text()) "
        "if p.exists() else 0; p.write_text('x' * (n + 1)); "
        "os.kill(os.getpid(), signal.SIGKILL) if n < 2 else None"
    )
    lines: list[str] = []
    code = supervise(
        "rollout (r1)", [sys.executable, "-c", script], RestartPolicy(base_s=0.01), lines.append
    )
    assert code == 0 and marker.read_text() == "xxx"  # killed twice, restarted, then done
    assert sum("restarting" in line for line in lines) == 2


def test_rlstream_run_reports_a_role_that_cannot_start() -> None:
    cmd = [sys.executable, "-m", "rlstream", "run", "judge", "--run", "r1", "--name", "nope"]
    cmd += ["--max-fast-failures", "2", "--restart-backoff", "0.05"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no judge 'nope' in the config" in proc.stderr
    assert "judge.nope (r1) failed 2 times in a row" in proc.stderr


def test_a_child_refused_for_its_configuration_is_not_restarted() -> None:
    lines: list[str] = []
    policy = RestartPolicy(base_s=0.01, max_fast=3)
    code = supervise(
        "learner (r1)", [sys.executable, "-c", "raise SystemExit(2)"], policy, lines.append
    )
    assert code == 2
    assert sum("started" in line for line in lines) == 1
    assert "refused its configuration" in lines[-1]

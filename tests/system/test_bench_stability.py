"""``rlstream bench stability`` at a tiny size: every case trains the same number of samples,
carries the figures the benchmark promises, its staleness is the budget's, and the PNG is
written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_stability_bench_measures_every_case(tmp_path: Path) -> None:
    env = {**os.environ, "RLSTREAM_RESULTS": str(tmp_path)}
    args = [
        *("--objectives", "tis,decoupled_ppo", "--budgets", "0,2", "--seeds", "0"),
        *("--versions", "3", "--groups-per-step", "1", "--group-size", "2"),
        *("--eval-every", "3", "--eval-tasks", "2", "--warm-steps", "2"),
        *("--cache", str(tmp_path / "warm.pt"), "--png", str(tmp_path / "s.png")),
    ]
    cmd = [sys.executable, "-m", "rlstream", "bench", "stability", "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = result["cases"]
    assert [(c["loss"], c["max_staleness"]) for c in cases] == [
        ("tis", 0), ("tis", 2), ("decoupled_ppo", 0), ("decoupled_ppo", 2)
    ]  # fmt: skip
    assert {c["trained_samples"] for c in cases} == {3 * 2}
    keys = {"eval_warm_start", "eval_final", "mean_staleness", "kl_behaviour_p99"}
    keys |= {"clipped_or_masked_fraction", "wall_s", "seed"}
    assert all(keys <= set(c) for c in cases)
    # versions 1..3 under a budget of 2 were trained on groups 0, 1, 2 versions old
    assert [c["mean_staleness"] for c in cases] == [0.0, 1.0, 0.0, 1.0]
    assert all(c["kl_behaviour_p99"] >= -1e-6 for c in cases)  # k3 is never negative
    assert (tmp_path / "s.png").stat().st_size > 0
    assert json.loads((tmp_path / "bench-stability.json").read_text())["result"] == result

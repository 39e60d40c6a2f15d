"""``rlstream demo --engine``: the overrides that put the run on an engine, and the summary of
the rollout workers' engine figures (what ``--json`` reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.ops.demo.demo import engine_sets, engine_summary
from rlstream.ops.run.config import load_run_config
from rlstream.rollout.config import RolloutConfig, check_vllm_policy


def test_the_vllm_demo_runs_a_policy_vllm_can_serve(tmp_path: Path) -> None:
    config = load_run_config(None, engine_sets("vllm", tmp_path))
    rollout = config.role("rollout")
    assert isinstance(rollout, RolloutConfig) and rollout.engine == "vllm"
    check_vllm_policy(rollout.policy)  # heads of 64: no error
    assert rollout.engine_stats_dir == str(tmp_path / "engines")
    torch_run = load_run_config(None, engine_sets("torch", tmp_path))
    assert torch_run.rollout.engine == "torch" and torch_run.policy.head_dim is None


def test_the_summary_adds_up_the_workers_figures(tmp_path: Path) -> None:
    assert engine_summary(tmp_path)["engine"] is None  # no worker wrote figures
    for name, swaps, restarts, memory in (("eu-0", [0.1, 0.3], 0, 3e9), ("eu-1", [0.2], 1, 2e9)):
        figures = {
            "engine": "vllm", "engine_version": "0.32.0", "engine_swaps": len(swaps),
            "engine_restarts": restarts, "engine_refusals": 0, "swap_s": swaps,
            "engine_memory_bytes": memory, "engine_checks": len(swaps),
            "engine_check_failures": restarts, "engine_repairs": restarts,
            "engine_check_gap_max": 1e-7 * len(swaps),
        }  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(figures))
    summary = engine_summary(tmp_path)
    assert summary == {
        "engine": "vllm",
        "engine_version": "0.32.0",
        "engine_workers": 2,
        "engine_swaps": 3,
        "engine_restarts": 1,
        "engine_refusals": 0,
        "swap_p50_s": 0.2,
        "pause_s_p50": 0.2,
        "pause_s_p99": pytest.approx(0.298),
        "sync_s_p50": None,  # these workers wrote no sync times
        "engine_checks": {"checked": 3, "mismatches": 1, "repaired": 1},
        "engine_check_gap_max": 2e-7,
        "engine_memory_bytes": 3e9,
    }

"""The tracker's pure rules: which figures of a snapshot are logged, under which names."""

from __future__ import annotations

from rlstream.ops.observe.tracker import flat_params, gauges, versioned


def _snap() -> dict:
    return {
        "policy_version": 3,
        "versions": [
            {"version": 2, "success": 0.5, "mean_reward": {"tests": 0.25, "format": None}},
            {"version": 3, "success": None, "mean_reward": {}},
        ],
        "weights": [
            {
                "version": 3, "encoded_bytes": 100, "ratio": 20.0, "interval_ms": None,
                "first_use_ms": {"eu": 40}, "stats": {"loss": -0.1, "kl": 0.01},
            }
        ],
        "evals": [{"version": 2, "greedy_success": 0.75, "pass_at_k": 0.875}],
        "mean_recent_staleness": 0.5, "admitted": 7, "rejected": 2, "samples": 64,
        "rejections": {"stale": 2},
        "streams": {"trajectories": {"rate": 3.5, "total": 64}},
    }  # fmt: skip


def test_per_version_figures_at_their_version_unknowns_left_out() -> None:
    got = {(k, v): x for k, v, x in versioned(_snap())}
    assert got == {
        ("success", 2): 0.5,
        ("mean_reward.tests", 2): 0.25,
        ("learner.loss", 3): -0.1,
        ("learner.kl", 3): 0.01,
        ("weights.encoded_bytes", 3): 100.0,
        ("weights.ratio", 3): 20.0,
        ("weights.first_use_ms.eu", 3): 40.0,
        ("eval.greedy_success", 2): 0.75,
        ("eval.pass_at_k", 2): 0.875,
    }


def test_running_figures() -> None:
    assert dict(gauges(_snap())) == {
        "staleness.recent_mean": 0.5,
        "admitted": 7.0,
        "rejected": 2.0,
        "samples": 64.0,
        "rejections.stale": 2.0,
        "throughput.trajectories.per_s": 3.5,
    }


def test_recipe_params_are_flat() -> None:
    assert flat_params(
        {"seed": 0, "learner": {"lr": 0.001, "grpo": {"is_cap": 2.0}}, "x": "y"}
    ) == {
        "seed": "0",
        "learner.lr": "0.001",
        "learner.grpo.is_cap": "2.0",
        "x": "y",
    }

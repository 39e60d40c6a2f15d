"""The feedback-rl rules without a broker: windows, baselines, group sizes, what is trainable,
the online quota, and the role's config from the recipe."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rlstream.consumers.feedback.rules import (
    FeedbackRLConfig,
    Item,
    RunningMean,
    group_sizes,
    online_quota,
    untrainable,
    update_baseline,
    window_decisions,
)
from rlstream.schemas import arrays, events


def feedback(i: int, action: str = "accepted", version: int = 5, **over: Any) -> Item:
    fields = arrays.pack_tokens(np.arange(6) + i, np.full(6, -0.5), np.array([0, 0, 1, 1, 1, 1]))
    rec = {
        "feedback_id": f"f{i}",
        "request_id": f"r{i}",
        "model": "policy",
        "policy_version": version,
        "action": action,
        "task_class": "tab",
        "prompt_tokens": 2,
        **fields,
        **over,
    }
    return Item(rec, {"topic": "rl.r.feedback", "partition": 0, "offset": i})


def test_baseline_is_a_running_mean_then_an_exponential_average() -> None:
    mean = update_baseline(RunningMean(), [1.0, -1.0, 1.0, 1.0], alpha=0.1)
    assert mean == RunningMean(0.5, 4)
    later = update_baseline(RunningMean(0.0, 100), [1.0], alpha=0.1)
    assert later.value == pytest.approx(0.1)


def test_group_sizes_cover_the_samples_within_bounds() -> None:
    assert group_sizes(1, 2, 4) == [] and group_sizes(4, 2, 4) == [4]
    assert group_sizes(9, 2, 4) == [3, 3, 3]
    assert group_sizes(33, 30, 32) == [32]  # the 1 left over is rejected as incomplete
    for n in range(2, 60):
        sizes = group_sizes(n, 2, 8)
        assert sum(sizes) == n and all(2 <= s <= 8 for s in sizes)


def test_window_admits_online_groups_with_baselined_rewards() -> None:
    cfg = FeedbackRLConfig(min_group_size=2, max_group_size=8)
    items = [feedback(0), feedback(1, "rejected"), feedback(2, "edited")]
    baselines = {"tab": RunningMean(0.25, 10)}
    decisions, after = window_decisions(items, "w", 5, baselines, cfg, "r", 1000)
    [group] = decisions
    assert (group["decision"], group["source"], group["task_class"]) == (
        "admitted",
        "online",
        "tab",
    )
    assert [s["reward"] for s in group["samples"]] == pytest.approx([0.75, -1.25, 0.05])
    assert [s["rewards"]["feedback"] for s in group["samples"]] == [1.0, -1.0, 0.3]
    assert [i["offset"] for i in group["inputs"]] == [0, 1, 2]
    events.validate("admission", group)
    assert after["tab"].count == 13 and baselines["tab"].count == 10  # input untouched


def test_window_rejects_stale_untrainable_and_lonely_feedback_with_reasons() -> None:
    cfg = FeedbackRLConfig(max_staleness=2, reject_no_signal=True)
    items = [
        feedback(0, version=1),  # staleness 4
        feedback(1, token_ids=None, logprobs=None, loss_mask=None),
        feedback(2, model="other"),
        feedback(3, task_class="chat"),
        feedback(4, task_class="agent"),
        feedback(5, task_class="agent"),
    ]
    decisions, _ = window_decisions(items, "w", 5, {}, cfg, "r", 1000)
    by_group = {d["group_id"].split("/", 2)[2]: d for d in decisions}
    assert by_group["tab/stale"]["reason"] == "stale"
    assert by_group["tab/stale"]["staleness"] == 4
    untrainable_ = by_group["tab/untrainable"]
    assert untrainable_["reason"] == "other" and len(untrainable_["inputs"]) == 2
    assert by_group["chat/incomplete"]["reason"] == "incomplete"
    assert by_group["agent/0"]["reason"] == "no_signal"  # both accepted: zero advantage
    for d in decisions:
        events.validate("admission", d)
    reflected = sorted(i["offset"] for d in decisions for i in d["inputs"])
    assert reflected == [0, 1, 2, 3, 4, 5]  # every input decided exactly once


def test_untrainable_reasons() -> None:
    assert untrainable(feedback(0).record, "policy") is None
    ref = {"topic": "t", "partition": 0, "offset": 1}
    no_tokens = feedback(0, token_ids=None, trajectory_ref=ref).record
    assert "trajectory_ref" in str(untrainable(no_tokens, "policy"))
    broken = feedback(0, logprobs=b"\x00" * 8).record
    assert "disagree" in str(untrainable(broken, "policy"))


def test_online_quota_mixes_n_per_m() -> None:
    assert online_quota(8, 1, 4) == 2 and online_quota(3, 1, 4) == 0
    assert online_quota(100, 1, 0) is None


def test_role_config_from_recipe_table_and_overrides(tmp_path: Any) -> None:
    from rlstream.ops.run.config import load_run_config

    def feedback_config(path: str | None, overrides: list[str]) -> Any:
        return load_run_config(path, overrides).role("feedback-rl")

    path = tmp_path / "run.toml"
    path.write_text('model = "m"\nmax_staleness = 3\n[feedback_rl]\nwindow_size = 5\n')
    cfg = feedback_config(str(path), ["feedback_rl.rewards.edited=0.5"])
    assert (cfg.model, cfg.max_staleness, cfg.window_size) == ("m", 3, 5)
    assert cfg.rewards.edited == 0.5
    assert feedback_config(None, ["feedback_rl.max_staleness=1"]).max_staleness == 1

"""feedback-rl's rules: how a window of editor feedback becomes online groups. Pure functions,
no Kafka (the role around them is ``feedback_rl``), unit tested without a broker.

Every input of a closed window ends up in exactly one decision, per task class in offset order:
feedback that cannot be trained on (another model, no matching served completion, a
disagreement with it) is rejected as ``other`` with the reasons; stale feedback (the admission
rule) as ``stale``; the rest form groups of ``min_group_size``..``max_group_size`` samples (fewer:
``incomplete``; every reward equal: ``no_signal`` when ``reject_no_signal``). A sample's reward is
its action's configured reward minus the class baseline from *before* the window, so a window
never baselines itself; the baseline is a running mean that turns into an exponential average.

``mix_online_groups``/``mix_rollout_groups`` are read by the learner (see ``online_quota``).
Details: docs/feedback.md (feedback-rl's rules).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlstream.consumers.admission_rules import staleness
from rlstream.schemas import arrays

DEFAULT_CLASS = "default"


class ActionRewards(BaseModel):
    """Reward of each user action."""

    model_config = ConfigDict(extra="forbid")

    accepted: float = Field(default=1.0, ge=-10, le=10, description="The completion was kept.")
    edited: float = Field(default=0.3, ge=-10, le=10, description="Kept after the user edited it.")
    rejected: float = Field(
        default=-1.0, ge=-10, le=10, description="The completion was discarded."
    )
    dissatisfied: float = Field(
        default=-1.0, ge=-10, le=10, description="The user said it was bad."
    )


class FeedbackRLConfig(BaseModel):
    """Config of the feedback-rl role."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("policy", description="Model trained by the run; other feedback skipped.")
    window_size: int = Field(
        64, ge=1, le=100_000, description="Records per window (per partition)."
    )
    window_seconds: float = Field(
        10.0, gt=0, le=3600, description="Close a window this long after its first record."
    )
    rewards: ActionRewards = Field(
        default_factory=lambda: ActionRewards(), description="Reward per action."
    )
    baseline_alpha: float = Field(
        0.02,
        gt=0,
        le=1,
        description="Weight of a new reward in the class baseline (after 1/alpha).",
    )
    max_staleness: int = Field(2, ge=0, description="Largest learner - served version gap trained.")
    served_lookup_ids: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="Request ids indexed per served partition (the newest); feedback naming an "
        "older request is rejected as not found.",
    )
    min_group_size: int = Field(2, ge=2, le=1024, description="Smallest online group.")
    max_group_size: int = Field(32, ge=2, le=1024, description="Largest online group.")
    reject_no_signal: bool = Field(True, description="Reject groups whose rewards are all equal.")
    dedup_ids: int = Field(
        100_000, ge=0, le=10_000_000, description="Feedback ids remembered to drop late retries."
    )
    dedup_lookback: int = Field(
        10_000,
        ge=0,
        le=1_000_000,
        description="Records per partition re-read for ids on assignment.",
    )
    mix_online_groups: int = Field(
        1, ge=0, description="N of the mix: at most N online groups per M rollout groups."
    )
    mix_rollout_groups: int = Field(
        0, ge=0, description="M of the mix (read by the learner); 0 = no limit on online groups."
    )
    batch_size: int = Field(500, ge=1, le=10_000, description="Records per transaction at most.")

    @model_validator(mode="after")
    def _sizes(self) -> FeedbackRLConfig:
        if self.min_group_size > self.max_group_size:
            raise ValueError("min_group_size must be <= max_group_size")
        return self


# --- rules ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunningMean:
    """Baseline of one task class: current value and how many rewards formed it."""

    value: float = 0.0
    count: int = 0


def update_baseline(mean: RunningMean, rewards: Iterable[float], alpha: float) -> RunningMean:
    """Fold ``rewards`` in order: b <- b + max(alpha, 1/n) * (r - b) (see module rule 4)."""
    value, count = mean.value, mean.count
    for reward in rewards:
        count += 1
        value += max(alpha, 1.0 / count) * (reward - value)
    return RunningMean(value, count)


def action_reward(action: str, rewards: ActionRewards) -> float:
    """The configured reward of a user action."""
    return float(getattr(rewards, action))


def untrainable(record: Mapping[str, Any], model: str) -> str | None:
    """Why a feedback record cannot be trained on, or None if it can (module rule 3)."""
    if record["model"] != model:
        return f"served by model {record['model']!r}, not {model!r}"
    if record.get("served_refusal"):
        return str(record["served_refusal"])  # a bad reference, or it disagrees with the served
    if record.get("lookup_error"):
        return f"its served completion was not found: {record['lookup_error']}"
    if record.get("token_ids") is None:
        if record.get("trajectory_ref") is not None:
            return "its trajectory_ref could not be read (gone or not a trajectory)"
        return "no token ids"
    if record.get("logprobs") is None or record.get("loss_mask") is None:
        return "token ids without serving logprobs or loss mask"
    try:
        arrays.unpack_tokens(record)
    except arrays.ArrayError as exc:
        return f"token arrays disagree: {exc}"
    return None


def group_sizes(n: int, min_size: int, max_size: int) -> list[int]:
    """Sizes of the groups that n samples (in order) form; samples past their sum are incomplete.

    Rule: k = ceil(n / max_size) near-equal groups (boundaries n*i//k) when each has at least
    ``min_size``; otherwise as many ``max_size`` groups as fit, plus the remainder as one group
    if it has at least ``min_size``. n < min_size gives no group.
    """
    if n < min_size:
        return []
    k = -(-n // max_size)
    if n // k >= min_size:
        return [n * (i + 1) // k - n * i // k for i in range(k)]
    full, rest = divmod(n, max_size)
    return [max_size] * full + ([rest] if rest >= min_size else [])


def online_quota(rollout_groups: int, online_groups: int, rollout_per: int) -> int | None:
    """How many online groups a learner may have trained after ``rollout_groups`` rollout ones.

    Rule: at most N (``online_groups``) per M (``rollout_per``) rollout groups, rounded down;
    None means no limit (M = 0). The learner applies it; feedback-rl only publishes groups.
    """
    if rollout_per == 0:
        return None
    return rollout_groups * online_groups // rollout_per


@dataclass(frozen=True, slots=True)
class Item:
    """One feedback record of a window and its position in the log."""

    record: Mapping[str, Any]
    ref: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ClassWindow:
    """What every decision of one task class of one closed window shares."""

    run: str
    window_id: str
    task_class: str
    learner_version: int
    now_ms: int
    cfg: FeedbackRLConfig

    def decision(
        self, suffix: str, items: Sequence[Item], reason: str | None, detail: str | None
    ) -> dict[str, Any]:
        """A rejected decision (reason, detail) over ``items``; admitted ones add samples."""
        versions = [int(i.record["policy_version"]) for i in items]
        return {
            "run": self.run,
            "group_id": f"online/{self.window_id}/{self.task_class}/{suffix}",
            "task_id": f"feedback/{self.task_class}",
            "decision": "rejected",
            "reason": reason,
            "detail": detail,
            "source": "online",
            "learner_version": max(self.learner_version, 0),
            "min_behaviour_version": min(versions),
            "max_behaviour_version": max(versions),
            "staleness": staleness(self.learner_version, versions),
            "decided_ms": self.now_ms,
            "group_size": len(items),
            "task_class": self.task_class,
            "samples": [],
            "inputs": [i.ref for i in items],
        }

    def sample(self, index: int, item: Item, reward: float, baseline: float) -> dict[str, Any]:
        """The AdmittedSample of one feedback: its served tokens, reward minus the baseline."""
        rec = item.record
        return {
            "sample_index": index,
            "policy_version": int(rec["policy_version"]),
            "prompt_tokens": int(rec.get("prompt_tokens") or 0),
            "token_ids": rec["token_ids"],
            "logprobs": rec["logprobs"],
            "loss_mask": rec["loss_mask"],
            "routed_experts": rec.get("routed_experts") or b"",
            "n_layers": int(rec.get("n_layers") or 0),
            "top_k": int(rec.get("top_k") or 0),
            "expert_bytes": arrays.record_expert_bytes(rec),
            "temperature": float(rec.get("temperature") or 1.0),
            "rewards": {"feedback": reward, "baseline": baseline},
            "reward": reward - baseline,
            "passed": rec["action"] == "accepted",
            "task_class": self.task_class,
            "trajectory": rec.get("trajectory_ref"),
            "feedback": item.ref,
        }

    def group(self, index: int, items: Sequence[Item], baseline: float) -> dict[str, Any]:
        """An online group: admitted unless its rewards are all equal and that is refused."""
        raw = [action_reward(i.record["action"], self.cfg.rewards) for i in items]
        if self.cfg.reject_no_signal and max(raw) - min(raw) < 1e-9:
            return self.decision(
                str(index), items, "no_signal", f"every feedback has reward {raw[0]:.3f}"
            )
        samples = [
            self.sample(k, item, r, baseline)
            for k, (item, r) in enumerate(zip(items, raw, strict=True))
        ]
        return {
            **self.decision(str(index), items, None, None),
            "decision": "admitted",
            "samples": samples,
        }


def class_decisions(
    items: Sequence[Item], ctx: ClassWindow, baseline: RunningMean
) -> list[dict[str, Any]]:
    """The decisions for one task class of one closed window (module rule 3)."""
    cfg, version = ctx.cfg, ctx.learner_version
    skipped, stale, fresh = [], [], []
    for item in items:
        if untrainable(item.record, cfg.model) is not None:
            skipped.append(item)
        elif staleness(version, [int(item.record["policy_version"])]) > cfg.max_staleness:
            stale.append(item)
        else:
            fresh.append(item)
    out = []
    if skipped:
        why = "; ".join(sorted({str(untrainable(i.record, cfg.model)) for i in skipped}))
        out.append(ctx.decision("untrainable", skipped, "other", why[:1000]))
    if stale:
        why = f"served version + {cfg.max_staleness} < learner version {version}"
        out.append(ctx.decision("stale", stale, "stale", why))
    start = 0
    for g, size in enumerate(group_sizes(len(fresh), cfg.min_group_size, cfg.max_group_size)):
        out.append(ctx.group(g, fresh[start : start + size], baseline.value))
        start += size
    if fresh[start:]:
        why = f"{len(fresh) - start} trainable feedback left, a group needs {cfg.min_group_size}"
        out.append(ctx.decision("incomplete", fresh[start:], "incomplete", why))
    return out


def window_decisions(
    items: Sequence[Item],
    window_id: str,
    learner_version: int,
    baselines: Mapping[str, RunningMean],
    cfg: FeedbackRLConfig,
    run: str,
    now_ms: int,
) -> tuple[list[dict[str, Any]], dict[str, RunningMean]]:
    """Decisions of one closed window (duplicates already dropped) and the updated baselines.

    Rule: classes are decided in first-appearance order, each with its baseline from before
    the window; then every feedback of the class (trainable or not) updates its baseline.
    """
    by_class: dict[str, list[Item]] = {}
    for item in items:
        by_class.setdefault(item.record.get("task_class") or DEFAULT_CLASS, []).append(item)
    decisions: list[dict[str, Any]] = []
    updated = dict(baselines)
    for task_class, members in by_class.items():
        before = baselines.get(task_class, RunningMean())
        ctx = ClassWindow(run, window_id, task_class, learner_version, now_ms, cfg)
        decisions += class_decisions(members, ctx, before)
        rewards = [action_reward(i.record["action"], cfg.rewards) for i in members]
        updated[task_class] = update_baseline(before, rewards, cfg.baseline_alpha)
    return decisions, updated

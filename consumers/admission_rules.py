"""Admission rules: which groups the learner may train on. Pure functions, no Kafka.

A *group* is the G samples of one task plus, for each sample, one reward per required judge.
When it is complete or its deadline passed the rules apply in this order: stale (staleness >
``max_staleness``), timed out, judge error, no signal (every total equal), else admitted with
per-judge rewards and the weighted total; with ``max_groups_per_version`` > 0, a group beyond
that many at one learner version is rejected as surplus. A group is rejected with its reason,
never silently dropped, and never trained on a made-up score.

Duplicates are ignored (the first record of each sample and (sample, judge) wins); a reward
counts only for the sample whose trajectory record it names; only records of a task released to
the record's region are accepted (``release_refusal``). Decided ids are bounded
(``DecidedSet``): a copy arriving past that bound is stale, so nothing is admitted twice.

Details: docs/roles.md (Admission rules).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlstream.schemas import arrays


class AdmissionConfig(BaseModel):
    """Config of the admission role."""

    model_config = ConfigDict(extra="forbid")

    judges: dict[str, float] = Field(
        default_factory=lambda: {"tests": 1.0, "format": 0.1},
        description="Required judges and their weight in the total reward.",
    )
    max_staleness: int = Field(
        2, ge=0, description="Largest admitted learner - behaviour version gap."
    )
    timeout_s: float = Field(300.0, gt=0, description="Reject a group incomplete for this long.")
    reject_no_signal: bool = Field(True, description="Reject groups whose rewards are all equal.")
    max_groups_per_version: int = Field(
        0,
        ge=0,
        description="Admit at most this many groups per learner version (0: no cap); set to "
        "the step size for synchronous RL with oversampling (injected from the run config). "
        "Counted per admission member.",
    )
    max_decided: int = Field(
        1_000_000,
        ge=1_000,
        description="Decided group ids remembered to ignore late copies (the oldest forgotten "
        "first; see the module docstring).",
    )


class DecidedSet:
    """Group ids decided, the newest ``bound`` of them: adding past the bound forgets the
    oldest (insertion order; a re-added id becomes the newest)."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"bound must be >= 1, got {bound}")
        self.bound = bound
        self.forgotten = 0
        self._ids: dict[str, None] = {}

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, group_id: str) -> None:
        self._ids.pop(group_id, None)
        self._ids[group_id] = None
        if len(self._ids) > self.bound:
            del self._ids[next(iter(self._ids))]
            self.forgotten += 1

    def __ior__(self, group_ids: Iterable[str]) -> DecidedSet:
        for group_id in group_ids:
            self.add(group_id)
        return self


#: Rewards that may wait for one sample (judges x copies; more is a flood, dropped).
MAX_EARLY_REWARDS = 16


@dataclass
class PendingGroup:
    """What admission has seen of one group so far."""

    group_id: str
    task_id: str
    group_size: int
    first_seen_ms: int
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)  # sample index -> trajectory
    rewards: dict[int, dict[str, dict[str, Any]]] = field(
        default_factory=dict
    )  # idx -> judge -> reward
    refs: list[dict[str, Any]] = field(
        default_factory=list
    )  # input positions (topic/partition/offset)
    early: dict[int, list[dict[str, Any]]] = field(
        default_factory=dict
    )  # idx -> rewards read before their sample (a few per judge and copy)

    def add_sample(self, trajectory: dict[str, Any]) -> bool:
        """Record a sample; False if this sample index was already seen (a duplicate). Rewards
        that waited for it are paired now when they name it, dropped when they name another
        copy's sample."""
        index = int(trajectory["sample_index"])
        if index in self.samples:
            return False
        self.samples[index] = trajectory
        for reward in self.early.pop(index, []):
            self.add_reward(reward)
        return True

    def add_reward(self, reward: dict[str, Any]) -> bool:
        """Pair a reward with its sample; False for a duplicate or a reward of another copy's
        sample. A reward whose sample is not known yet waits (True)."""
        index = int(reward["sample_index"])
        sample = self.samples.get(index)
        if sample is None:
            waiting = self.early.setdefault(index, [])
            if len(waiting) >= MAX_EARLY_REWARDS:
                return False
            waiting.append(reward)
            return True
        if not _names(reward.get("trajectory"), sample.get("_ref")):
            return False
        per_sample = self.rewards.setdefault(index, {})
        if reward["judge"] in per_sample:
            return False
        per_sample[reward["judge"]] = reward
        return True

    def complete(self, judges: dict[str, float]) -> bool:
        # A group first seen through a reward has no size (0) until a trajectory names it: it
        # waits for its samples, and times out if none ever comes.
        if not self.samples or len(self.samples) < self.group_size:
            return False
        return all(set(judges) <= set(self.rewards.get(i, {})) for i in self.samples)


def _names(ref: dict[str, Any] | None, position: dict[str, Any] | None) -> bool:
    """True when a reward's trajectory ``ref`` names the record at ``position``, or cannot be
    compared with it: either is unknown, or they lie in different topics (a reward judged in a
    rollout region names its region's log, whose offsets are not those of the copy here)."""
    if not ref or not position or ref.get("topic") != position.get("topic"):
        return True
    return bool(
        ref.get("partition") == position.get("partition")
        and ref.get("offset") == position.get("offset")
    )


def release_refusal(
    group_id: str, task_id: str, region: str, released: frozenset[str] | None
) -> str | None:
    """Why a trajectory or reward of ``group_id`` (task ``task_id``) that came from ``region``
    is refused, or None (see the module rule "Released only"). ``released`` is the set of
    regions the task was released to (``consumers.releases``; ``"*"``: any), None if never."""
    if task_id != group_id:
        return f"group {group_id!r} names task {task_id!r}: a group id is its task id"
    if released is None:
        return f"task {task_id!r} was never released by the scheduler"
    if "*" not in released and region not in released:
        return f"task {task_id!r} was released to {sorted(released)}, not to region {region!r}"
    return None


@dataclass(frozen=True)
class AdmissionVerdict:
    admitted: bool
    reason: str | None
    staleness: int
    detail: str = ""


def behaviour_span(trajectory: dict[str, Any]) -> tuple[int, int]:
    """The oldest and the newest version that processed a sample's tokens: its
    ``version_spans``' (partial rollouts), else its ``policy_version`` (one version)."""
    spans = [int(s["version"]) for s in trajectory.get("version_spans") or []]
    if not spans:
        spans = [int(trajectory["policy_version"])]
    return min(spans), max(spans)


def staleness(learner_version: int, behaviour_versions: list[int]) -> int:
    """Learner version now minus the oldest behaviour version of the group (>= 0)."""
    return max(0, learner_version - min(behaviour_versions)) if behaviour_versions else 0


def total_reward(rewards: dict[str, dict[str, Any]], judges: dict[str, float]) -> float:
    """Weighted sum over the required judges of their scores for one sample."""
    return float(sum(weight * float(rewards[name]["score"]) for name, weight in judges.items()))


def decide(
    group: PendingGroup, now_ms: int, learner_version: int, cfg: AdmissionConfig
) -> AdmissionVerdict | None:
    """The verdict for ``group`` now, or None while it may still complete (see module rules)."""
    versions = [behaviour_span(s)[0] for s in group.samples.values()]
    stale = staleness(learner_version, versions)
    if versions and stale > cfg.max_staleness:
        return AdmissionVerdict(
            False, "stale", stale, f"staleness {stale} > max {cfg.max_staleness}"
        )
    if not group.complete(cfg.judges):
        if now_ms - group.first_seen_ms > cfg.timeout_s * 1000:
            have = f"{len(group.samples)}/{group.group_size} samples"
            return AdmissionVerdict(
                False, "timed_out", stale, f"incomplete after {cfg.timeout_s:.0f}s: {have}"
            )
        return None
    errors = [
        f"{name}: {r['error']}"
        for i in sorted(group.samples)
        for name, r in sorted(group.rewards[i].items())
        if name in cfg.judges and r.get("error")
    ]
    if errors:
        return AdmissionVerdict(
            False, "judge_error", stale, f"{len(errors)} unscored: {errors[0]}"[:1000]
        )
    totals = [total_reward(group.rewards[i], cfg.judges) for i in sorted(group.samples)]
    if cfg.reject_no_signal and max(totals) - min(totals) < 1e-9:
        return AdmissionVerdict(False, "no_signal", stale, f"every sample scored {totals[0]:.3f}")
    return AdmissionVerdict(True, None, stale)


def surplus(
    verdict: AdmissionVerdict, admitted_now: int, learner_version: int, cfg: AdmissionConfig
) -> AdmissionVerdict:
    """Rule 6: ``verdict`` unless it admits a group past ``max_groups_per_version`` groups
    already admitted (``admitted_now``) at ``learner_version``."""
    cap = cfg.max_groups_per_version
    if not verdict.admitted or cap == 0 or admitted_now < cap:
        return verdict
    detail = f"surplus: {admitted_now} groups already admitted at learner version {learner_version}"
    return AdmissionVerdict(False, "other", verdict.staleness, detail)


def admitted_samples(group: PendingGroup, cfg: AdmissionConfig) -> list[dict[str, Any]]:
    """The AdmittedSample records of a complete group, in sample order."""
    out = []
    for index in sorted(group.samples):
        traj, rewards = group.samples[index], group.rewards.get(index, {})
        scores = {name: float(r["score"]) for name, r in rewards.items()}
        out.append(
            {
                "sample_index": index,
                "policy_version": behaviour_span(traj)[0],
                "prompt_tokens": int(traj["prompt_tokens"]),
                **{k: traj[k] for k in (*arrays.TOKEN_FIELDS, "n_layers", "top_k", "temperature")},
                "expert_bytes": arrays.record_expert_bytes(traj),
                "rewards": scores,
                "reward": total_reward(rewards, cfg.judges)
                if set(cfg.judges) <= set(rewards)
                else 0.0,
                "passed": bool(rewards.get("tests", {}).get("passed", False)),
                "region": traj.get("region"),
                "trajectory": traj.get("_ref"),
                "reward_refs": [r["_ref"] for _, r in sorted(rewards.items()) if r.get("_ref")],
                "routes_recorded": bool(traj.get("routes_recorded", True)),
                # a compacted sample's contexts: without them the learner would replay its
                # segments as one context, each later one after text it never saw
                "segment_bounds": segment_bounds(traj),
            }
        )
    return out


def segment_bounds(trajectory: dict[str, Any]) -> list[int]:
    """Flat [start, end, ...] of the replayable contexts; [] when the sample is one context."""
    turns = trajectory.get("turns") or []
    if len(turns) <= 1:
        return []
    return [int(v) for t in turns for v in (t["token_start"], t["token_end"])]

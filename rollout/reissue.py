"""Where the scheduler sends each task, and when it sends a task again. Pure rules, no Kafka.

A task names the region whose rollout workers take it in its ``tags["region"]`` (workers in
other regions skip it, committing past it); ``attempt`` counts its releases. Rules:

- placement: new tasks go round-robin to the target regions (the run's rollout regions, else the
  trainer region) that are not dark; none is placed while every target is dark;
- overdue: a group not decided (admitted or rejected) ``reissue_after_s`` after its latest
  release is overdue: its region is dark for the next ``reissue_after_s`` (no new task goes
  there, so a dead region stops eating the staleness budget), and the task is released again,
  same task and group id, ``attempt + 1``, to the next live region. With no live region left, it
  waits until one is live again;
- one target region: there is no other region to prefer, and darkening the only one would stop
  every release, so an overdue group is released again (``attempt + 1``) to that same region,
  which stays live: new tasks go on, paced by the in-flight budget as always. The copy is keyed
  by the same task id, so it follows the first release in the tasks partition, and its
  trajectories and rewards follow the first copy's in theirs;
- the group id never changes, so admission decides a group once whichever copy arrives first,
  and a region that comes back late only adds copies admission ignores: nothing is lost (every
  released group is re-issued until decided) and nothing is trained twice;
- restart-safe: ``ReleaseLedger.replay`` rebuilds the ledger from the tasks stream and the decisions;
- tidal capacity: ``place`` with each region's rollout engines now (dedicated plus lent) sends
  no task to a region that has none, and fills the others by groups in flight per engine; a
  group reclaimed part-way is released again (``resume``), attempt + 1, with its checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rlstream.consumers.releases import REGION_TAG, target_of

__all__ = ["REGION_TAG", "Release", "ReleaseLedger", "for_region", "target_of"]


@dataclass
class Release:
    """The latest release of one task."""

    task_id: str
    region: str
    attempt: int
    released_ms: int
    record: dict[str, Any]


def for_region(task: dict[str, Any], region: str) -> bool:
    """Whether a worker in ``region`` rolls ``task`` out."""
    target = target_of(task)
    return target is None or target == region


@dataclass
class ReleaseLedger:
    """Released, decided and overdue groups, and the regions' health (see the module rules)."""

    targets: tuple[str, ...]
    reissue_after_ms: int
    releases: dict[str, Release] = field(default_factory=dict)
    decided: set[str] = field(default_factory=set)
    dark_until: dict[str, int] = field(default_factory=dict)
    reissued: int = 0
    _turn: itertools.cycle = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("a ledger needs at least one target region")
        self._turn = itertools.cycle(self.targets)

    @property
    def released(self) -> int:
        return len(self.releases)

    def in_flight(self, region: str | None = None) -> int:
        return sum(
            1
            for r in self.releases.values()
            if r.task_id not in self.decided and (region is None or r.region == region)
        )

    def live(self, now_ms: int) -> list[str]:
        return [r for r in self.targets if self.dark_until.get(r, 0) <= now_ms]

    def place(
        self, now_ms: int, avoid: str | None = None, weights: dict[str, int] | None = None
    ) -> str | None:
        """The next live target region (round-robin), other than ``avoid`` if possible. With
        ``weights`` (the rollout engines each region has now, ``rollout.scheduler``), only
        regions with some, the one with the fewest groups in flight per engine first."""
        live = [r for r in self.live(now_ms) if r != avoid]
        if weights is not None:
            live = [r for r in live if weights.get(r, 0) > 0]
            if not live:
                return None
            return min(live, key=lambda r: ((self.in_flight(r) + 1) / weights[r], r))
        if not live:
            return None
        for region in self._turn:  # cycles through targets; a live one is met within one round
            if region in live:
                return region
        raise AssertionError("unreachable")

    def release(self, record: dict[str, Any], now_ms: int) -> Release:
        """Record ``record`` (a task already tagged with its region) as released now."""
        region = target_of(record)
        if region is None:
            raise ValueError(f"task {record['task_id']} names no region")
        rel = Release(record["task_id"], region, int(record.get("attempt", 0)), now_ms, record)
        self.releases[rel.task_id] = rel
        return rel

    def decide(self, group_id: str) -> None:
        self.decided.add(group_id)

    def overdue(self, now_ms: int) -> list[Release]:
        """Undecided groups whose latest release is older than ``reissue_after_ms``."""
        return [
            r
            for r in self.releases.values()
            if r.task_id not in self.decided and now_ms - r.released_ms > self.reissue_after_ms
        ]

    def reissue(self, release: Release, now_ms: int) -> dict[str, Any] | None:
        """The task to release again: elsewhere, ``release``'s region marked dark (None while no
        other region is live: it stays overdue and is retried); with one target region, to that
        region, left live (see the module rules)."""
        if len(self.targets) == 1:
            region: str | None = self.targets[0]
        else:
            self.dark_until[release.region] = now_ms + self.reissue_after_ms
            region = self.place(now_ms, avoid=release.region)
        if region is None:
            return None
        tags = {**(release.record.get("tags") or {}), REGION_TAG: region}
        record = {
            **release.record,
            "attempt": release.attempt + 1,
            "created_ms": now_ms,
            "tags": tags,
        }
        self.reissued += 1
        return record

    def resume(self, preempted: dict[str, Any], now_ms: int, region: str) -> dict[str, Any] | None:
        """The task of a group reclaimed part-way (a ``Preempted`` record), released again to
        ``region`` with its checkpoint; None when the group is decided or that release was
        already superseded (a restarted scheduler reads every reclaim again)."""
        rel = self.releases.get(preempted["group_id"])
        if rel is None or rel.task_id in self.decided or rel.attempt > int(preempted["attempt"]):
            return None
        tags = {**(rel.record.get("tags") or {}), REGION_TAG: region}
        return {
            **rel.record,
            "attempt": rel.attempt + 1,
            "created_ms": now_ms,
            "tags": tags,
            "checkpoint": preempted["checkpoint"],
        }

    def replay(self, tasks: Iterable[dict[str, Any]], decided: Iterable[str]) -> None:
        """Rebuild from the tasks stream (in order) and the decided group ids."""
        for task in tasks:
            if target_of(task) is None:  # released before regions: counts as the first target's
                task = {**task, "tags": {**(task.get("tags") or {}), REGION_TAG: self.targets[0]}}
            self.release(task, int(task["created_ms"]))
        self.decided.update(decided)

"""Placement and re-issue of tasks across regions (``rollout.reissue``), without a broker.

Properties asserted: tasks spread round-robin over live target regions; an undecided group is
re-issued once overdue, with the same group id, a higher attempt and another region, and its
region gets no new task while dark; decided groups are never re-issued; with no live region left
a group waits; with a single target region an overdue group goes back to it and releases to it go
on; the ledger rebuilt from the tasks stream equals the one that wrote it.
"""

from __future__ import annotations

import pytest

from rlstream.rollout.reissue import REGION_TAG, ReleaseLedger, for_region, target_of

SECOND = 1000


def _task(task_id: str, region: str, attempt: int = 0, created_ms: int = 0) -> dict:
    return {"task_id": task_id, "attempt": attempt, "created_ms": created_ms,
            "tags": {REGION_TAG: region, "split": "train"}}  # fmt: skip


def _release(ledger: ReleaseLedger, task_id: str, now_ms: int) -> str:
    region = ledger.place(now_ms)
    assert region is not None
    ledger.release(_task(task_id, region, created_ms=now_ms), now_ms)
    return region


def test_placement_is_round_robin_over_targets() -> None:
    ledger = ReleaseLedger(("eu", "us"), 30 * SECOND)
    assert [_release(ledger, f"t{i}", 0) for i in range(4)] == ["eu", "us", "eu", "us"]
    assert ledger.released == 4 and ledger.in_flight() == 4 and ledger.in_flight("eu") == 2


def test_an_overdue_group_goes_to_another_region_with_the_same_group_id() -> None:
    ledger = ReleaseLedger(("eu", "us"), 30 * SECOND)
    for i in range(4):
        _release(ledger, f"t{i}", 0)
    ledger.decide("t1")  # us decided its first group
    assert ledger.overdue(30 * SECOND) == []  # not yet past the limit
    overdue = ledger.overdue(31 * SECOND)
    assert sorted(r.task_id for r in overdue) == ["t0", "t2", "t3"]
    eu_late = next(r for r in overdue if r.region == "eu")
    again = ledger.reissue(eu_late, 31 * SECOND)
    assert again is not None
    assert again["task_id"] == eu_late.task_id and again["attempt"] == 1
    assert target_of(again) == "us" and again["tags"]["split"] == "train"
    ledger.release(again, 31 * SECOND)
    assert ledger.live(31 * SECOND) == ["us"]  # eu is dark: no new task goes there
    assert ledger.place(32 * SECOND) == "us"
    assert ledger.live(62 * SECOND) == ["eu", "us"]  # probed again after a while
    assert ledger.released == 4, "a re-issue is not a new release (pacing counts groups)"


def test_decided_groups_are_never_reissued_and_with_no_live_region_a_group_waits() -> None:
    ledger = ReleaseLedger(("eu", "us"), 10 * SECOND)
    _release(ledger, "a", 0)  # eu
    _release(ledger, "b", 0)  # us
    ledger.decide("a")
    overdue = ledger.overdue(11 * SECOND)
    assert [r.task_id for r in overdue] == ["b"]
    ledger.dark_until["eu"] = 30 * SECOND  # eu went dark meanwhile
    assert ledger.reissue(overdue[0], 11 * SECOND) is None  # nowhere else to go
    assert ledger.live(12 * SECOND) == [] and ledger.place(12 * SECOND) is None
    assert [r.task_id for r in ledger.overdue(12 * SECOND)] == ["b"]  # still overdue: retried


def test_one_region_reissues_to_itself_and_keeps_releasing() -> None:
    ledger = ReleaseLedger(("trainer",), 10 * SECOND)
    for task_id in ("a", "b", "c"):
        _release(ledger, task_id, 0)
    ledger.decide("a")
    overdue = ledger.overdue(11 * SECOND)
    assert sorted(r.task_id for r in overdue) == ["b", "c"]
    again = ledger.reissue(ledger.releases["b"], 11 * SECOND)
    assert again is not None
    assert again["task_id"] == "b" and again["attempt"] == 1 and target_of(again) == "trainer"
    assert again["created_ms"] == 11 * SECOND and again["tags"]["split"] == "train"
    ledger.release(again, 11 * SECOND)
    assert ledger.live(11 * SECOND) == ["trainer"]  # not dark: releases go on at once
    assert _release(ledger, "d", 11 * SECOND) == "trainer"
    assert ledger.released == 4, "a re-issue is not a new release (pacing counts groups)"
    assert ledger.in_flight() == 3  # b (once, whichever copy), c, d: the budget still applies
    assert [r.task_id for r in ledger.overdue(12 * SECOND)] == ["c"]  # b's clock restarted
    twice = ledger.reissue(ledger.releases["b"], 22 * SECOND)
    assert twice is not None and twice["attempt"] == 2  # undecided again: attempt counts on
    ledger.decide("b")
    assert "b" not in [r.task_id for r in ledger.overdue(60 * SECOND)]


def test_replay_rebuilds_the_ledger_from_the_tasks_stream() -> None:
    ledger = ReleaseLedger(("eu", "us"), 10 * SECOND)
    written = []
    for i in range(3):
        region = ledger.place(0)
        assert region is not None
        written.append(_task(f"t{i}", region))
        ledger.release(written[-1], 0)
    again = ledger.reissue(ledger.releases["t0"], 11 * SECOND)
    assert again is not None
    ledger.release(again, 11 * SECOND)
    written.append(again)
    rebuilt = ReleaseLedger(("eu", "us"), 10 * SECOND)
    rebuilt.replay(written, {"t1"})
    assert {k: (r.region, r.attempt) for k, r in rebuilt.releases.items()} == {
        k: (r.region, r.attempt) for k, r in ledger.releases.items()
    }
    assert rebuilt.in_flight() == 2 and rebuilt.released == 3
    legacy = ReleaseLedger(("eu",), SECOND)
    legacy.replay([{"task_id": "old", "created_ms": 0, "attempt": 0}], ())
    assert legacy.releases["old"].region == "eu"


def test_workers_take_only_their_regions_tasks() -> None:
    assert for_region(_task("t", "eu"), "eu") and not for_region(_task("t", "eu"), "us")
    assert for_region({"task_id": "t", "tags": {}}, "us")  # untargeted: any region
    with pytest.raises(ValueError):
        ReleaseLedger((), SECOND)

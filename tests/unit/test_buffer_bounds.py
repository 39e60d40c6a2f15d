"""Every in-memory buffer of a role is bounded, and its size and bound are exported: split-record
reassemblers, admission's decided set, the learner's waiting list, the judge latency window and
the feedback dedupe cache."""

from __future__ import annotations

import threading
from typing import Any

from test_arrays import trajectory

from rlstream.consumers.admission_rules import DecidedSet
from rlstream.consumers.feedback.rules import online_quota
from rlstream.consumers.feedback.seen import FeedbackIdLog
from rlstream.envs.judges import LATENCY_WINDOW, Judge, JudgeConfig
from rlstream.producers.feedback.dedupe import IdempotencyLRU
from rlstream.producers.runtime import metrics
from rlstream.schemas import arrays as A
from rlstream.schemas import reassembly as R
from rlstream.trainer.learner import make_room, pick_step
from rlstream.trainer.learner_step import StepInput


def _gauge(name: str, buffer: str) -> float | None:
    return metrics.REGISTRY.collectors.get_sample_value(name, {"buffer": buffer})


def test_a_reassembler_never_holds_more_pieces_than_its_bound_and_evicts_the_oldest() -> None:
    items = [A.split_segments(trajectory(3000, seed=s), 20_000) for s in range(4)]
    assert all(len(segments) == 13 for segments in items)
    keys = [(s[0]["run"], s[0]["group_id"], s[0]["sample_index"]) for s in items]
    reassembler = R.trajectory_reassembler(max_pieces=16)
    for segments in items:  # six pieces of each item: none completes
        for seg in segments[:6]:
            assert reassembler.add(seg) is None
            assert reassembler.pieces <= 16
    assert reassembler.pop_evicted() == keys[:2] and reassembler.pop_evicted() == []
    assert reassembler.keys() == keys[2:] and reassembler.pieces == 12
    joined = [reassembler.add(seg) for seg in items[3][6:]]  # the newest still completes...
    assert joined[-1] is not None and joined[-1]["sample_index"] == items[3][0]["sample_index"]
    assert reassembler.pop_evicted() == [keys[2]]  # ...making room by evicting the oldest
    assert reassembler.pieces == 0 and reassembler.evicted_total == 3


def test_the_decided_set_forgets_the_oldest_past_its_bound() -> None:
    decided = DecidedSet(3)
    decided |= ["g1", "g2", "g3"]
    decided.add("g1")  # re-added: the newest again
    decided |= ["g4"]
    assert "g2" not in decided and all(g in decided for g in ("g1", "g3", "g4"))
    assert len(decided) == 3 and decided.forgotten == 1
    for i in range(100):
        decided.add(f"x{i}")
        assert len(decided) <= 3


def _g(source: str, offset: int) -> StepInput:
    return StepInput({"source": source}, [("rl.r.admitted", 0, offset)])


def test_a_full_waiting_list_that_no_step_can_take_drops_its_oldest_online_group() -> None:
    quota = lambda rollout: online_quota(rollout, 1, 4)  # noqa: E731
    waiting = [_g("online", 0), _g("rollout", 1), _g("online", 2), _g("online", 3)]
    ready = pick_step(waiting, 2, quota, rollout_done=0, online_done=0) is not None
    assert not ready  # one rollout group: the quota defers every online group
    assert make_room(waiting, 4, ready) == [0]  # full: the oldest online group goes
    assert make_room(waiting, 5, ready) == []  # room left: nothing is dropped
    assert make_room(waiting, 4, step_ready=True) == []  # a step will make room


def test_the_judge_keeps_the_latest_latencies_and_exports_its_buffers() -> None:
    judge = Judge("r", "format", JudgeConfig(kind="format"))
    for i in range(LATENCY_WINDOW + 50):
        judge.latencies_ms.append(float(i))
    assert len(judge.latencies_ms) == LATENCY_WINDOW and judge.latencies_ms[0] == 50.0
    judge.process([])
    assert _gauge("rlstream_buffer_items", "judge.format.latencies") == LATENCY_WINDOW
    assert _gauge("rlstream_buffer_bound", "judge.format.latencies") == LATENCY_WINDOW


def test_the_feedback_dedupe_cache_holds_at_most_max_ids_and_exports_its_size() -> None:
    seen: Any = FeedbackIdLog.__new__(FeedbackIdLog)  # the cache without its Kafka follower
    seen._ids, seen._lock = IdempotencyLRU(3600, 5), threading.Lock()
    for i in range(20):
        seen.add(f"f{i}")
        assert len(seen) <= 5
    assert "f19" in seen and "f0" not in seen
    assert _gauge("rlstream_buffer_items", "feedback.seen") == 5
    assert _gauge("rlstream_buffer_bound", "feedback.seen") == 5

"""Tidal capacity's pure rules: the lending guard, load traces, serving metrics, and where the
scheduler sends tasks and reclaimed groups (rollout.capacity, rollout.reissue)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstream.rollout.capacity import (
    DIURNAL_TRACE,
    CapacityConfig,
    CapacityError,
    Guard,
    MetricsLoad,
    TraceLoad,
    buckets,
    parse_metrics,
    quantile_ms,
    read_trace,
)
from rlstream.rollout.reissue import REGION_TAG, ReleaseLedger


def _guard(**kw: float) -> Guard:
    base = {"engines": 8, "min_serving": 1, "headroom": 0.25, "slo_p99_ms": 1000.0}
    return Guard(CapacityConfig(**{**base, "cooldown_s": 30.0, "raise_step": 8, **kw}))


def test_the_load_leaves_its_need_plus_headroom_serving() -> None:
    g = _guard()
    assert g.allowed(0.0) == 7  # min_serving stays
    assert g.allowed(3.0) == 4  # ceil(3 / 0.75) = 4 serve
    assert g.allowed(3.1) == 3
    assert g.allowed(8.0) == 0 and g.allowed(50.0) == 0


def test_a_p99_over_the_slo_hands_an_engine_back_at_once_and_holds() -> None:
    g = _guard()
    assert g.decide(1.0, 400.0, now=0.0) == (6, "")
    lent, why = g.decide(1.0, 1500.0, now=1.0)  # the load says 6, serving is slow anyway
    assert (lent, why) == (5, "p99 over the SLO")
    assert g.decide(1.0, 300.0, now=2.0) == (5, "cooling down")  # not raised again yet
    assert g.decide(1.0, 300.0, now=31.5) == (6, "")
    assert g.decide(5.0, 300.0, now=32.0) == (1, "")  # a burst in the load: cut at once


def test_lending_rises_by_the_step_and_falls_at_once() -> None:
    g = _guard(raise_step=2)
    assert [g.decide(0.0, None, now=float(t))[0] for t in range(5)] == [2, 4, 6, 7, 7]
    assert g.decide(6.0, None, now=5.0)[0] == 0


def test_a_trace_is_checked_and_interpolated(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("t_s,load\n0,0.0\n100,1.0\n200,0.0\n")
    trace = TraceLoad(path, engines=10, time_scale=10.0, start=0.0)
    assert trace.at(50.0) == pytest.approx(0.5) and trace.at(250.0) == pytest.approx(0.5)
    reading = trace.read(now=1.0, guard=_guard(engines=10))  # trace second 10: load 0.1
    assert reading.busy == pytest.approx(1.0)
    # lendable falls below today's 8 once load passes 0.15 (trace 15 s): 0.5 wall seconds
    assert reading.steady_s == pytest.approx(0.5, abs=0.05)
    for text, why in [
        ("t_s,load\n0,0.1\n", "at least two rows"),
        ("t_s,load\n5,0.1\n9,0.2\n", "the first at t_s 0"),
        ("t_s,load\n0,0.1\n0,0.2\n", "must increase"),
        ("t_s,load\n0,0.1\n9,1.5\n", r"in \[0, 1\]"),
        ("time,x\n0,1\n", "rows must be t_s,load"),
    ]:
        path.write_text(text)
        with pytest.raises(CapacityError, match=why):
            read_trace(path)
    with pytest.raises(CapacityError, match="no such file"):
        read_trace(tmp_path / "missing.csv")


def test_the_shipped_day_has_a_night_to_lend() -> None:
    t, load = read_trace(DIURNAL_TRACE)
    assert t[-1] == 24 * 3600
    night = [x for s, x in zip(t, load, strict=True) if s < 6 * 3600]
    assert max(night) < 0.2 < max(load)


VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{model_name="m"} 12.0
vllm:num_requests_waiting{model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} %d
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} %d
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} %d
"""


def test_vllm_metrics_give_the_load_and_the_p99_of_the_last_window() -> None:
    pages = iter([VLLM % (90, 99, 100), VLLM % (180, 198, 200)])
    src = MetricsLoad(["http://e0/metrics"], slots_per_engine=8, fetch=lambda url: next(pages))
    first = src.read(0.0, _guard())
    assert first.busy == pytest.approx(2.0) and first.p99_ms is None  # no window yet
    second = src.read(1.0, _guard())
    assert second.p99_ms == 1000.0  # of the 100 finished, 90 within 0.5 s, 99 within 1 s
    after = buckets(parse_metrics(VLLM % (180, 198, 200)))
    assert after == {0.5: 180.0, 1.0: 198.0, float("inf"): 200.0}
    assert quantile_ms(after, after, 0.99) is None  # nothing finished between two scrapes
    assert quantile_ms({}, {0.5: 1.0, float("inf"): 100.0}, 0.99) == float("inf")


def test_metrics_as_a_source_need_their_urls() -> None:
    with pytest.raises(ValueError, match="needs metrics_urls"):
        CapacityConfig(source="metrics")
    with pytest.raises(ValueError, match="min_serving 3 > engines 2"):
        CapacityConfig(engines=2, min_serving=3)


def _task(i: int, region: str) -> dict[str, object]:
    return {"task_id": f"t{i}", "created_ms": 0, "tags": {REGION_TAG: region}, "attempt": 0}


def test_a_region_without_engines_gets_no_task_and_the_others_fill_per_engine() -> None:
    ledger = ReleaseLedger(("eu", "us"), reissue_after_ms=60_000)
    weights = {"eu": 0, "us": 3}
    assert ledger.place(0, weights=weights) == "us"
    assert ledger.place(0, weights={"eu": 0, "us": 0}) is None
    ledger.release(_task(0, "us"), 0)
    ledger.release(_task(1, "us"), 0)
    # us has 2 in flight on 3 engines; eu 0 on 1: eu next
    assert ledger.place(0, weights={"eu": 1, "us": 3}) == "eu"


def test_a_reclaimed_group_is_released_again_once_with_its_checkpoint() -> None:
    ledger = ReleaseLedger(("eu", "us"), reissue_after_ms=60_000)
    ledger.release(_task(0, "eu"), 0)
    cut = {"group_id": "t0", "attempt": 0, "checkpoint": b"RLCK1..."}
    again = ledger.resume(cut, 5, "us")
    assert again is not None
    assert (again["attempt"], again["tags"][REGION_TAG], again["checkpoint"]) == (
        1,
        "us",
        cut["checkpoint"],
    )
    ledger.release(again, 5)
    assert ledger.resume(cut, 6, "us") is None  # read again after a restart: already released
    ledger.decide("t0")
    assert ledger.resume({**cut, "attempt": 1}, 7, "eu") is None  # decided: nothing to resume


class _View:
    """The scheduler's capacity view with one live signal per region (``published_ms``)."""

    def __init__(self, published: dict[str, int]) -> None:
        self.published = published

    def live(self, region: str, now_ms: int) -> dict[str, int] | None:
        at = self.published.get(region)
        return None if at is None else {"published_ms": at}


def test_a_reclaimed_group_waits_for_a_signal_newer_than_its_reclaim() -> None:
    import threading

    from rlstream.rollout.scheduler import Capacity

    ledger = ReleaseLedger(("eu",), reissue_after_ms=60_000)
    ledger.release(_task(0, "eu"), 0)
    capacity = Capacity.__new__(Capacity)  # its Kafka followers replaced by the view below
    capacity._lock, capacity.resumed = threading.Lock(), 0
    cut = {
        "group_id": "t0",
        "attempt": 0,
        "region": "eu",
        "preempted_ms": 1_000,
        "checkpoint": b"x",
    }
    capacity._reclaimed = [cut]
    capacity.view = _View({"eu": 900})  # still counts the engine serving took back
    assert capacity.resumes(ledger, 1_100, {"eu": 1}) == []
    assert capacity._reclaimed == [cut]  # kept for the next call
    capacity.view = _View({"eu": 1_050})  # the signal after the reclaim
    (again,) = capacity.resumes(ledger, 1_100, {"eu": 1})
    assert again["attempt"] == 1 and capacity.resumed == 1
    capacity._reclaimed, capacity.view = [{**cut, "group_id": "t1"}], _View({})  # no live signal
    ledger.release(_task(1, "eu"), 0)
    assert len(capacity.resumes(ledger, 1_100, {"eu": 1})) == 1  # not held by a dead one


def test_cluster_status_draws_lent_engines_as_a_line() -> None:
    from rlstream.ops.cluster.status import sparkline

    assert sparkline([0, 4, 8, 2], 8) == " ▄█▂"
    assert sparkline([3, 9], 8) == "▃█"  # past the engines: full
    assert sparkline([0, 0], 0) == "  "

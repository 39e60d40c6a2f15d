"""Run analytics: the figures the dashboard and the report show, folded from decoded records.

Properties asserted: each figure follows its stated rule exactly (success = passed/judged of the
success judge, a split sample or decision counts once, sync latency = first use - publish,
rates over the window); folding is independent of arrival order across streams; memory stays
bounded; every snapshot is strict JSON (no NaN); the web app serves the snapshot as JSON and as
server-sent events; the report writes its page and valid PNGs.
"""

from __future__ import annotations

import copy
import json
import random
import urllib.request
from typing import Any

import pytest
from test_events import examples

from rlstream.ops.observe import analytics as A
from rlstream.ops.observe.report import rebin, write_report
from rlstream.schemas import events

RUN = "r1"
T0 = 1_732_000_000_000


def _decoded(event: str, **changes: Any) -> dict[str, Any]:
    """A realistic record of ``event`` with ``changes``, through a real encode/decode round trip."""
    record = copy.deepcopy(examples()[event])
    for key, value in changes.items():
        if key == "timings":
            record["timings"].update(value)
        else:
            record[key] = value
    return events.decode(events.encode(event, record)).record


def reward(judge: str, version: int, passed: bool, score: float, **kw: Any) -> dict[str, Any]:
    return _decoded("reward", judge=judge, policy_version=version, passed=passed, score=score, **kw)


def test_success_rate_and_mean_reward_by_version() -> None:
    a = A.RunAnalytics(run=RUN)
    for i, passed in enumerate([True, False, True, True]):  # v1: 3/4
        a.take("rl.r1.rewards", reward("tests", 1, passed, float(passed)), T0 + i)
    a.take("rl.r1.rewards", reward("tests", 2, False, 0.0), T0)  # v2: 0/1
    a.take("rl.r1.rewards", reward("tests", 2, True, 1.0, error="sandbox died"), T0)  # not judged
    a.take("rl.r1.rewards", reward("style", 1, True, 0.5), T0)
    a.take("rl.r1.rewards", reward("style", 1, False, 0.25), T0)
    rows = {r["version"]: r for r in a.snapshot(T0)["versions"]}
    assert rows[1]["success"] == 0.75 and rows[1]["judged"] == 4
    assert rows[2]["success"] == 0.0 and rows[2]["judged"] == 1
    assert rows[1]["mean_reward"] == {"style": 0.375, "tests": 0.75}
    assert a.judges["tests"].errors == 1 and a.judges["tests"].count == 6
    assert a.rate([1, 2]) == 3 / 5 and a.success_judge == "tests"


def test_success_judge_falls_back_then_prefers_tests() -> None:
    a = A.RunAnalytics(run=RUN)
    a.take("rl.r1.rewards", reward("style", 3, True, 1.0))
    assert a.success_judge == "style" and a.rate([3]) == 1.0
    a.take("rl.r1.rewards", reward("tests", 3, False, 0.0))
    a.take("rl.r1.rewards", reward("style", 3, True, 1.0))
    assert a.success_judge == "tests" and a.success == {3: [0, 1]}


def test_final_versions_skip_newest_and_gather_enough_samples() -> None:
    a = A.RunAnalytics(run=RUN)
    for version, n in [(0, 5), (1, 5), (2, 5), (3, 5), (4, 5)]:
        for _ in range(n):
            a.take("rl.r1.rewards", reward("tests", version, True, 1.0))
    assert a.final_versions(min_samples=8, skip_newest=2) == [2, 1]
    assert a.final_versions(min_samples=100, skip_newest=0) == [4, 3, 2, 1, 0]


def test_split_trajectory_counts_one_sample_and_regions_by_topic() -> None:
    a = A.RunAnalytics(run=RUN)
    seg0 = _decoded("trajectory", segment_index=0, segment_count=2, region="eu")
    seg1 = _decoded("trajectory", segment_index=1, segment_count=2, region="eu")
    a.take("eu.rl.r1.trajectories", seg0, T0)
    a.take("eu.rl.r1.trajectories", seg1, T0)
    a.take("rl.r1.trajectories", _decoded("trajectory", region="trainer"), T0)
    snap = a.snapshot(T0 + 1000)
    assert snap["samples"] == 2 and snap["streams"]["trajectories"]["total"] == 3
    eu = snap["regions"]["eu"]
    assert (eu["samples"], eu["records"], eu["topics"]) == (1, 2, ["eu.rl.r1.trajectories"])
    assert eu["mean_generate_ms"] == seg0["timings"]["generate_ms"]
    assert snap["regions"]["trainer"]["samples"] == 1


def test_split_decision_counts_once_with_staleness_and_reasons() -> None:
    a = A.RunAnalytics(run=RUN)
    admitted = [_decoded("admission", staleness=s) for s in (0, 1, 1, 2)]
    extra_part = _decoded("admission", staleness=1, part_index=1, part_count=2)
    stale = _decoded("admission", decision="rejected", reason="stale", staleness=5, samples=[])
    no_signal = _decoded("admission", decision="rejected", reason="no_signal", staleness=1)
    for rec in [*admitted, extra_part]:
        a.take("rl.r1.admitted", rec)
    for rec in (stale, stale, no_signal):
        a.take("rl.r1.rejected", rec)
    snap = a.snapshot(T0)
    assert snap["admitted"] == 4 and snap["rejected"] == 3
    assert snap["staleness"] == [[0, 1, 0], [1, 2, 1], [2, 1, 0], [5, 0, 2]]
    assert snap["rejections"] == {"stale": 2, "no_signal": 1}
    assert snap["mean_recent_staleness"] == pytest.approx((0 + 1 + 1 + 2 + 5 + 5 + 1) / 7)


def test_weight_sync_bytes_interval_and_first_use_per_region() -> None:
    a = A.RunAnalytics(run=RUN)
    for version, created in [(1, T0), (2, T0 + 4000)]:
        a.take(
            "rl.r1.weights.manifests",
            _decoded("weight_manifest", version=version, created_ms=created, kind="delta"),
            created,
        )
    # regions start generating with v2 1.5 s (eu) and 0.2 s (trainer) after it was published
    for region, started in [("eu", T0 + 5500), ("eu", T0 + 7000), ("trainer", T0 + 4200)]:
        a.take(
            f"{'eu.' if region == 'eu' else ''}rl.r1.trajectories",
            _decoded(
                "trajectory", policy_version=2, region=region, timings={"started_ms": started}
            ),
            started,
        )
    rows = {w["version"]: w for w in a.snapshot(T0 + 8000)["weights"]}
    assert rows[2]["first_use_ms"] == {"eu": 1500, "trainer": 200}
    assert rows[2]["interval_ms"] == 4000 and rows[1]["interval_ms"] is None
    assert rows[2]["ratio"] == 8_388_608 / 180_442
    assert a.version == 2
    assert a.snapshot(T0 + 8000)["streams"]["weights.chunks"]["total"] == 2  # one chunk each


def test_rates_use_the_window_before_now_and_memory_is_bounded() -> None:
    a = A.RunAnalytics(run=RUN)
    for second in range(30):
        for _ in range(second % 3 + 1):  # 1, 2, 3 records per second, repeating
            a.take("rl.r1.tasks", _decoded("task"), T0 + second * 1000 + 500)
    stream = a.snapshot(T0 + 30_000)["streams"]["tasks"]
    assert stream["rate"] == pytest.approx(sum(s % 3 + 1 for s in range(20, 30)) / 10)
    assert stream["recent"][-3:] == [1, 2, 3] and len(stream["recent"]) == 120
    assert stream["total"] == sum(s % 3 + 1 for s in range(30))
    series = a.streams["tasks"]
    for second in range(3000):
        series.add(T0 + second * 1000)
    assert len(series.live) <= A.LIVE_WINDOW_S + 60
    assert sum(n for _, n in a.run_series("tasks")) == series.total


def test_folding_is_independent_of_arrival_order() -> None:
    # scores are binary fractions, so their sums are exact in any order (float + is not associative)
    records = [
        ("rl.r1.rewards", reward("tests", v % 4, v % 3 == 0, v / 8), T0 + v) for v in range(40)
    ]
    records += [
        ("rl.r1.admitted", _decoded("admission", staleness=v % 3), T0 + v) for v in range(10)
    ]
    records += [
        (
            "rl.r1.weights.manifests",
            _decoded("weight_manifest", version=v, created_ms=T0 + v),
            T0 + v,
        )
        for v in range(5)
    ]
    snaps = []
    for seed in range(3):
        shuffled = records[:]
        random.Random(seed).shuffle(shuffled)
        a = A.RunAnalytics(run=RUN)
        for topic, rec, ts in shuffled:
            a.take(topic, rec, ts)
        snaps.append(a.snapshot(T0 + 60_000))
    assert snaps[0] == snaps[1] == snaps[2]


def test_snapshot_is_strict_json_even_when_empty() -> None:
    empty = A.RunAnalytics(run=RUN).snapshot(T0)
    json.dumps(empty, allow_nan=False)
    assert empty["versions"] == [] and empty["policy_version"] == -1
    assert set(empty["streams"]) >= set(A.CHART_STREAMS)
    a = A.RunAnalytics(run=RUN)
    a.take("rl.r1.rewards", reward("tests", 1, True, 1.0, error="judge crashed"))
    a.take("rl.r1.dlq", _decoded("dead_letter"))
    a.take_undecodable("rl.r1.rewards", "corrupt_body")
    snap = a.snapshot(T0)
    json.dumps(snap, allow_nan=False)
    assert (
        snap["undecodable"] == {"rewards: corrupt_body": 1}
        and sum(snap["dead_letters"].values()) == 1
    )


def test_lag_by_role_and_stream() -> None:
    a = A.RunAnalytics(run=RUN)
    a.set_lag(
        {
            "rlstream.r1.judge.tests": {"rl.r1.trajectories": 7},
            "rlstream.r1.learner": {"rl.r1.admitted": 2, "eu.rl.r1.trajectories": 1},
        }
    )
    lag = a.snapshot(T0)["lag"]
    assert lag["judge.tests"] == {
        "group": "rlstream.r1.judge.tests",
        "total": 7,
        "topics": {"trajectories": 7},
    }
    assert lag["learner"]["topics"] == {"admitted": 2, "eu.trajectories": 1}


def test_topic_regex_matches_run_and_mirrors_only() -> None:
    import re

    pattern = re.compile(A.run_topic_regex("r1"))
    assert pattern.match("rl.r1.trajectories") and pattern.match("eu.rl.r1.trajectories")
    assert pattern.match("rl.r1.weights.manifests")
    for other in ("rl.r10.trajectories", "rl.r1.weights.chunks", "rl.runs", "rl.r1xtrajectories"):
        assert not pattern.match(other), other
    assert A.split_topic("us-east.rl.r1.rewards") == ("us-east", "r1", "rewards")
    assert A.role_of_group("r1", "rlstream.r1.judge.tests") == "judge.tests"
    assert A.role_of_group("r1", "rlstream.r10.learner") is None


def test_quantile_interpolates_inside_buckets() -> None:
    bounds = (10.0, 20.0, 40.0)
    assert A.quantile(bounds, [0, 10, 0, 0], 0.5, 20.0) == 15.0
    assert A.quantile(bounds, [5, 5, 0, 0], 0.5, 20.0) == 10.0
    # overflow bucket: interpolated between the last bound and the largest value seen
    assert A.quantile(bounds, [0, 0, 0, 4], 0.95, 75.0) == 40.0 + 35.0 * 0.95
    assert A.quantile(bounds, [0, 0, 0, 0], 0.5, 0.0) is None
    assert A.quantile(bounds, [0, 0, 3, 0], 0.5, 33.0, 33.0) == 33.0  # narrowed to what was seen
    stats = A.JudgeStats()
    for ms in range(1, 101):
        stats.add(ms, False)
    summary = stats.summary()
    assert summary["mean_ms"] == 50.5 and summary["max_ms"] == 100
    assert 25 <= summary["p50_ms"] <= 100 and summary["p95_ms"] <= 100


def test_rebin_keeps_totals_and_bounds_bins() -> None:
    series = [(1000 + 10 * i, 5) for i in range(1000)] + [(30_000, 7)]
    minutes, rates, width = rebin(series, max_bins=100)
    assert len(minutes) <= 101 and width % A.RUN_BUCKET_S == 0
    assert sum(r * width for r in rates) == pytest.approx(5 * 1000 + 7)
    assert rebin([]) == ([], [], A.RUN_BUCKET_S)


def _full_analytics() -> A.RunAnalytics:
    a = A.RunAnalytics(run=RUN)
    for v in range(6):
        created = T0 + v * 3000
        a.take(
            "rl.r1.weights.manifests",
            _decoded("weight_manifest", version=v, created_ms=created),
            created,
        )
        for i in range(4):
            a.take("rl.r1.rewards", reward("tests", v, (i + v) % 2 == 0, 1.0), created + 100 * i)
        a.take(
            "eu.rl.r1.trajectories",
            _decoded("trajectory", policy_version=v, timings={"started_ms": created + 300}),
            created + 300,
        )
        a.take("rl.r1.admitted", _decoded("admission", staleness=v % 2), created + 400)
    a.take(
        "rl.r1.rejected", _decoded("admission", decision="rejected", reason="stale", staleness=4)
    )
    a.set_lag({"rlstream.r1.learner": {"rl.r1.admitted": 3}})
    return a


def test_report_writes_page_and_pngs(tmp_path) -> None:
    manifest = examples()["run_manifest"]
    index = write_report(_full_analytics(), manifest, tmp_path, T0 + 60_000)
    page = index.read_text()
    assert "Run r1" in page and "resolved config" in page and "&quot;lr&quot;" in page
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 6 and all(f"src='{name}'" in page for name in pngs)
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in pngs)
    snap = json.loads((tmp_path / "snapshot.json").read_text())
    assert snap["policy_version"] == 5 and snap["regions"]["eu"]["samples"] == 6
    empty = write_report(A.RunAnalytics(run="empty"), None, tmp_path / "empty", T0)
    assert "No manifest" in empty.read_text() and len(list((tmp_path / "empty").glob("*.png"))) == 6


def test_web_app_serves_snapshot_and_server_sent_events() -> None:
    from rlstream.ops.observe.dashboard import Server, make_app

    a = _full_analytics()
    calls = []

    def snapshot() -> dict[str, Any]:
        calls.append(1)
        return {**a.snapshot(T0 + 20_000), "seq": len(calls)}

    server = Server(make_app(snapshot, interval_s=0.05))
    url = server.start()
    try:
        with urllib.request.urlopen(url + "api/snapshot", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/json")
            assert json.load(resp)["policy_version"] == 5
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b"chart-success" in resp.read()
        with urllib.request.urlopen(url + "static/dashboard.js", timeout=10) as resp:
            assert b"EventSource" in resp.read()
        seqs = []
        with urllib.request.urlopen(url + "events", timeout=10) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    seqs.append(json.loads(line[6:])["seq"])
                if len(seqs) == 3:
                    break
        assert seqs == sorted(seqs) and len(set(seqs)) == 3  # a fresh snapshot each push
    finally:
        server.stop()


def test_implausible_manifests_are_counted_and_never_become_the_version() -> None:
    a = A.RunAnalytics(run=RUN)
    for v, epoch in ((0, 1), (1, 1), (2, 2)):
        a.take(
            "rl.r1.weights.manifests", _decoded("weight_manifest", version=v, learner_epoch=epoch)
        )
    a.take("rl.r1.weights.manifests", _decoded("weight_manifest", version=3, learner_epoch=1))
    a.take("rl.r1.weights.manifests", _decoded("weight_manifest", version=10**12, learner_epoch=2))
    snap = a.snapshot(T0)
    assert snap["policy_version"] == 2 and [w["version"] for w in snap["weights"]] == [0, 1, 2]
    assert snap["weights_refused"] == {"epoch": 1, "version": 1}
    json.dumps(snap, allow_nan=False)


def test_capacity_lent_over_time_per_region_and_groups_handed_on() -> None:
    a = A.RunAnalytics(run=RUN)
    for k, lent in enumerate([0, 2, 5, 3]):
        rec = _decoded("capacity", region="eu", published_ms=T0 + k * 1000, lent=lent)
        a.take("eu.rl.r1.capacity", rec, T0 + k * 1000)
    a.take("rl.r1.capacity", _decoded("capacity", region="trainer", serving_p99_ms=None), T0)
    a.take("eu.rl.r1.preempted", _decoded("preempted", region="eu"), T0)
    snap = json.loads(json.dumps(a.snapshot(T0 + 5000), allow_nan=False))
    eu = snap["capacity"]["eu"]
    assert [h[1] for h in eu["history"]] == [0, 2, 5, 3] and eu["lent"] == 3
    assert eu["engines"] == 8 and eu["preempted"] == 1 and eu["busy_engines"] == 2.5
    assert snap["capacity"]["trainer"]["serving_p99_ms"] is None
    for k in range(A.MAX_LIST + 10):  # bounded like every list of the snapshot
        a.take("eu.rl.r1.capacity", _decoded("capacity", region="eu", published_ms=T0 + k), None)
    assert len(a.snapshot(T0)["capacity"]["eu"]["history"]) == A.MAX_LIST

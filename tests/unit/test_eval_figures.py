"""Held-out eval figures: the analytics fold eval events, the report and demo show them."""

from __future__ import annotations

from rlstream.ops.demo import demo
from rlstream.ops.observe.analytics import RunAnalytics
from rlstream.ops.observe.report import _eval_rows


def _eval(version: int, greedy: float, released: bool) -> dict:
    return {
        "version": version,
        "greedy_success": greedy,
        "pass_at_k": min(1.0, greedy + 0.2),
        "sample_success": greedy / 2,
        "k": 4,
        "n_tasks": 64,
        "released": released,
    }


def test_eval_events_become_a_curve_by_version() -> None:
    a = RunAnalytics("r")
    for rec in (_eval(40, 0.3, True), _eval(0, 0.1, True), _eval(80, 0.2, False)):
        a.take("rl.r.evals", {**rec, "model": "policy", "task_set": "t"}, 1)
    snap = a.snapshot(1000)
    assert [e["version"] for e in snap["evals"]] == [0, 40, 80]
    assert snap["evals"][1]["greedy_success"] == 0.3 and not snap["evals"][2]["released"]
    rows = dict((k, v) for k, v in _eval_rows(snap["evals"]))
    assert rows["held-out greedy success (v0 -> v80)"] == "0.1 -> 0.2"
    assert rows["released versions"] == "v0, v40"
    assert _eval_rows([]) == [["held-out eval", None]]


def test_demo_waits_for_the_last_due_version() -> None:
    assert demo.last_due(199, 40) == 160
    assert demo.last_due(200, 40) == 200
    assert demo.last_due(-1, 40) == 0

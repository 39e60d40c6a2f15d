"""The critical-path split of a version's interval (``ops.bench.critical_path``), without a run."""

from __future__ import annotations

import pytest

from rlstream.ops.bench.critical_path import STAGES, breakdown, split_interval


def test_each_stage_gets_the_time_to_its_mark_and_the_stages_add_up_to_the_interval() -> None:
    marks = [("publish", 11.0), ("kafka_hops", 12.0), ("generate", 15.0), ("train", 20.0)]
    out = split_interval(10.0, 20.0, marks)
    assert out["publish"] == 1.0 and out["kafka_hops"] == 1.0 and out["generate"] == 3.0
    assert out["train"] == 5.0 and sum(out.values()) == pytest.approx(10.0)
    assert set(out) == set(STAGES)


def test_marks_before_the_interval_or_out_of_order_get_nothing() -> None:
    # an asynchronous group: released and generated before the interval began
    marks = [("kafka_hops", 2.0), ("generate", 5.0), ("admission", 14.0), ("train", 20.0)]
    out = split_interval(10.0, 20.0, marks)
    assert out["generate"] == 0.0 and out["admission"] == 4.0 and out["train"] == 6.0
    late = split_interval(10.0, 20.0, [("judges", 25.0), ("train", 18.0)])
    assert late == {**dict.fromkeys(STAGES, 0.0), "judges": 10.0}


def test_breakdown_follows_each_versions_last_admitted_group() -> None:
    def group(t: float, decided: float) -> dict[str, float]:
        ms = {"released_ms": t, "started_ms": t + 100, "finished_ms": t + 900}
        return {**ms, "env_ms": 300, "rewarded_ms": t + 1000, "decided_ms": decided}

    versions = {
        1: {"created_ms": 10_000, "published_ms": 10_200, "step_s": 0.5, "groups": ["a"]},
        2: {"created_ms": 12_000, "published_ms": 12_200, "step_s": 0.5, "groups": ["b", "c"]},
    }
    groups = {"a": group(8_000, 9_100), "b": group(10_300, 11_400), "c": group(9_000, 10_100)}
    out = breakdown({"versions": versions, "groups": groups})
    assert out["versions"] == 1 and out["interval_s"] == pytest.approx(2.0)
    # group b (decided last): released 10.3, started 10.4, generated 10.9, environment to 11.2,
    # rewarded 11.3, decided 11.4; training 11.5 to 12.0
    s = out["stages_s"]
    assert s["publish"] == pytest.approx(0.2) and s["queued"] == pytest.approx(0.1)
    assert s["generate"] == pytest.approx(0.5) and s["environment"] == pytest.approx(0.3)
    assert s["judges"] == pytest.approx(0.1) and s["admission"] == pytest.approx(0.1)
    assert s["train"] == pytest.approx(0.5)
    assert s["kafka_hops"] == pytest.approx(0.1)  # 11.4 -> 11.5 (c, first released, came early)
    assert out["learner_idle"] == pytest.approx(1 - 0.7 / 2.0)
    assert s["refill"] == pytest.approx(0.1)  # 10.2 -> 10.3: b was released after c


def test_a_group_of_a_later_release_charges_the_rounds_before_it_to_refill() -> None:
    marks = {"released_ms": 13_000, "started_ms": 13_100, "finished_ms": 13_500, "env_ms": 0}
    late = {**marks, "rewarded_ms": 13_600, "decided_ms": 13_700}
    first = {**late, "released_ms": 10_300, "decided_ms": 11_000}
    versions = {
        1: {"created_ms": 10_000, "published_ms": 10_200, "step_s": 0.1, "groups": []},
        2: {"created_ms": 14_000, "published_ms": 14_200, "step_s": 0.1, "groups": ["a", "b"]},
    }
    out = breakdown({"versions": versions, "groups": {"a": first, "b": late}})["stages_s"]
    assert out["kafka_hops"] == pytest.approx(0.1 + 0.2)  # to the first release; to training
    assert out["refill"] == pytest.approx(2.7)  # 10.3 -> 13.0: the round that fell short


def test_time_to_target_is_when_each_run_first_reached_the_lowest_best_of_all_runs() -> None:
    from rlstream.ops.bench.asyncrl import time_to_target

    def run(*points: tuple[int, float, float]) -> dict:
        return {"heldout": list(points)}

    sync = [
        run((0, 0.0, 0.25), (3, 30.0, 0.3), (6, 60.0, 0.4)),
        run((0, 0.0, 0.25), (3, 40.0, 0.35)),
    ]
    fast = [run((0, 0.0, 0.25), (3, 10.0, 0.35), (6, 20.0, 0.3))]
    out = time_to_target(sync, fast)
    assert out["target"] == 0.35 and out["warm_start"] == 0.25  # the second sync run's best
    assert out["sync_runs_s"] == [60.0, 40.0] and out["async_runs_s"] == [10.0]
    assert out["speedup"] == pytest.approx(50.0 / 10.0)
    assert not out["target_fixed_before_run"] and out["ratio_runs"] == []  # arms not paired


def test_a_target_fixed_before_the_run_pairs_the_seeds_and_counts_runs_that_never_reach_it() -> (
    None
):
    from rlstream.ops.bench.asyncrl import heldout_area, time_to_target

    def run(*points: tuple[int, float, float]) -> dict:
        return {"heldout": list(points)}

    sync = [run((0, 0.0, 0.2), (3, 30.0, 0.5)), run((0, 0.0, 0.2), (3, 40.0, 0.4))]
    fast = [run((0, 0.0, 0.2), (3, 15.0, 0.5)), run((0, 0.0, 0.2), (3, 5.0, 0.6), (6, 12.0, 0.6))]
    out = time_to_target(sync, fast, target=0.5)
    assert out["target_fixed_before_run"] and out["target"] == 0.5
    assert out["sync_runs_s"] == [30.0, None] and out["never_reached"] == {"sync": 1, "async": 0}
    assert out["speedup"] is None and out["ratio_runs"] == [2.0] and out["seeds"] == 1
    area = heldout_area(sync, fast)
    assert area["horizon_s"] == 12.0  # the shortest run's last evaluation
    assert area["sync_runs"] == pytest.approx([0.2, 0.2])
    assert area["async_runs"] == pytest.approx([0.2, (0.2 * 5 + 0.6 * 7) / 12])


def test_a_sweep_run_reports_when_it_reached_the_headline_target_or_never() -> None:
    from rlstream.ops.bench.asyncrl import reached

    runs = [{"heldout": [(0, 0.0, 0.3), (3, 12.0, 0.5), (6, 20.0, 0.7)]}]
    assert reached(runs, 0.7) == 20.0 and reached(runs, 0.5) == 12.0
    assert reached(runs, 0.8) is None

"""``bench chaos --seeds N`` folds N runs into one result: counts summed, attacks summed per
kind, broker stalls pooled, and a run that did not hold makes the whole result fail."""

from __future__ import annotations

from typing import Any

from rlstream.ops.bench.chaos_report import combine, held


def _run(lost: int = 0, stalls: list[float | None] | None = None) -> dict[str, Any]:
    return {
        "tasks": 10, "finished": True, "groups_released": 10, "groups_decided": 10,
        "groups_lost": lost, "groups_decided_twice": 0, "groups_trained": 7,
        "groups_trained_twice": 0, "poison_trained": 0, "roles_given_up": 0,
        "genuine_refused": 0, "feedback_stored": 1, "final_success": 0.5,
        "attacks": {"wrong_key": {"tried": 2, "refused": 2}},
        "brokers": 3, "replication_factor": 3, "leader_kills": 1, "coordinator_kills": 1,
        "controller_kills": 1, "rolling_restarts": 1, "stalls_s": stalls or [4.0, None],
        "max_stall_s": 4.0, "wall_seconds": 100.0,
    }  # fmt: skip


def test_one_seed_is_the_run_itself() -> None:
    one = _run()
    assert combine([one], [7]) == {**one, "seeds": [7]}


def test_seeds_sum_counts_pool_stalls_and_keep_each_run() -> None:
    r = combine([_run(stalls=[3.0, 9.5]), _run(stalls=[None, 2.0])], [0, 1])
    assert r["seeds"] == [0, 1] and r["groups_released"] == 20 and r["leader_kills"] == 2
    assert r["attacks"] == {"wrong_key": {"tried": 4, "refused": 4}}
    assert r["stalls_s"] == [3.0, 9.5, None, 2.0] and r["max_stall_s"] == 9.5
    assert r["held_per_seed"] == [True, True] and held(r)
    assert len(r["per_seed"]) == 2 and r["final_success_per_seed"] == [0.5, 0.5]


def test_one_seed_that_lost_a_group_fails_the_whole() -> None:
    r = combine([_run(), _run(lost=1)], [0, 1])
    assert r["groups_lost"] == 1 and r["held_per_seed"] == [True, False] and not held(r)


def test_stalls_are_told_apart_by_the_fault_that_caused_them() -> None:
    a, b = _run(stalls=[3.0, 9.5]), _run(stalls=[None, 2.0])
    a["stall_kinds"], b["stall_kinds"] = ["leader", "roll"], ["roll", "leader"]
    r = combine([a, b], [0, 1])
    assert r["stall_kinds"] == ["leader", "roll", "roll", "leader"]
    assert r["max_stall_s_by_kind"] == {"leader": 3.0, "roll": None}


def test_a_fault_after_the_work_ended_is_no_stall_but_one_never_recovered_fails() -> None:
    done = _run(stalls=[3.0, None])
    done.update(stall_kinds=["leader", "roll"], stall_work_left=[True, False])
    done.update(faults_after_the_work=1, faults_never_recovered=0)
    stuck = _run(stalls=[2.0, None])
    stuck.update(stall_kinds=["leader", "roll"], stall_work_left=[True, True])
    stuck.update(faults_after_the_work=0, faults_never_recovered=1)
    r = combine([done, done], [0, 1])
    assert r["max_stall_s_by_kind"] == {"leader": 3.0} and r["faults_after_the_work"] == 2
    assert held(r)
    assert not held(combine([done, stuck], [0, 1]))

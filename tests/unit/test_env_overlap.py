"""``rollout.env_overlap``: which task offsets a worker commits while groups wait out their
environment time (``rollout.worker.commit_positions``), without a broker."""

from __future__ import annotations

from rlstream.rollout.worker import Waiting, commit_positions

A, B = ("rl.r.tasks", 0), ("rl.r.tasks", 1)


def test_a_partition_commits_past_its_last_task_when_no_group_of_it_waits() -> None:
    assert commit_positions({A: 8, B: 3}, []) == [(A, 8), (B, 3)]


def test_a_waiting_group_holds_its_partition_at_its_own_task() -> None:
    waiting = [Waiting(10.0, A, 5, []), Waiting(9.0, A, 6, []), Waiting(9.5, B, 2, [])]
    assert commit_positions({A: 8, B: 3}, waiting) == [(A, 5), (B, 2)]
    # the oldest published: its partition moves to the next one still waiting
    assert commit_positions({A: 8, B: 3}, waiting[1:]) == [(A, 6), (B, 2)]


def test_a_rebalance_drops_the_waiting_groups_of_the_partitions_it_took_only() -> None:
    from types import SimpleNamespace

    from confluent_kafka import TopicPartition

    from rlstream.rollout.worker import RolloutWorker

    worker = SimpleNamespace(
        waiting=[Waiting(10.0, A, 5, []), Waiting(9.5, B, 2, [])], read_to={A: 8, B: 3}
    )
    RolloutWorker.revoked(worker, [TopicPartition(*B)])  # type: ignore[arg-type]
    assert worker.waiting == [Waiting(10.0, A, 5, [])] and worker.read_to == {A: 8}

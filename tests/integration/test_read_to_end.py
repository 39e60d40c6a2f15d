"""Catching up on a real broker: a reader reads each partition to the end it had at the call,
again and again, and a reader left assigned by its last call is not left paused by the next one
(``read_to_end`` pauses it while it asks for the ends). ``TaskReleases`` reads the tasks stream
on demand and holds no assignment between reads.
"""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, Producer, TopicPartition

from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader
from rlstream.consumers.releases import TaskReleases
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.rollout.scheduler import SchedulerConfig, task_record
from rlstream.schemas import topics


def _write(kafka: KafkaSettings, topic: str, parts: list[int], start: int, n: int) -> None:
    producer = Producer(kafka.librdkafka())
    for i in range(start, start + n):
        producer.produce(topic, value=f"r{i}".encode(), partition=parts[i % len(parts)])
    assert producer.flush(30) == 0


def test_a_reader_reads_to_each_new_end_and_is_never_left_paused(
    kafka: KafkaSettings, unique_run: str
) -> None:
    ensure_run_topics(kafka, unique_run)
    topic = topics.topic_name(unique_run, "tasks")
    consumer = reader(kafka, "read-to-end-test")
    try:
        parts = partitions_of(consumer, topic) or []
        assert len(parts) > 1
        starts = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts]
        _write(kafka, topic, parts, 0, 3 * len(parts))
        first = [m.value() for m in read_to_end(consumer, starts, timeout=30)]
        assert len(first) == 3 * len(parts)
        # still assigned from the first call, and fetching ahead: the new end is read all the same
        _write(kafka, topic, parts, 3 * len(parts), len(parts))
        second = [m.value() for m in read_to_end(consumer, starts, timeout=30)]
        assert sorted(second) == sorted(
            [*first, *(f"r{i}".encode() for i in range(3 * len(parts), 4 * len(parts)))]
        )
        # the pause taken while the ends were asked for does not outlive an assign of the caller
        consumer.assign(starts)
        seen, deadline = 0, time.monotonic() + 30
        while seen < len(second) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                seen += 1
        assert seen == len(second)
    finally:
        consumer.close()


def test_task_releases_learn_later_releases_and_hold_no_assignment(
    kafka: KafkaSettings, unique_run: str
) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    tasks = topics.topic_name(run, "tasks")
    first, later = (
        {**task_record(run, SchedulerConfig(), i, 0), "tags": {"region": region}}
        for i, region in ((0, "eu"), (1, "us"))
    )
    releases = TaskReleases(kafka, run, max_tasks=100)
    try:
        with EventProducer.connect(kafka) as producer:
            producer.produce(tasks, "task", first, first["task_id"])
        assert releases.released_to(first["task_id"]) == frozenset({"eu"})
        assert releases._reader.assignment() == []  # read on demand: nothing fetched ahead
        with EventProducer.connect(kafka) as producer:
            producer.produce(tasks, "task", later, later["task_id"])
        assert releases.released_to(later["task_id"]) == frozenset({"us"})
        assert releases.released_to("never-released") is None
        assert releases.refreshes == 3
        # the first task re-issued to us: a copy from us is asked for with its region, so the
        # re-issue is read even though the task is known already (no refusal of its copy)
        again = {**first, "tags": {"region": "us"}}
        with EventProducer.connect(kafka) as producer:
            producer.produce(tasks, "task", again, again["task_id"])
        assert releases.released_to(first["task_id"], "eu") == frozenset({"eu"})  # no read
        assert releases.refreshes == 3
        assert releases.released_to(first["task_id"], "us") == frozenset({"eu", "us"})
        assert releases.refreshes == 4
    finally:
        releases.close()

"""Geo-replication: MirrorMaker 2 copies a run's tasks from the trainer region to a rollout
region; a consumer in the rollout region subscribes by pattern and reads the copy."""

from __future__ import annotations

import time
import uuid

from helpers import task

from rlstream.consumers.consumer import RoleConsumer, make_consumer
from rlstream.ops import cluster
from rlstream.producers.admin import ensure_run_topics
from rlstream.producers.producer import EventProducer
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import topics


def test_mirrormaker_copies_tasks_to_rollout_region(tmp_path, unique_run):
    if KafkaSettings.from_env() is not None:
        import pytest

        pytest.skip("needs the local launcher to start two regions")
    home = tmp_path / "regions"
    flow = cluster.parse_flow(r"trainer->eu:rl\..*\.tasks")
    state = cluster.up(["trainer", "eu"], [flow], home=home, heap="512m", log=lambda *_: None)
    try:
        trainer = KafkaSettings(bootstrap_servers=state.bootstrap("trainer"))
        eu = KafkaSettings(bootstrap_servers=state.bootstrap("eu"))
        ensure_run_topics(trainer, unique_run)
        with EventProducer.connect(trainer) as producer:
            for i in range(5):
                producer.produce(
                    topics.topic_name(unique_run, "tasks"),
                    "task",
                    task(unique_run, f"t{i}"),
                    f"t{i}",
                )
        pattern = topics.topic_pattern(unique_run, "tasks")
        consumer = RoleConsumer(
            make_consumer(
                eu,
                f"rlstream.{unique_run}.rollout.{uuid.uuid4().hex[:6]}",
                **{"topic.metadata.refresh.interval.ms": "1000"},
            ),
            [pattern],
            settings=eu,
        )
        got: dict[str, str] = {}
        deadline = time.monotonic() + 90
        while len(got) < 5 and time.monotonic() < deadline:
            for rec in consumer.poll_batch(50, 1.0):
                got[rec.value["task_id"]] = rec.message.topic()
        consumer.close()
        assert set(got) == {f"t{i}" for i in range(5)}
        assert set(got.values()) == {f"trainer.{topics.topic_name(unique_run, 'tasks')}"}
    finally:
        cluster.down(home=home, purge=True, log=lambda *_: None)

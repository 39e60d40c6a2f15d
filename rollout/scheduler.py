"""The scheduler role: releases a run's tasks, paced by the staleness budget.

Pacing rule (``releasable``): the learner advances one version per ``groups_per_step`` admitted
groups, so a task released while ``in_flight`` groups are ahead of it is trained about
``in_flight / groups_per_step`` versions after the version that generated it. Keeping
``in_flight <= groups_per_step * max_staleness`` therefore keeps groups within the staleness
budget *without discarding long rollouts*; admission still rejects what exceeds it.

Restart-safe: released and decided counts are read back from the tasks, admitted and rejected
streams at start, and task ids are a pure function of the run seed and the task index, so a
restarted scheduler neither re-releases nor skips a task.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlstream.consumers.consumer import RoleContext
from rlstream.consumers.tap import tap
from rlstream.envs import tasks as task_family
from rlstream.producers.producer import EventProducer
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import topics


class SchedulerConfig(BaseModel):
    """Config of the scheduler role."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=2, le=1024, description="Samples per task (GRPO group size G).")
    groups_per_step: int = Field(4, ge=1, description="Groups per learner step (B).")
    max_staleness: int = Field(2, ge=0, description="Staleness budget in versions.")
    max_tasks: int = Field(10_000, ge=1, description="Stop after releasing this many tasks.")
    seed: int = Field(0, ge=0, description="Run seed: task i has seed seed * 1e6 + i.")
    max_turns: int = Field(2, ge=0, description="Tool calls allowed per sample.")
    tasks: task_family.TaskConfig = Field(
        default_factory=task_family.TaskConfig, description="Task family difficulty."
    )


def releasable(released: int, decided: int, groups_per_step: int, max_staleness: int) -> int:
    """How many more tasks may be released now (see the module rule); never negative."""
    budget = groups_per_step * max(1, max_staleness)
    return max(0, budget - (released - decided))


def task_seed(run_seed: int, index: int) -> int:
    return run_seed * 1_000_000 + index


def task_record(run: str, cfg: SchedulerConfig, index: int, version: int) -> dict[str, Any]:
    task = task_family.sample_task(task_seed(cfg.seed, index), cfg.tasks)
    return {
        "run": run,
        "task_id": task.task_id,
        "created_ms": int(time.time() * 1000),
        "family": "fx",
        "prompt": task.prompt,
        "spec_json": json.dumps({"seed": task.seed, "tasks": cfg.tasks.model_dump()}),
        "group_size": cfg.group_size,
        "max_turns": cfg.max_turns,
        "seed": task.seed,
        "released_version": version,
    }


def _count(settings: KafkaSettings, run: str, stream: str) -> int:
    """Distinct keys in a stream (a decision split in parts counts once)."""
    keys = {msg.key() for msg, _, _ in tap(settings, topics.topic_name(run, stream))}
    return len(keys)


def run_role(ctx: RoleContext) -> int:
    """Release tasks until ``max_tasks`` or stopped; returns how many were released in total."""
    from rlstream.consumers.versions import VersionWatcher

    settings, run, cfg, stopper, log = ctx.settings, ctx.run, ctx.cfg, ctx.stopper, ctx.log
    released = _count(settings, run, "tasks")
    watcher = VersionWatcher(settings, topics.topic_name(run, "weights.manifests"))
    decisions = DecisionCounter(settings, run)
    tasks_topic = topics.topic_name(run, "tasks")
    log(f"scheduler: {released} tasks released so far")
    with EventProducer.connect(settings) as producer:
        while not stopper.stopped and released < cfg.max_tasks:
            room = releasable(released, decisions.count, cfg.groups_per_step, cfg.max_staleness)
            for _ in range(min(room, cfg.max_tasks - released)):
                rec = task_record(run, cfg, released, max(watcher.version, 0))
                producer.produce(tasks_topic, "task", rec, rec["task_id"])
                released += 1
            producer.flush()
            stopper.wait(0.2)
    decisions.close()
    watcher.close()
    return released


class DecisionCounter:
    """Counts decisions (admitted + rejected groups) in a background thread, from the start."""

    def __init__(self, settings: KafkaSettings, run: str) -> None:
        import threading

        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.count = 0
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                **settings.librdkafka(),
                "group.id": "rlstream.sched-count",
                "enable.auto.commit": "false",
                "isolation.level": "read_committed",
            }
        )
        parts = []
        for stream in ("admitted", "rejected"):
            name = topics.topic_name(run, stream)
            meta = self._consumer.list_topics(name, timeout=10).topics[name]
            parts += [TopicPartition(name, p, OFFSET_BEGINNING) for p in meta.partitions]
        self._consumer.assign(parts)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        from rlstream.schemas import events

        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            value = msg.value() or b""
            if events.fingerprint_of(value) is not None and _first_part(value):
                self.count += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()


def _first_part(value: bytes) -> bool:
    from rlstream.schemas import events

    try:
        return int(events.decode(value).record.get("part_index", 0)) == 0
    except events.EventError:
        return False

"""The scheduler role: releases a run's tasks, paced by the staleness budget.

Pacing rule (``releasable``): the learner advances one version per ``groups_per_step`` admitted
groups, so a task released while ``in_flight`` groups are ahead of it is trained about
``in_flight / groups_per_step`` versions after the version that generated it. Keeping
``in_flight <= groups_per_step * max_staleness`` therefore keeps groups within the staleness
budget *without discarding long rollouts*; admission still rejects what exceeds it.

Regions (``rollout.reissue``): each task is sent to one target region (the run's rollout
regions round-robin, else the trainer region) by its ``tags["region"]``; a group not decided
``reissue_after_s`` after its release is re-issued, same group id, to another live region, and
its region gets no new task for a while. Admission decides each group once, whichever copy
arrives first, so a region going dark loses nothing and a late copy is trained never.

Restart-safe: the releases (with their regions and attempts) and the decided groups are read
back from the tasks, admitted and rejected streams before the first release, and task ids are a
pure function of the run seed and the task index, so a restarted scheduler neither re-releases
nor skips a task, nor mistakes a decided group for an overdue one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlstream.consumers.consumer import RoleContext
from rlstream.consumers.tap import tap
from rlstream.envs import family as families
from rlstream.envs import tasks as task_family
from rlstream.envs.family import FamilySpec
from rlstream.envs.fx import with_fx_options
from rlstream.producers.producer import EventProducer
from rlstream.producers.settings import KafkaSettings
from rlstream.rollout.reissue import REGION_TAG, Ledger
from rlstream.schemas import topics


class SchedulerConfig(BaseModel):
    """Config of the scheduler role."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=2, le=1024, description="Samples per task (GRPO group size G).")
    families: dict[str, FamilySpec] = Field(
        default_factory=lambda: {"fx": FamilySpec()},
        description="Task families and their weights (injected from the run config).",
    )
    groups_per_step: int = Field(4, ge=1, description="Groups per learner step (B).")
    max_staleness: int = Field(2, ge=0, description="Staleness budget in versions.")
    max_tasks: int = Field(10_000, ge=1, description="Stop after releasing this many tasks.")
    seed: int = Field(0, ge=0, description="Run seed: task i has seed seed * 1e6 + i.")
    max_turns: int = Field(2, ge=0, description="Tool calls allowed per sample.")
    tasks: task_family.TaskConfig = Field(
        default_factory=task_family.TaskConfig, description="Task family difficulty."
    )
    reissue_after_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Re-issue a group to another region when undecided this long after its "
        "release; its region then gets no new task for as long.",
    )


def releasable(released: int, decided: int, groups_per_step: int, max_staleness: int) -> int:
    """How many more tasks may be released now (see the module rule); never negative."""
    budget = groups_per_step * max(1, max_staleness)
    return max(0, budget - (released - decided))


def task_seed(run_seed: int, index: int) -> int:
    return run_seed * 1_000_000 + index


def task_record(run: str, cfg: SchedulerConfig, index: int, version: int) -> dict[str, Any]:
    """Task ``index``: its family drawn by weight from (run seed, index), then the family's task
    for the task seed from the training split only (``envs.family``: held-out tasks are never
    released for training); a pure function of the config and ``index``."""
    specs = with_fx_options(cfg.families, cfg.tasks)
    name = families.pick_family(specs, cfg.seed, index)
    task = families.families(specs)[name].sample(task_seed(cfg.seed, index), split="train")
    return {
        "run": run,
        "task_id": task.task_id,
        "created_ms": int(time.time() * 1000),
        "family": name,
        "prompt": task.prompt,
        "spec_json": json.dumps(task.spec),
        "group_size": cfg.group_size,
        "max_turns": cfg.max_turns,
        "seed": task.seed,
        "released_version": version,
    }


def _tasks(settings: KafkaSettings, run: str) -> list[dict[str, Any]]:
    """Every task record released so far, in order per partition."""
    return [d.record for _, d, _ in tap(settings, topics.topic_name(run, "tasks")) if d]


def run_role(ctx: RoleContext) -> int:
    """Release tasks until ``max_tasks`` are released and decided, or stopped; returns how many
    were released in total."""
    from rlstream.consumers.versions import VersionWatcher

    settings, run, cfg, stopper, log = ctx.settings, ctx.run, ctx.cfg, ctx.stopper, ctx.log
    targets = ctx.regions.rollout or (ctx.regions.trainer,)
    ledger = Ledger(targets, int(cfg.reissue_after_s * 1000))
    decisions = DecisionCounter(settings, run)  # read to the end before it returns
    ledger.replay(_tasks(settings, run), decisions.take())
    watcher = VersionWatcher(settings, topics.topic_name(run, "weights.manifests"))
    tasks_topic = topics.topic_name(run, "tasks")
    log(f"scheduler: {ledger.released} tasks released so far; regions {', '.join(targets)}")
    with EventProducer.connect(settings) as producer:
        while not stopper.stopped and not _done(ledger, cfg):
            ledger.decided |= decisions.take()
            now = int(time.time() * 1000)
            for rec in _reissues(ledger, now, log):
                producer.produce(tasks_topic, "task", rec, rec["task_id"])
                ledger.release(rec, now)
            room = releasable(
                ledger.released, len(ledger.decided), cfg.groups_per_step, cfg.max_staleness
            )
            for _ in range(min(room, cfg.max_tasks - ledger.released)):
                region = ledger.place(now)
                if region is None:
                    break  # every target region is dark: wait
                rec = task_record(run, cfg, ledger.released, max(watcher.version, 0))
                rec["tags"] = {**(rec.get("tags") or {}), REGION_TAG: region}
                producer.produce(tasks_topic, "task", rec, rec["task_id"])
                ledger.release(rec, now)
            producer.flush()
            stopper.wait(0.2)
    decisions.close()
    watcher.close()
    return ledger.released


def _done(ledger: Ledger, cfg: SchedulerConfig) -> bool:
    """Every task released and decided: nothing left to release or re-issue."""
    return ledger.released >= cfg.max_tasks and ledger.in_flight() == 0


def _reissues(ledger: Ledger, now_ms: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    out = []
    for rel in ledger.overdue(now_ms):
        rec = ledger.reissue(rel, now_ms)
        if rec is not None:
            log(
                f"scheduler: group {rel.task_id} overdue in {rel.region}; re-issued to "
                f"{rec['tags'][REGION_TAG]} (attempt {rec['attempt']})"
            )
            out.append(rec)
    return out


class DecisionCounter:
    """The group ids decided so far (admitted or rejected): read to the end of both streams at
    construction, then followed in a background thread. ``take`` hands over the ids read since
    the last call."""

    def __init__(self, settings: KafkaSettings, run: str) -> None:
        import threading

        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader

        self._lock = threading.Lock()
        self._new: set[str] = set()
        self._stop = threading.Event()
        self._consumer = reader(settings, f"{run}.sched-decisions")
        parts = []
        for stream in ("admitted", "rejected"):
            name = topics.topic_name(run, stream)
            parts += [
                TopicPartition(name, p, OFFSET_BEGINNING)
                for p in partitions_of(self._consumer, name) or []
            ]
        after = {(tp.topic, tp.partition): OFFSET_BEGINNING for tp in parts}
        for msg in read_to_end(self._consumer, parts):
            self._new.add((msg.key() or b"").decode())
            after[(str(msg.topic()), int(msg.partition() or 0))] = int(msg.offset() or 0) + 1
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in after.items()])
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def take(self) -> set[str]:
        with self._lock:
            new, self._new = self._new, set()
        return new

    def _follow(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            with self._lock:  # a decision split in parts has one key: counted once
                self._new.add((msg.key() or b"").decode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()

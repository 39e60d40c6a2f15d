"""The rollout role: tasks in, one trajectory event per sample out, with the newest weights.

Each member of the ``rlstream.RUN.rollout`` group generates a task's G samples and publishes them
in the transaction that commits the task's offset: a task is rolled out exactly once.

Rules a maintainer must keep:
- a worker talks to its own region's cluster only, takes the tasks meant for its region, and
  keeps generating with the weights it has when cut off from the trainer region;
- with a staleness budget of 0 it waits for the releasing version's weights; above 0 it never
  waits;
- only a complete, verified version is ever swapped in; with ``partial`` swaps each trajectory
  records which tokens each version processed;
- the committed offset never passes a task whose group still waits out its environment time;
- a version the engine refuses is skipped, and the version the engine holds is recorded;
- a ``lent`` worker (tidal capacity) rolls out only while its region lends its capacity slot:
  when the slot is reclaimed the group in progress stops (between two sampling steps on the
  torch engine, between two turns on the others) and is published to ``preempted`` as a
  checkpoint in the transaction that commits its task, so the scheduler releases it again and
  another worker resumes it; then the worker leaves the rollout group until lent again. A task
  that carries a checkpoint is resumed from it, never started over.

Details: docs/roles.md (The rollout worker).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from confluent_kafka import TopicPartition

from rlstream.consumers.capacity_log import CapacityView
from rlstream.consumers.consumer import Record, RoleContext, Stopper
from rlstream.consumers.transactional import Output, Refused, TransactionalLoop
from rlstream.consumers.weights.subscriber import WeightSubscriber
from rlstream.envs.family import environment_for
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.signing import Verifier
from rlstream.rollout.checkpoint import CheckpointError, GroupCheckpoint, Preempted
from rlstream.rollout.config import RolloutConfig
from rlstream.rollout.engines import (
    Engine,
    EngineRefused,
    EngineStats,
    OpenAIEngine,
    TorchEngine,
    VersionGate,
)
from rlstream.rollout.harness import PromptTooLong, Rollout, Sample, tool_details, version_spans
from rlstream.rollout.model import PolicyModel, build_policy, inference_copy
from rlstream.rollout.push_auth import load_token
from rlstream.rollout.reissue import for_region
from rlstream.rollout.vllm_engine import VllmEngine
from rlstream.schemas import arrays, topics
from rlstream.schemas.deltacodec import to_torch
from rlstream.schemas.deltacodec.bits import state_hash
from rlstream.schemas.derive import derive

log = logging.getLogger(__name__)


class RolloutWorker:
    """Processor of one rollout member (in region ``cfg.region`` of ``regions``)."""

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        cfg: RolloutConfig,
        member: str,
        regions: topics.Regions | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.run, self.cfg, self.member = run, cfg, member
        self.worker_id = f"{cfg.region}-{member}"
        self.model = build_policy(cfg.policy)
        self.model.eval()
        self.version = -1
        source = (regions or topics.Regions(cfg.region)).sources("weights.manifests", cfg.region)
        self.subscriber = WeightSubscriber(
            settings, run, cfg.model, source=source[0], verifier=verifier
        )
        self.skipped = 0  # tasks meant for another region
        self.out_topic = topics.topic_name(run, "trajectories")
        self.pauses_ms: list[float] = []
        # ``env_overlap``: groups generated and waiting out their environment time, oldest first,
        # and per partition the offset after the last task read (``offsets``)
        self.waiting: list[Waiting] = []
        self.read_to: dict[tuple[str, int], int] = {}
        self.refused: dict[int, str] = {}  # versions the engine did not take, and why
        self.lease: Lease | None = None  # a lent worker's (tidal capacity): set by run_role
        self.preempted = self.resumed = 0  # groups handed on at a reclaim, and taken over
        self.finishing = False  # a reclaimed group too big to hand on is finished here
        self.preempted_topic = topics.topic_name(run, "preempted")
        # partial swaps: the subscriber's own thread verifies versions during a rollout
        self.follow = cfg.swap == "partial" and cfg.engine != "openai"
        gate = self if self.follow else None
        self.remote = make_engine(cfg, self.model, member, gate)
        self.infer = self.model  # the weights the torch engine generates with
        if self.remote is None and cfg.harness.inference_dtype == "bfloat16":
            self.infer = inference_copy(self.model, torch.bfloat16)
        self.engine: Engine = self.remote or TorchEngine(self.infer, gate=gate, stop=self.reclaimed)
        if self.follow:
            self.subscriber.start(interval=0.2)
        if isinstance(self.remote, VllmEngine):
            self.stats = self.remote.stats  # the engine counts its own swaps
        else:
            self.stats = EngineStats(cfg.engine, torch.__version__ if cfg.engine == "torch" else "")

    def reclaimed(self) -> bool:
        """Whether serving took this worker's capacity back (never, for a dedicated worker)."""
        return self.lease is not None and not self.finishing and not self.lease.active()

    def wait_for_weights(self, stopper: Stopper, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while self.version < 0 and not stopper.stopped and time.monotonic() < deadline:
            self.refresh(1.0)
            self.swap()
        if self.version < 0 and not stopper.stopped:
            raise RuntimeError(f"no weights for model {self.cfg.model} after {timeout:.0f}s")

    def refresh(self, timeout: float) -> None:
        """Let new verified versions in: the subscriber's thread does when it follows, else a
        poll here (waiting up to ``timeout`` for a manifest)."""
        if self.follow:
            time.sleep(min(timeout, 0.2))
        else:
            self.subscriber.poll(timeout)

    def pending(self) -> int | None:
        """The gate (``rollout.engines.VersionGate``): a newer verified version the engine has
        not taken nor refused, or None."""
        current = self.subscriber.latest()
        if current is None or current.version <= self.version or current.version in self.refused:
            return None
        return current.version

    def take(self) -> int:
        """The gate: swap the newest verified version in now (between two model runs of the
        generating thread); the version that generates from here on."""
        self.swap()
        return self.version

    def swap(self) -> None:
        """Swap in the newest complete version, if newer and not refused by the engine (between
        tasks, or between two model runs through the gate)."""
        current = self.subscriber.current()
        if current is None or current[0] <= self.version or current[0] in self.refused:
            return
        version, state = current
        started = time.perf_counter()
        tensors = to_torch(state)
        if self.remote is not None:  # generation starts only once the engine took it
            try:
                self.remote.push(version, tensors, state_hash(state))
            except EngineRefused as exc:
                self.refused = {v: r for v, r in self.refused.items() if v > self.version}
                self.refused[version] = str(exc)
                log.warning("version %d refused by the engine: %s", version, exc)
                return
        else:
            with torch.no_grad():
                self.model.load_state_dict(tensors)
                if self.infer is not self.model:
                    self.infer.load_state_dict(tensors)
        self.version = version
        self.pauses_ms.append((time.perf_counter() - started) * 1000)
        if not isinstance(self.remote, VllmEngine):
            self.stats.swaps += 1  # in process: generation waits for the whole load
            self.stats.swap_s.append(self.pauses_ms[-1] / 1000)
            self.stats.sync_s.append(self.pauses_ms[-1] / 1000)

    def process(self, records: list[Record]) -> list[Output]:
        outputs, fresh = [], []
        for rec in records:
            if not for_region(rec.value, self.cfg.region):
                self.skipped += 1  # another region's task: its offset commits, nothing else
                continue
            self.refresh(0)
            self.swap()
            self.catch_up(int(rec.value.get("released_version") or 0))
            group, ends = self.roll(rec.value, rec)
            if self.cfg.env_overlap:
                fresh.append(Waiting(ends, rec.topic_partition, rec.offset, group))
            else:
                outputs += group
        if not self.cfg.env_overlap:
            return outputs
        # state changes only once the whole batch rolled out (a refused record re-runs it)
        for rec in records:
            self.read_to[rec.topic_partition] = rec.offset + 1
        now = time.time()
        self.waiting += fresh
        ended = [w for w in self.waiting if w.ends <= now]
        self.waiting = [w for w in self.waiting if w.ends > now]
        return [out for w in ended for out in w.outputs]

    def offsets(self, records: list[Record]) -> list[TopicPartition]:
        """``env_overlap``: per partition read, the offset after the last task read, but never
        past a task whose group still waits (``records`` are already in ``read_to``)."""
        return [
            TopicPartition(t, p, o) for (t, p), o in commit_positions(self.read_to, self.waiting)
        ]

    def forget(self) -> None:
        """An aborted transaction (the loop rewinds to the committed offsets): groups still
        waiting are dropped, as their tasks were not committed and are read again."""
        self.waiting.clear()
        self.read_to.clear()

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """A rebalance took ``partitions``: their waiting groups are dropped (their new owner
        reads the tasks again from the committed offsets); the others' go on waiting."""
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self.waiting = [w for w in self.waiting if w.partition not in gone]
        self.read_to = {tp: o for tp, o in self.read_to.items() if tp not in gone}

    def catch_up(self, released_version: int) -> None:
        """Synchronous RL only: wait (at most ``weights_wait_s``) for the weights of the version
        that released the task."""
        if self.cfg.max_staleness > 0:
            return
        deadline = time.monotonic() + self.cfg.weights_wait_s
        while self.version < released_version and time.monotonic() < deadline:
            self.refresh(0.2)
            self.swap()

    def roll(self, task: dict[str, Any], rec: Record | None = None) -> tuple[list[Output], float]:
        """The group of ``task`` as trajectory outputs, and when its environment time ends
        (epoch seconds): waited out here unless ``env_overlap``."""
        queued_ms, started_ms = int(task["created_ms"]), int(time.time() * 1000)
        resume = self._checkpoint_of(task, rec)
        key = f"{self.cfg.seed}/{task['task_id']}"  # stable across processes
        if resume is not None:  # sampling goes on from fresh randomness
            key += f"/{int(task.get('attempt') or 0)}"
            self.resumed += 1
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        seed = zlib.crc32(f"{self.cfg.seed}/{task['task_id']}".encode())
        harness = derive(self.cfg.harness, max_turns=int(task["max_turns"]))
        env = environment_for(task)  # the task family's tools and starting workspace
        if isinstance(self.remote, OpenAIEngine):
            self.remote.served_versions.clear()
        rollout = Rollout(self.model, harness, engine=self.engine, preempt=self.reclaimed)
        try:
            samples = rollout.group(task["prompt"], int(task["group_size"]), gen, env, resume)
        except PromptTooLong as exc:  # a task this policy cannot roll out: dead-lettered
            if rec is None:
                raise
            raise Refused(rec, str(exc)) from exc
        except Preempted as cut:
            handed = self._hand_on(task, cut.checkpoint)
            if handed is not None:
                return [handed], time.time()
            self.finishing = True  # no reclaim stops it again
            try:
                samples = rollout.group(task["prompt"], 0, gen, env, cut.checkpoint)
            finally:
                self.finishing = False
        env_s = env.settle(int(task["group_size"]), seed) if env.settle else 0.0
        ends = time.time() + env_s
        if env_s:
            if not self.cfg.env_overlap:
                time.sleep(env_s)
            for sample in samples:
                sample.timings["tool_s"] = sample.timings.get("tool_s", 0.0) + env_s
        finished_ms = int(ends * 1000)
        self.write_stats()
        version = self.served_version()
        outputs = []
        for sample in samples:
            record = self._trajectory(task, sample, queued_ms, started_ms, finished_ms)
            spans = version_spans(sample.versions, version)
            oldest = spans[0]["version"]
            epoch = self.subscriber.epoch_of(oldest)
            record.update(policy_version=oldest, version_spans=spans, learner_epoch=epoch)
            limit = topics.STREAMS["trajectories"].max_value_bytes
            for part in arrays.split_segments(record, limit):
                outputs.append(Output(self.out_topic, "trajectory", part, task["task_id"]))
        return outputs, ends

    def _checkpoint_of(self, task: dict[str, Any], rec: Record | None) -> GroupCheckpoint | None:
        """The checkpoint a released-again group carries (None: a fresh task); unreadable bytes
        dead-letter the task with the reason."""
        data = task.get("checkpoint")
        if not data:
            return None
        try:
            return GroupCheckpoint.from_bytes(bytes(data))
        except CheckpointError as exc:
            if rec is None:
                raise
            raise Refused(rec, str(exc)) from exc

    def _hand_on(self, task: dict[str, Any], ck: GroupCheckpoint) -> Output | None:
        """The ``preempted`` record of a reclaimed group (None when its checkpoint is too big
        for the stream: the group is then finished here, late, rather than lost)."""
        held = self.served_version()
        for row in ck.rows:  # tokens of an engine that reports no versions: the version held
            row.versions[row.versions < 0] = held
        data = ck.to_bytes()
        if len(data) > topics.STREAMS["preempted"].max_value_bytes:
            log.warning(
                "group %s: checkpoint of %d bytes too big to hand on; finishing it here",
                task["task_id"],
                len(data),
            )
            return None
        self.preempted += 1
        record = {
            "run": self.run,
            "group_id": task["task_id"],
            "attempt": int(task.get("attempt") or 0),
            "region": self.cfg.region,
            "worker_id": self.worker_id,
            "policy_version": held,
            "preempted_ms": int(time.time() * 1000),
            "generated_tokens": ck.generated,
            "checkpoint": data,
        }
        return Output(self.preempted_topic, "preempted", record, task["task_id"])

    def served_version(self) -> int:
        """The version that generated the group just rolled out: this worker's, or the one the
        ``openai`` engine's server reported (it must be one version)."""
        if not isinstance(self.remote, OpenAIEngine) or not self.remote.served_versions:
            return self.version
        seen = set(self.remote.served_versions)
        if len(seen) != 1:
            raise RuntimeError(f"one group was generated by several versions: {sorted(seen)}")
        return seen.pop()

    def write_stats(self) -> None:
        """The engine's figures as ``engine_stats_dir``/REGION-MEMBER.json (when set)."""
        if self.cfg.engine_stats_dir is None:
            return
        figures = {**self.stats.figures(), "worker_id": self.worker_id, "version": self.version}
        if isinstance(self.remote, VllmEngine) and self.remote.server is not None:
            figures["engine_pid"] = self.remote.server.pid
            figures["engine_memory_bytes"] = self.remote.memory_bytes()
        folder = Path(self.cfg.engine_stats_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{self.worker_id}.json.tmp"
        tmp.write_text(json.dumps(figures))
        tmp.replace(folder / f"{self.worker_id}.json")  # readers never see half a file

    def close(self) -> None:
        """Stop the engine (its server, for ``vllm``) and the weight subscriber."""
        self.write_stats()
        if isinstance(self.remote, VllmEngine):
            self.remote.close()
        self.subscriber.close()

    def _trajectory(
        self, task: dict[str, Any], s: Sample, queued_ms: int, started_ms: int, finished_ms: int
    ) -> dict[str, Any]:
        mask = s.loss_mask
        prompt_tokens = int(np.argmax(mask)) if mask.any() else len(mask)
        turns = [
            {
                "index": i,
                "token_start": seg.start,
                "token_end": seg.end,
                "generated_tokens": int(mask[seg.start : seg.end].sum()),
                "summarised": seg.reason == "compacted",
            }
            for i, seg in enumerate(s.segments)
        ]
        summarised = any(t["summarised"] for t in turns)
        gen_ms = int(s.timings.get("generate_s", 0) * 1000)
        env_ms = int(s.timings.get("tool_s", 0) * 1000)
        return {
            "run": self.run,
            "group_id": task["task_id"],
            "task_id": task["task_id"],
            "sample_index": s.index,
            "group_size": int(task["group_size"]),
            "policy_version": self.version,
            "model": self.cfg.model,
            "worker_id": self.worker_id,
            "region": self.cfg.region,
            "engine": self.cfg.engine,
            "temperature": self.cfg.harness.temperature,
            **arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, s.routes),
            "routes_recorded": s.routes.shape[1] > 0,  # the engine reported routes
            "prompt_tokens": prompt_tokens,
            "completion": s.completion,
            "turns": turns,
            "outcome": {
                "status": "completed" if s.finished else "max_tokens",
                "tool_calls": s.turns,
                "tool_errors": s.tool_errors,
                "summarised": summarised,
                "details": tool_details(s),
            },
            "timings": {
                "queued_ms": queued_ms,
                "started_ms": started_ms,
                "finished_ms": finished_ms,
                "generate_ms": gen_ms,
                "env_ms": env_ms,
            },
        }


def make_engine(
    cfg: RolloutConfig, model: PolicyModel, member: str = "0", gate: VersionGate | None = None
) -> OpenAIEngine | VllmEngine | None:
    """The remote engine of ``cfg`` (None for ``torch``: the worker's own model generates)."""
    if cfg.engine == "torch":
        return None
    if cfg.engine == "vllm":
        logs = Path(cfg.vllm.work_dir or tempfile.gettempdir())
        log_path = logs / f"vllm-{cfg.region}-{member}.log"
        return VllmEngine(cfg.vllm, model, cfg.policy, cfg.model, log_path, gate)
    assert cfg.engine_url is not None
    folder = cfg.engine_weights_dir or tempfile.mkdtemp(prefix="rlstream-weights-")
    Path(folder).mkdir(parents=True, exist_ok=True)
    return OpenAIEngine(
        cfg.engine_url,
        cfg.model,
        cfg.policy,
        Path(folder),
        timeout_s=cfg.engine_timeout_s,
        token=load_token(),  # the push token, from a file or the environment (push_auth)
    )


@dataclass(frozen=True)
class Waiting:
    """A group generated and waiting out its environment time (``env_overlap``)."""

    ends: float  # epoch seconds
    partition: tuple[str, int]  # its task's
    offset: int
    outputs: list[Output]


def commit_positions(
    read_to: dict[tuple[str, int], int], waiting: list[Waiting]
) -> list[tuple[tuple[str, int], int]]:
    """Per partition read: the offset after its last task read, or its oldest task whose group
    still waits (not published, so not committed)."""
    out = []
    for tp, after in read_to.items():
        held = [w.offset for w in waiting if w.partition == tp]
        out.append((tp, min([after, *held])))
    return out


def overlap_options(worker: RolloutWorker) -> dict[str, Any]:
    """The loop's options for ``env_overlap``: commit a task with its group only, publish
    groups whose environment time ended on an idle tick too."""
    if not worker.cfg.env_overlap:
        return {}
    return {
        "offsets": worker.offsets,
        "on_abort": worker.forget,
        "on_revoke": worker.revoked,
        "tick_s": 0.05,
        "tick_commits": True,
        "poll_timeout": 0.05,
    }


class Lease:
    """Whether a lent worker's capacity slot is lent now: slot ``slot`` of ``region`` rolls out
    while the region's live capacity signal lends more than ``slot`` engines."""

    def __init__(self, view: CapacityView, region: str, slot: int) -> None:
        self.view, self.region, self.slot = view, region, slot

    def active(self) -> bool:
        return self.slot < self.view.lent(self.region)


class LeaseStopper(Stopper):
    """Stops a lent worker's loop: the role stopped, or its slot was reclaimed and no group of
    its still waits out its environment time (those are published first)."""

    def __init__(self, role: Stopper, worker: RolloutWorker) -> None:
        super().__init__()
        self.role, self.worker = role, worker

    @property
    def stopped(self) -> bool:
        return self.role.stopped or (self.worker.reclaimed() and not self.worker.waiting)

    def wait(self, seconds: float) -> bool:
        return self.role.wait(seconds)


def rollout_loop(ctx: RoleContext[RolloutConfig], worker: RolloutWorker) -> TransactionalLoop:
    """The worker's consume-roll-produce loop as a member of the run's rollout group. A lent
    worker joins without static membership: it leaves the group at once when reclaimed."""
    group = topics.group_id(ctx.run, "rollout")
    region, member = worker.cfg.region, ctx.member
    return TransactionalLoop(
        ctx.settings,
        group_id=group,
        topics=[ctx.pattern("tasks")],
        transactional_id=f"{group}.{region}.{'lent-' if worker.cfg.lent else ''}{member}",
        instance_id=None if worker.cfg.lent else f"rollout-{region}-{member}",
        dlq_topic=topics.topic_name(ctx.run, "dlq"),
        process=worker.process,
        batch_size=1,
        consumer_conf={"max.poll.interval.ms": "600000"},
        **overlap_options(worker),
    )


def lent_loops(ctx: RoleContext[RolloutConfig], worker: RolloutWorker) -> int:
    """A lent worker: wait (keeping its weights fresh) until its slot is lent, roll out until
    it is reclaimed, leave the group, and again, until stopped; returns the tasks read."""
    try:
        slot = int(ctx.member)
    except ValueError:
        raise SystemExit(
            f"error: a lent rollout worker's member is its slot number, not {ctx.member!r}"
        ) from None
    view = CapacityView.for_role(
        ctx.settings, ctx.run, ctx.regions, ctx.region, stale_s=worker.cfg.capacity_stale_s
    )
    worker.lease = Lease(view, worker.cfg.region, slot)
    records, was_lent = 0, False
    try:
        while not ctx.stopper.stopped:
            if not worker.lease.active():
                if was_lent:
                    ctx.log(f"rollout {worker.worker_id}: reclaimed ({worker.preempted} handed on)")
                was_lent = False
                worker.refresh(0.2)  # the newest verified version is ready when lent again
                worker.swap()
                continue
            ctx.log(f"rollout {worker.worker_id}: lent; joining the rollout group")
            was_lent = True
            records += rollout_loop(ctx, worker).run(LeaseStopper(ctx.stopper, worker)).records
    finally:
        view.close()
    return records


def run_role(ctx: RoleContext[RolloutConfig]) -> int:
    """One rollout worker until stopped; returns how many tasks it rolled out."""
    run, member = ctx.run, ctx.member
    cfg = derive(ctx.cfg, region=ctx.region)
    torch.set_num_threads(cfg.torch_threads)
    worker = RolloutWorker(ctx.settings, run, cfg, member, ctx.regions, Verifier.given(ctx.keys))
    try:
        worker.wait_for_weights(ctx.stopper)
        if cfg.lent:
            return lent_loops(ctx, worker)
        return rollout_loop(ctx, worker).run(ctx.stopper).records
    finally:
        worker.close()

"""The learner role: admitted groups in, one policy version per ``groups_per_step`` groups out.

Guarantees a maintainer must keep:
- exactly once: a version's manifest and the offsets of the records that formed it commit in
  ONE Kafka transaction; its chunks are acknowledged before it, outside it;
- reproducible: the manifest records the step's inputs in training order (``rlstream replay``);
- resumable: master weights and optimizer state are checkpointed before each commit;
- epochs: each incarnation publishes under a newer epoch, so readers refuse a fenced one;
- signed: rank 0 signs every manifest with the run's key; a run recorded with another key stops
  the learner before it publishes anything;
- bounded memory: at most ``MAX_WAITING`` waiting groups, a bounded reassembler.

With ``WORLD_SIZE`` > 1 the learner is N FSDP2 ranks (``trainer.distributed``), rank 0 the one
above. The step itself is ``trainer.learner_step``; this module is the Kafka loop around it.
Details: docs/roles.md (The learner).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from confluent_kafka import TopicPartition

from rlstream.consumers.consumer import RoleConsumer, RoleContext, Stopper, make_consumer
from rlstream.consumers.dlq import dead_letter, dead_letter_at
from rlstream.consumers.feedback.rules import online_quota
from rlstream.consumers.weights.manifest_log import manifests_by_version
from rlstream.consumers.weights.trust import ensure_run_key
from rlstream.producers.client.admin import admin_client
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime.metrics import track_buffer
from rlstream.producers.weights.publisher import rank_publisher
from rlstream.producers.weights.run_keys import RunKeys
from rlstream.producers.weights.signing import KEY_FILE, Verifier
from rlstream.schemas import reassembly, topics
from rlstream.schemas.deltacodec.bits import state_hash
from rlstream.schemas.deltacodec.manifest import hash_algorithm
from rlstream.trainer.distributed import RankEnv, Ranks
from rlstream.trainer.grpo import NonFiniteStep
from rlstream.trainer.learner_step import (
    Checkpoints,
    LearnerConfig,
    StepInput,
    init_model,
    published_state,
    reference_policy,
    train_step,
)

Ref = tuple[str, int, int]  # topic, partition, offset of an admitted record
#: Most complete groups waiting for a step (see the module docstring).
MAX_WAITING = 1024
#: Rank 0 tells the other ranks it is alive at least this often while no step is ready.
HEARTBEAT_S = 5.0
#: Tries to commit a version whose transaction aborted before the learner exits (one rank).
PUBLISH_ATTEMPTS = 3


@dataclass
class TrainedLedger:
    """What the published versions of a run already trained, read back from its manifests."""

    last: dict | None = None  # the newest manifest
    trained: set[tuple[str, int, int]] = field(default_factory=set)  # admitted record positions
    rollout_groups: int = 0
    online_groups: int = 0
    epoch: int = 0  # the newest learner epoch among the manifests


def read_ledger(settings: KafkaSettings, run: str, model: str) -> TrainedLedger:
    """Newest manifest, trained inputs and group counts of ``model`` in ``run`` (its manifest log
    read to the end, one manifest per version)."""
    ledger = TrainedLedger()
    for _, rec in sorted(manifests_by_version(settings, run, model).items()):
        ledger.last = rec
        ledger.epoch = max(ledger.epoch, int(rec.get("learner_epoch", 0)))
        ledger.trained |= {(r["topic"], r["partition"], r["offset"]) for r in rec["step_inputs"]}
        online = int(rec["stats"].get("online_groups", 0))
        ledger.online_groups += online
        ledger.rollout_groups += int(rec["stats"].get("groups", 0)) - online
    return ledger


def learner_key(cfg: LearnerConfig, run: str, keys: RunKeys) -> Path:
    """The learner's signing key file: the one it was given (``RunKeys.signing_key``: its
    launcher names it for the learner's process alone), else ``STATE_DIR/RUN/KEY_FILE``."""
    return Path(keys.signing_key) if keys.signing_key else Path(cfg.state_dir) / run / KEY_FILE


def pick_step(
    waiting: list[StepInput],
    b: int,
    quota: Callable[[int], int | None],
    rollout_done: int,
    online_done: int,
) -> list[int] | None:
    """Indices of the next step's ``b`` groups, in arrival order, or None if not enough yet.

    Rule: online (feedback) groups are taken only while the online total stays within
    ``quota(rollout total)``; a deferred online group waits for more rollout groups.
    """
    chosen: list[int] = []
    rollout, online = rollout_done, online_done
    for i, item in enumerate(waiting):
        if item.group.get("source") == "online":
            limit = quota(rollout)
            if limit is not None and online + 1 > limit:
                continue
            online += 1
        else:
            rollout += 1
        chosen.append(i)
        if len(chosen) == b:
            return chosen
    return None


def make_room(waiting: list[StepInput], bound: int, step_ready: bool) -> list[int]:
    """Indices of the waiting groups to dead-letter so that reading can go on: none unless
    the list is full (``bound`` groups) and no step is ready; then the oldest online group.

    Rule: rollout groups are never dropped (a full list with no step ready holds fewer than a
    step's worth of them, so with ``bound`` at least a step it holds an online group)."""
    if len(waiting) < bound or step_ready:
        return []
    online = [i for i, item in enumerate(waiting) if item.group.get("source") == "online"]
    return online[:1]


def commit_offsets(used: list[StepInput], waiting: list[StepInput]) -> list[TopicPartition]:
    """Per partition: one past the last record trained, never past a record still waiting."""
    nxt: dict[tuple[str, int], int] = {}
    for item in used:
        for topic, part, offset in item.refs:
            nxt[(topic, part)] = max(nxt.get((topic, part), 0), offset + 1)
    for item in waiting:
        for topic, part, offset in item.refs:
            if (topic, part) in nxt:
                nxt[(topic, part)] = min(nxt[(topic, part)], offset)
    return [TopicPartition(t, p, o) for (t, p), o in sorted(nxt.items())]


class Learner:
    """One run's learner (one rank of it with ``ranks``): model, optimizer, publisher and, on
    rank 0, the admitted-stream consumer."""

    consumer: RoleConsumer  # rank 0's only

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        cfg: LearnerConfig,
        log: Callable[[str], None] = print,
        ranks: Ranks | None = None,
        keys: RunKeys | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.keys = keys if keys is not None else RunKeys.from_env()
        torch.use_deterministic_algorithms(True)
        self.settings, self.run, self.cfg, self.log = settings, run, cfg, log
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        self.lead = self.ranks is None or self.ranks.rank == 0
        if self.ranks is not None and cfg.groups_per_step < self.ranks.world:
            raise ValueError(
                f"groups_per_step {cfg.groups_per_step} < {self.ranks.world} ranks: "
                "every rank trains at least one group of a step"
            )
        group = self.group = topics.group_id(run, "learner")
        self.dlq_topic = topics.topic_name(run, "dlq")
        self.refused_steps = 0
        signer = None
        if self.lead:  # only rank 0 produces manifests: only it holds the key
            key = learner_key(cfg, run, self.keys)
            signer = ensure_run_key(
                settings, run, key, insecure=cfg.insecure_weights, given=self.keys.verify_hex
            )
        self.publisher = rank_publisher(
            settings, run, cfg.model, f"{group}.0", self.ranks, cfg.keyframe_every, signer,
            fast_apply=cfg.fast_apply_deltas,
        )  # fmt: skip
        self.producer = self.publisher.producer
        self.model, self.optimizer = init_model(cfg, log, warm=self.lead)
        self.reference = reference_policy(cfg, self.model)  # version 0, before any checkpoint
        self.checkpoints = Checkpoints(cfg.state_dir, run)
        self.admin = admin_client(settings)
        self.version = self._resume()
        self._said = time.monotonic()  # when rank 0 last broadcast to the other ranks
        self.parts = reassembly.group_reassembler()
        self.part_refs: dict[str, list[tuple[str, int, int]]] = {}
        self.waiting: list[StepInput] = []
        self.max_waiting = max(MAX_WAITING, cfg.groups_per_step)
        self.history: list[dict[str, float]] = []
        if not self.lead:
            return
        self.consumer = RoleConsumer(
            make_consumer(
                settings,
                group,
                **{"group.instance.id": "learner-0", "max.poll.interval.ms": "600000"},
            ),
            [topics.topic_pattern(run, "admitted")],
            settings=settings,
        )

    def _resume(self) -> int:
        self.ledger = (
            read_ledger(self.settings, self.run, self.cfg.model) if self.lead else TrainedLedger()
        )
        manifest, epoch = self.ledger.last, self.ledger.epoch
        state = self._restore(manifest) if manifest is not None else None
        if self.ranks is not None:  # every rank starts from rank 0's version and weights
            head = None
            if manifest is not None:
                keys = ("version", "keyframe_version", "state_hash", "hash_algorithm")
                head = {k: manifest.get(k) for k in keys}
            manifest, epoch = self.ranks.broadcast((head, epoch) if self.lead else None)
            self.optimizer = self.ranks.adopt(self.model, self.optimizer)
            state = None  # every rank gathers the published state below, together
        self.publisher.epoch = epoch + 1  # this incarnation's
        if manifest is None:
            self._publish(0, [], self._rank_stats({"warm_start": 1.0}))
            self.log("learner: published version 0 (warm start keyframe)")
            return 0
        last = int(manifest["version"])
        self.publisher.resume(
            state if state is not None else published_state(self.model, self.cfg.publish_dtype),
            last,
            keyframe_version=int(manifest["keyframe_version"]),
            state_hash=manifest["state_hash"],
            hash_algorithm=hash_algorithm(manifest),
        )
        self.log(f"learner: resumed at version {last}")
        return last

    def _restore(self, manifest: dict[str, Any]) -> Any:
        """Rank 0: the weights of the ``manifest``'s version from its checkpoint, the warm start
        or the stream; returns the published state when already computed, else None."""
        if not self.lead:
            return None
        last = int(manifest["version"])
        if self.checkpoints.load(last, self.model, self.optimizer):
            return None
        # The model as built (the deterministic warm start) may be the published state
        # exactly (version 0): then its fp32 master is kept, not rebuilt from the bf16.
        state = published_state(self.model, self.cfg.publish_dtype)
        if state_hash(state, hash_algorithm(manifest)) == manifest["state_hash"]:
            self.log(f"learner: version {last} rebuilt from the warm start")
            return state
        self._restore_from_stream(last)
        return None

    def _rank_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """``stats`` with the rank count when there are several (replay needs as many)."""
        return stats if self.ranks is None else {**stats, "ranks": float(self.ranks.world)}

    def _restore_from_stream(self, version: int) -> None:
        """No local checkpoint: take the published weights of ``version`` (optimizer restarts)."""
        from rlstream.consumers.weights.subscriber import WeightSubscriber
        from rlstream.schemas.deltacodec import to_torch

        sub = WeightSubscriber(
            self.settings, self.run, self.cfg.model, verifier=Verifier.given(self.keys)
        )
        while (snapshot := sub.current()) is None or snapshot.version < version:
            sub.poll(1.0)
        state = snapshot.state
        sub.close()
        with torch.no_grad():
            self.model.load_state_dict({k: v.float() for k, v in to_torch(state).items()})
        self.log(f"learner: no checkpoint of version {version}; weights rebuilt from the stream")

    def _publish(
        self,
        version: int,
        used: list[StepInput],
        stats: dict[str, float],
        offsets: list[TopicPartition] | None = None,
    ) -> None:
        state = published_state(self.model, self.cfg.publish_dtype)
        refs = [{"topic": t, "partition": p, "offset": o} for item in used for t, p, o in item.refs]
        # On any failure no manifest of this version became visible (its chunks, if written,
        # are orphans). An aborted transaction (a broker failing over, a hung call whose
        # producer was replaced) is published again in the process, the same state and inputs;
        # anything else, or a third abort, ends the learner, which, restarted, resumes from the
        # last committed version and re-reads these inputs.
        self.publisher.publish_version(
            state,
            version,
            step_inputs=refs,
            stats=stats,
            offsets=offsets or (),
            group_metadata=self.consumer.group_metadata() if offsets else None,
            attempts=PUBLISH_ATTEMPTS,
        )
        if self.ranks is not None:
            self._said = time.monotonic()

    def poll(self) -> None:
        room = self.max_waiting - len(self.waiting)  # a record completes one group at most
        if room <= 0:
            return
        for rec in self.consumer.poll_batch(min(100, room), 0.5):
            if rec.event is None:
                self.log(f"learner: undecodable admitted record dead-lettered: {rec.error}")
                letter = dead_letter(
                    rec.message, rec.reason or "other", rec.error or "", self.group
                )
                self._dead_letter([(letter, rec.message.key())], [rec.position])
                continue
            value, position = rec.value, rec.position
            if position in self.ledger.trained:
                continue  # trained by a published version (re-read after a restart)
            self.part_refs.setdefault(value["group_id"], []).append(position)
            joined = self.parts.add(value)
            if joined is not None:
                self.waiting.append(StepInput(joined, self.part_refs.pop(value["group_id"])))
            for key in self.parts.pop_evicted():
                _, group_id = cast(tuple[str, str], key)  # group_reassembler's (run, group id)
                refs = self.part_refs.pop(group_id, [])
                self._drop([StepInput({}, refs)], "split group evicted before it completed")
        track_buffer("learner.waiting", len(self.waiting), self.max_waiting)
        track_buffer("learner.parts", self.parts.pieces, self.parts.max_pieces)

    def _make_room(self) -> None:
        """Dead-letter what ``make_room`` picks: the list is full and no step can take it."""
        drop = make_room(self.waiting, self.max_waiting, self.ready() is not None)
        if drop:
            dropped = [self.waiting[i] for i in drop]
            self.waiting = [w for i, w in enumerate(self.waiting) if i not in set(drop)]
            self._drop(dropped, f"the waiting list is full ({self.max_waiting} groups)")

    def _drop(self, items: list[StepInput], why: str) -> None:
        refs = [ref for item in items for ref in item.refs]
        if not refs:
            return
        self.log(f"learner: {len(items)} group(s) dead-lettered: {why}")
        letters = [(dead_letter_at(*r, "processing_error", why, self.group), None) for r in refs]
        self._dead_letter(letters, refs)

    def ready(self) -> list[int] | None:
        """The groups of the next step, if enough are waiting (see ``pick_step``)."""
        cfg = self.cfg
        return pick_step(
            self.waiting,
            cfg.groups_per_step,
            lambda rollout: online_quota(rollout, cfg.mix_online_groups, cfg.mix_rollout_groups),
            self.ledger.rollout_groups,
            self.ledger.online_groups,
        )

    def _dead_letter(
        self, letters: Sequence[tuple[dict[str, Any], bytes | None]], refs: list[Ref]
    ) -> None:
        """Write dead letters in a transaction of their own with the offsets past ``refs``
        (never past a group still waiting): they are not read again by this group."""
        offsets = commit_offsets([StepInput({}, refs)], self.waiting)
        with self.producer.transaction() as txn:
            for letter, key in letters:
                self.producer.produce(self.dlq_topic, "dead_letter", letter, key)
            txn.send_offsets(offsets, self.consumer.group_metadata())

    def _refuse(self, used: list[StepInput], why: str) -> None:
        """A step that would make the weights non-finite: its inputs go to dead letters."""
        refs = [ref for item in used for ref in item.refs]
        self.log(f"learner: step refused ({why}); {len(used)} groups dead-lettered")
        error = f"a step on these groups is not finite: {why}"
        letters = [
            (dead_letter_at(*ref, "invalid_record", error, self.group), None) for ref in refs
        ]
        self._dead_letter(letters, refs)
        self.refused_steps += 1

    def step(self, chosen: list[int]) -> dict[str, float] | None:
        """Train on the chosen waiting groups and publish the version; None if refused.
        Rank 0 (the only caller) hands the groups to the other ranks first."""
        used = [self.waiting[i] for i in chosen]
        self.waiting = [w for i, w in enumerate(self.waiting) if i not in set(chosen)]
        if self.ranks is not None:
            self.ranks.broadcast(("step", used))
        return self._step(used)

    def _step(self, used: list[StepInput]) -> dict[str, float] | None:
        """The step on every rank: train (this rank's slice), checkpoint and commit (rank 0),
        publish (every rank its shard)."""
        started = time.perf_counter()
        try:
            stats = train_step(
                self.model, self.optimizer, used, self.cfg, self.ranks, self.reference
            )
        except NonFiniteStep as exc:
            if self.lead:
                self._refuse(used, str(exc))
            return None
        online = sum(item.group.get("source") == "online" for item in used)
        stats["online_groups"] = float(online)
        stats = self._rank_stats(stats)
        self.ledger.online_groups += online
        self.ledger.rollout_groups += len(used) - online
        self.version += 1
        if self.version % self.cfg.checkpoint_every == 0:
            self.checkpoints.save(self.version, self.model, self.optimizer, write=self.lead)
        stats["step_s"] = time.perf_counter() - started
        offsets = commit_offsets(used, self.waiting) if self.lead else None
        self._publish(self.version, used, stats, offsets)
        self.ledger.trained |= {ref for item in used for ref in item.refs}
        stats["publish_s"] = time.perf_counter() - started - stats["step_s"]
        if self.lead and self.version % self.cfg.keyframe_every == 0:
            # A new keyframe landed: chunks no worker can still need are deleted (after the
            # commit: a broker failing over now delays the deletion, never the run).
            self.publisher.prune(self.admin, best_effort=True)
        self.history.append({"version": float(self.version), **stats})
        return stats

    def run_until(self, stopper: Stopper) -> int:
        """Rank 0's loop: read, step, publish until stopped or ``max_versions``; then the other
        ranks are told to stop."""
        while not stopper.stopped and self.version < self.cfg.max_versions:
            self.poll()
            while self.version < self.cfg.max_versions and (chosen := self.ready()) is not None:
                s = self.step(chosen)
                if s is None:
                    continue
                self.log(
                    f"learner: v{self.version} success {s['success_rate']:.2f} reward "
                    f"{s['reward_mean']:.2f} staleness {s['staleness_mean']:.1f} "
                    f"step {s['step_s']:.2f}s publish {s['publish_s']:.2f}s"
                )
            self._make_room()
            if self.ranks is not None and time.monotonic() - self._said > HEARTBEAT_S:
                self.ranks.broadcast(("idle",))
                self._said = time.monotonic()
        if self.ranks is not None:
            self.ranks.broadcast(("stop",))
        return self.version

    def follow(self) -> int:
        """A rank other than 0: the steps rank 0 hands over, until it says stop."""
        assert self.ranks is not None and not self.lead
        while True:
            order = self.ranks.broadcast()
            if order[0] == "stop":
                return self.version
            if order[0] == "step":
                self._step(order[1])

    def close(self) -> None:
        if self.lead:
            self.consumer.close()
        self.producer.wait(10)
        self.publisher.close(10)


def run_role(ctx: RoleContext[LearnerConfig]) -> int:
    """The learner (one rank of it, when the environment names ranks: ``trainer.distributed``)
    until stopped or ``max_versions``; returns the last published version."""
    env = RankEnv.from_env()
    if env is None and ctx.cfg.ranks > 1:
        raise SystemExit("learner.ranks > 1 needs the ranks' environment (WORLD_SIZE, ...)")
    ranks = Ranks(env) if env is not None and env.world > 1 else None
    learner = Learner(ctx.settings, ctx.run, ctx.cfg, ctx.log, ranks, ctx.keys)
    try:
        version = learner.run_until(ctx.stopper) if learner.lead else learner.follow()
    finally:
        learner.close()
    if ranks is not None:
        ranks.close()
    return version

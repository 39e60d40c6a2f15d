"""The admission role: join each group's trajectories with its rewards; admit or reject it.

Rules a maintainer must keep:
- exactly once without a state store: decisions, dead letters and consumer offsets commit in one
  transaction, and each input partition's committed offset is its *low watermark* (the first
  record of the oldest pending group), so a re-read rebuilds every pending group; decided
  groups are recognised on re-read from the co-partitioned admitted and rejected streams;
- a group may arrive in several regions' copies: copies are never mixed, and the group is
  decided once, whichever copy decides it first; what arrives later is ignored;
- only records of a task released to their copy's region join a group; any other record is
  dead-lettered (``invalid_record``), never a rejected decision;
- memory is bounded (``max_decided``, bounded reassemblers).

The rules themselves are in ``admission_rules``.
Details: docs/roles.md (Admission).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from rlstream.consumers.admission_rules import (
    AdmissionConfig,
    AdmissionVerdict,
    DecidedSet,
    PendingGroup,
    admitted_samples,
    behaviour_span,
    decide,
    release_refusal,
    surplus,
)
from rlstream.consumers.consumer import Record, RoleContext
from rlstream.consumers.read_to_end import read_to_end, reader
from rlstream.consumers.releases import TaskReleases
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.consumers.weights.versions import VersionWatcher
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime.metrics import track_buffer
from rlstream.producers.weights.signing import Verifier
from rlstream.schemas import arrays, events, reassembly, topics
from rlstream.schemas.reassembly import Reassembler

Copy = tuple[str, str]  # (group id, the region that rolled this copy out)


class Admission:
    """State and processing of one admission member (see the module docstring)."""

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        cfg: AdmissionConfig,
        member: str = "0",
        *,
        region: str = "trainer",
        regions: topics.Regions | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.settings, self.run, self.cfg = settings, run, cfg
        self.region, self.regions = region, regions or topics.Regions(region)
        self.names = topics.run_topics(run)
        self.pending: dict[Copy, PendingGroup] = {}
        self.first_offset: dict[Copy, dict[tuple[str, int], int]] = {}  # copy -> tp -> offset
        self.decided = DecidedSet(cfg.max_decided)  # committed decisions (the newest)
        self._staged: set[str] = set()  # decisions of the open transaction
        self.admits: Counter[int] = Counter()  # learner version -> groups admitted (committed)
        self._staged_admits: Counter[int] = Counter()  # the same, of the open transaction
        self.loaded: set[int] = set()
        self.segments: dict[str, Reassembler] = {}  # per copy: segments are never mixed
        self.counts = {"admitted": 0, "rejected": 0, "dropped_copies": 0, "unreleased": 0}
        self.watcher = VersionWatcher(settings, self.names["weights.manifests"], verifier=verifier)
        self.releases = TaskReleases(settings, run, cfg.max_decided)
        self.loop = TransactionalLoop(
            settings,
            group_id=topics.group_id(run, "admission"),
            topics=[
                self.regions.pattern(run, "trajectories", region),
                self.regions.pattern(run, "rewards", region),
            ],
            transactional_id=f"{topics.group_id(run, 'admission')}.{member}",
            instance_id=f"admission-{member}",
            dlq_topic=self.names["dlq"],
            process=self.process,
            offsets=self.offsets,
            tick_s=1.0,
            on_assign=self._assigned,
            on_revoke=self._revoked,
            on_abort=self._reset,
            on_commit=self._settle,
            # Eager rebalancing: every rebalance revokes all partitions and resumes them from the
            # committed low watermarks, so pending state is always rebuilt whole.
            consumer_conf={"partition.assignment.strategy": "range"},
        )

    # --- processing -------------------------------------------------------------------------

    def process(self, records: list[Record]) -> list[Output]:
        touched, outputs = set(), []
        for rec in records:
            why = self._unreleased(rec)
            if why is not None:
                self.counts["unreleased"] += 1
                outputs.append(self.loop.dead_letter(rec, "invalid_record", why))
                continue
            key = self._add(rec)
            if key:
                touched.add(key)
        # On an idle tick every pending copy is re-checked (deadlines, staleness).
        candidates = touched if records else set(self.pending)
        now_ms, version = int(time.time() * 1000), self.watcher.version
        for key in sorted(candidates):
            group = self.pending.get(key)
            verdict = decide(group, now_ms, version, self.cfg) if group else None
            if group is None or verdict is None:
                continue
            verdict = surplus(verdict, self._admitted_at(version), version, self.cfg)
            if not verdict.admitted and self._others_pending(key):
                self._forget(key)  # another copy of the group may still be admitted
                self.counts["dropped_copies"] += 1
                continue
            outputs += self._decision(group, verdict, version, now_ms, key[1])
        return outputs

    def copy_of(self, rec: Record) -> str:
        """The region that rolled out the group copy ``rec`` belongs to (module docstring)."""
        topic = rec.topic_partition[0]
        value = rec.value or {}
        try:
            if (
                rec.event
                and rec.event.event == "reward"
                and topics.parse_topic(topic).region is None
            ):
                topic = value["trajectory"]["topic"]  # judged here: the copy it scored
            return self.regions.origin(topic, self.region)
        except (ValueError, KeyError, TypeError):
            return topic  # not a topic of the run's regions: a copy of its own

    def _unreleased(self, rec: Record) -> str | None:
        """Why ``rec`` is refused as not released to its copy's region (module docstring)."""
        value = rec.value
        # checked even when the group is decided: a forged copy arriving after the genuine one
        # is reported (dead-lettered), not silently dropped with the late copies
        region = self.copy_of(rec)
        released = self.releases.released_to(str(value["task_id"]), region)
        return release_refusal(value["group_id"], value["task_id"], region, released)

    def _add(self, rec: Record) -> Copy | None:
        value: dict[str, Any] | None = rec.value
        assert value is not None
        group_id = value["group_id"]
        if group_id in self.decided or group_id in self._staged:
            return None
        copy = self.copy_of(rec)
        if rec.event and rec.event.event == "trajectory":
            value = self.segments.setdefault(copy, reassembly.trajectory_reassembler()).add(value)
            if value is None:
                return None  # more segments to come
        key = (group_id, copy)
        group = self.pending.get(key)
        if group is None:
            group = self.pending[key] = PendingGroup(
                group_id,
                value["task_id"],
                int(value.get("group_size") or 0),
                int(time.time() * 1000),
            )
        tp, offset = rec.topic_partition, rec.offset
        firsts = self.first_offset.setdefault(key, {})
        firsts[tp] = min(firsts.get(tp, offset), offset)
        ref = {"topic": tp[0], "partition": tp[1], "offset": offset}
        if rec.event and rec.event.event == "trajectory":
            group.group_size = int(value["group_size"])
            group.add_sample({**value, "_ref": ref})
        else:
            group.add_reward({**value, "_ref": ref})
        group.refs.append(ref)
        return key

    def _others_pending(self, key: Copy) -> bool:
        return any(k[0] == key[0] and k != key for k in self.pending)

    def _forget(self, key: Copy) -> None:
        self.pending.pop(key, None)
        self.first_offset.pop(key, None)

    def _decision(
        self, group: PendingGroup, verdict: AdmissionVerdict, version: int, now_ms: int, copy: str
    ) -> list[Output]:
        spans = [behaviour_span(s) for s in group.samples.values()] or [(version, version)]
        record = {
            "run": self.run,
            "group_id": group.group_id,
            "task_id": group.task_id,
            "decision": "admitted" if verdict.admitted else "rejected",
            "reason": verdict.reason,
            "detail": verdict.detail or None,
            "source": "rollout",
            "learner_version": max(version, 0),
            "min_behaviour_version": min(old for old, _ in spans),
            "max_behaviour_version": max(new for _, new in spans),
            "staleness": verdict.staleness,
            "decided_ms": now_ms,
            "group_size": group.group_size,
            "task_class": None,
            "samples": admitted_samples(group, self.cfg) if verdict.admitted else [],
            "inputs": group.refs,
            "task_ref": self.releases.release_ref(group.task_id, copy),
        }
        stream = "admitted" if verdict.admitted else "rejected"
        self.counts[stream] += 1
        if verdict.admitted:
            self._staged_admits[max(version, 0)] += 1
        self._staged.add(group.group_id)  # decided once its transaction commits (``_settle``)
        for key in [k for k in self.pending if k[0] == group.group_id]:
            self._forget(key)  # every copy: the group is decided once
        parts = arrays.split_group(record, topics.STREAMS[stream].max_value_bytes)
        return [Output(self.names[stream], "admission", p, group.group_id) for p in parts]

    def offsets(self, records: list[Record]) -> list[TopicPartition]:
        """Per input partition: one past the batch, but never past a pending group's first record."""
        nxt: dict[tuple[str, int], int] = {}
        for rec in records:
            tp = rec.topic_partition
            nxt[tp] = max(nxt.get(tp, 0), rec.offset + 1)
        for firsts in self.first_offset.values():
            for tp, offset in firsts.items():
                if tp in nxt:
                    nxt[tp] = min(nxt[tp], offset)
        return [TopicPartition(t, p, o) for (t, p), o in nxt.items()]

    # --- rebalance and recovery ----------------------------------------------------------

    def _admitted_at(self, version: int) -> int:
        """Groups admitted at learner ``version``, committed or in the open transaction."""
        version = max(version, 0)
        return self.admits[version] + self._staged_admits[version]

    def _assigned(self, partitions: list[TopicPartition]) -> None:
        new = {tp.partition for tp in partitions} - self.loaded
        if new:
            count = self.cfg.max_groups_per_version > 0  # only the cap needs the versions
            decided, admits = decided_groups(self.settings, self.run, new, count_versions=count)
            self.decided |= decided
            self.admits += admits
            self.loaded |= new

    def _revoked(self, partitions: list[TopicPartition]) -> None:
        self._reset()

    def _settle(self) -> None:
        """The transaction committed: its decisions are final."""
        self.decided |= self._staged
        self._staged.clear()
        self.admits += self._staged_admits
        self._staged_admits.clear()
        self._report()

    def _report(self) -> None:
        track_buffer("admission.decided", len(self.decided), self.decided.bound)
        pieces = sum(r.pieces for r in self.segments.values())
        track_buffer(
            "admission.segments", pieces, reassembly.MAX_PENDING_PIECES * len(self.segments)
        )

    def _reset(self) -> None:
        """Forget pending state and the aborted transaction's decisions: both are rebuilt by
        re-reading from the committed offsets."""
        self._staged.clear()
        self._staged_admits.clear()
        self.pending.clear()
        self.first_offset.clear()
        self.segments.clear()

    def close(self) -> None:
        self.watcher.close()
        self.releases.close()


def decided_groups(
    settings: KafkaSettings, run: str, partitions: set[int], *, count_versions: bool = False
) -> tuple[set[str], Counter[int]]:
    """Group ids already in the admitted or rejected stream, in the given partitions, and (with
    ``count_versions``) the admitted ones counted by the learner version they were admitted at."""
    admitted = topics.topic_name(run, "admitted")
    names = [admitted, topics.topic_name(run, "rejected")]
    consumer = reader(settings, "admission-restore")
    decided: set[str] = set()
    at: dict[str, int] = {}
    try:
        starts = [TopicPartition(t, p, OFFSET_BEGINNING) for t in names for p in partitions]
        for msg in read_to_end(consumer, starts):
            group_id = (msg.key() or b"").decode()
            decided.add(group_id)
            if count_versions and msg.topic() == admitted and group_id not in at:
                at[group_id] = _learner_version(msg.value())
    finally:
        consumer.close()
    return decided, Counter(v for v in at.values() if v >= 0)


def _learner_version(value: bytes | None) -> int:
    """The learner version of an admitted record (-1 if it cannot be read)."""
    try:
        return int(events.decode(value or b"", expect="admission").record["learner_version"])
    except (events.DecodeError, KeyError, TypeError, ValueError):
        return -1


def run_role(ctx: RoleContext[AdmissionConfig]) -> dict[str, int]:
    """The admission role until stopped; returns its decision counts."""
    admission = Admission(
        ctx.settings,
        ctx.run,
        ctx.cfg,
        ctx.member,
        region=ctx.region,
        regions=ctx.regions,
        verifier=Verifier.given(ctx.keys),
    )
    try:
        admission.loop.run(ctx.stopper)
    finally:
        admission.close()
    return dict(admission.counts)

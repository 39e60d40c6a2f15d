"""Weight publication: every policy version as chunks plus a manifest.

``WeightPublisher.publish_version`` encodes the state with the delta codec, writes every chunk
with an idempotent, non-transactional producer and waits for the broker's acknowledgements, then
commits the manifest and the consumer offsets in one short transaction. So a version's size is
not bound by a transaction's timeout, and a manifest never points at missing data.

The rule a maintainer must keep: **a chunk that no committed manifest names is never applied**
(the orphans of aborted, crashed or fenced publishes are readable, never applied, and go with
retention). The rules are pure functions in ``producers.weights.rules`` (sharded:
``producers.weights.shards``); the records belong to ``schemas.deltacodec.wire``.

numpy and Kafka only: importing this module never loads torch.
Details: docs/weight-sync.md (Publishing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from rlstream.producers.client.producer import DeliveryError, EventProducer, TransactionAborted
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights import retention
from rlstream.producers.weights.chunks import write_chunks
from rlstream.producers.weights.rules import chunk_partitions, keyframe_of, publish_kinds
from rlstream.producers.weights.shards import (
    PublishingRanks,
    ShardLayout,
    merge_shards,
    shard_names,
    shard_part,
)
from rlstream.producers.weights.signing import Signer
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics
from rlstream.schemas.deltacodec.wire import Ref, chunk_record, manifest_record

log = logging.getLogger(__name__)

#: Largest chunk payload the publisher asks the codec for (the topic catalog's limit).
MAX_CHUNK_BYTES: Final = topics.CHUNK_PAYLOAD_BYTES
DEFAULT_KEYFRAME_EVERY: Final = 8

State = Mapping[str, codec.TensorBits]

# --- the publisher ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Published:
    """What the next delta is computed against (``state``: this rank's shard when sharded)."""

    version: int
    state: State
    keyframe_version: int | None
    state_hash: str | None = None  # the whole state's (sharded publishers only)


@dataclass(frozen=True)
class _Staged:
    """A version whose chunks are written and acknowledged, and its manifests, not produced."""

    version: int
    state: State
    kinds: tuple[str, ...]
    encoded: list[codec.Encoded]
    records: list[dict[str, Any]]
    keyframe_version: int
    started: float  # perf_counter when the publish began
    encode_s: float


@dataclass(frozen=True)
class PublishStats:
    """Figures of the last ``publish``: encode time, produce time, chunk bytes, per kind."""

    version: int
    kinds: tuple[str, ...]
    encode_s: float
    produce_s: float
    encoded_bytes: dict[str, int]
    raw_bytes: int
    changed: int  # elements whose bits changed against the previous version (all: no base)

    @classmethod
    def of(
        cls,
        version: int,
        kinds: tuple[str, ...],
        encoded: Sequence[codec.Encoded],
        encode_s: float,
        produce_s: float,
    ) -> PublishStats:
        first = encoded[0].manifest
        return cls(
            version,
            kinds,
            encode_s,
            produce_s,
            {k: e.manifest["encoded_bytes"] for k, e in zip(kinds, encoded, strict=True)},
            first["raw_bytes"],
            sum(t["changed"] for t in first["tensors"]),
        )


class WeightPublisher:
    """Publishes policy versions of one model as chunks + manifest (see the module docstring).

    ``producer`` must wrap a transactional producer whose ``init_transactions`` has been called;
    it writes the manifests. ``chunk_producer`` writes the chunks (None: a non-transactional
    producer made from ``producer``'s settings, ``EventProducer.non_transactional``).
    Not thread-safe: one learner thread publishes."""

    def __init__(
        self,
        producer: EventProducer,
        run: str,
        model: str,
        *,
        chunk_topic: str | None = None,
        manifest_topic: str | None = None,
        keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        flush_timeout: float = 120.0,
        signer: Signer | None = None,
        epoch: int = 0,
        chunk_producer: EventProducer | None = None,
        ranks: PublishingRanks | None = None,
        hash_algorithm: str = codec.DEFAULT_HASH,
        fast_apply: bool = False,
    ) -> None:
        publish_kinds(0, keyframe_every, False)  # validates keyframe_every
        self.producer, self.run, self.model = producer, run, model
        self.chunk_producer = chunk_producer or producer.non_transactional()
        self.chunk_topic = chunk_topic or topics.topic_name(run, "weights.chunks")
        self.manifest_topic = manifest_topic or topics.topic_name(run, "weights.manifests")
        self.keyframe_every, self.max_chunk_bytes = keyframe_every, max_chunk_bytes
        self.flush_timeout, self.fast_apply = flush_timeout, fast_apply  # codec.encode_delta
        self.signer = signer  # the run's key (``weights.signing``); None: unsigned, refused by
        # the readers of a run not created insecure
        self.hash_algorithm = hash_algorithm  # another than blake3 only to write as old code did
        self.epoch = epoch  # the learner's incarnation, written into every manifest
        # Sharded over several ranks (None or one rank: this publisher encodes everything).
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        self.history: list[dict[str, Any]] = []  # manifests without tensors, for ``prune``
        self.last_stats: PublishStats | None = None
        self._last: _Published | None = None
        self._floor = -1  # versions at or below it were published (or resumed from)
        self._undo: tuple[_Published | None, int] | None = None  # what rollback restores
        self._next_partition = 0  # where the next publish's first chunk goes
        self._chunk_partitions: int | None = None  # the chunk topic's, read once
        self._serialize_chunk = events.serializer("weight_chunk", self.chunk_producer.store)
        self._serialize_manifest = events.serializer("weight_manifest", producer.store)
        self._manifest_limit = topics.STREAMS["weights.manifests"].max_value_bytes

    @property
    def version(self) -> int | None:
        """The last published version (None before the first publish or resume)."""
        return None if self._last is None else self._last.version

    def resume(
        self,
        state: State | None,
        version: int,
        *,
        keyframe_version: int | None = None,
        state_hash: str | None = None,
        hash_algorithm: str = codec.DEFAULT_HASH,
    ) -> None:
        """Re-seed a restarted learner with the last published version.

        With ``state`` the next version is a delta against it (pass ``state_hash`` from the last
        manifest, of its ``hash_algorithm``, to have the state checked first); without ``state``
        the next version is a keyframe only, and without ``keyframe_version`` it is a keyframe
        as well as a delta."""
        checked = state is not None and state_hash is not None
        if checked and codec.state_hash(state, hash_algorithm) != state_hash:  # type: ignore[arg-type]
            raise ValueError(f"state does not hash to the manifest of version {version}")
        self._undo = None
        if state is None:
            self._last = None
        elif self.ranks is not None:
            same = state_hash is not None and hash_algorithm == self.hash_algorithm
            whole = state_hash if same else codec.state_hash(state, self.hash_algorithm)
            self._last = _Published(version, self._shard(state)[0], keyframe_version, whole)
        else:
            self._last = _Published(version, state, keyframe_version)
        self._floor = version

    def publish(
        self,
        state: State,
        version: int,
        *,
        step_inputs: Sequence[Mapping[str, Any]] = (),
        stats: Mapping[str, float] | None = None,
        force_keyframe: bool = False,
    ) -> dict[str, Any]:
        """Publish ``version`` with its manifest inside the caller's open transaction; returns
        its manifest record (the keyframe's when the version has both). The chunks are written
        and acknowledged at once, outside any transaction: if the caller's transaction aborts,
        they are orphans no reader applies; call ``rollback`` then. The caller must not mutate
        ``state`` afterwards: it is the next delta's base."""
        if self.ranks is not None:
            raise ValueError("a sharded publisher publishes with publish_version only")
        staged = self._stage(state, version, step_inputs, stats, force_keyframe)
        return self._finish(staged)

    def _stage(
        self,
        state: State,
        version: int,
        step_inputs: Sequence[Mapping[str, Any]],
        stats: Mapping[str, float] | None,
        force_keyframe: bool,
    ) -> _Staged:
        """Encode ``version``, write its chunks and wait for them; its manifests, unproduced."""
        last = self._last
        if version <= self._floor:
            raise ValueError(f"version {version} is not after the last published {self._floor}")
        unknown_keyframe = last is not None and last.keyframe_version is None
        force = force_keyframe or unknown_keyframe
        kinds = publish_kinds(version, self.keyframe_every, last is not None, force)
        if self.ranks is not None:
            return self._stage_shard(state, version, kinds, step_inputs, stats)
        t0 = time.perf_counter()
        encoded = [self._encode(kind, state, version) for kind in kinds]
        encode_s = time.perf_counter() - t0
        created_ms = int(time.time() * 1000)  # before the chunks: readers scan from this time
        refs = self._produce_chunks(version, kinds, encoded)
        keyframe_version = keyframe_of(version, kinds, last.keyframe_version if last else None)
        records = self._manifest_records(
            [e.manifest for e in encoded],
            [refs[k] for k in kinds],
            list(state),
            keyframe_version,
            created_ms,
            step_inputs,
            stats,
        )
        return _Staged(version, state, kinds, encoded, records, keyframe_version, t0, encode_s)

    def _manifest_records(
        self,
        manifests: Sequence[Mapping[str, Any]],
        refs: Sequence[Mapping[int, Ref]],
        order: list[str],
        keyframe_version: int,
        created_ms: int,
        step_inputs: Sequence[Mapping[str, Any]],
        stats: Mapping[str, float] | None,
    ) -> list[dict[str, Any]]:
        """The manifest records of one version's codec manifests (one per kind), each with
        its chunks' refs."""
        return [
            manifest_record(
                m,
                run=self.run,
                model=self.model,
                chunk_topic=self.chunk_topic,
                keyframe_version=keyframe_version,
                created_ms=created_ms,
                order=order,
                refs=r,
                step_inputs=step_inputs,
                stats=stats,
                learner_epoch=self.epoch,
            )
            for m, r in zip(manifests, refs, strict=True)
        ]

    def _stage_shard(
        self,
        state: State,
        version: int,
        kinds: tuple[str, ...],
        step_inputs: Sequence[Mapping[str, Any]],
        stats: Mapping[str, float] | None,
    ) -> _Staged:
        """``_stage`` of one rank of several: encode this rank's shard, write its chunks at
        their places among every rank's, wait for them, then gather every rank's refs and
        build the version's manifests (the same on every rank; rank 0 produces them)."""
        assert self.ranks is not None
        last, ranks = self._last, self.ranks
        t0 = time.perf_counter()
        shard, first = self._shard(state)
        encoded = [self._encode(kind, shard, version) for kind in kinds]
        encode_s = time.perf_counter() - t0
        created_ms = int(time.time() * 1000)
        counts = ranks.all_gather([len(e.chunks) for e in encoded])
        totals = [sum(c[k] for c in counts) for k in range(len(kinds))]
        parts, error = [], None
        try:
            start = self._next_partition
            for k, enc in enumerate(encoded):
                layout = ShardLayout.of([c[k] for c in counts], ranks.rank)
                part = shard_part(enc, first, layout)
                part["refs"] = self._produce_shard(version, enc.manifest, part, start, layout)
                del part["payloads"]
                parts.append(part)
                start += totals[k]
        except Exception as exc:  # every rank must hear of it: no rank waits on a dead version
            error = f"rank {ranks.rank}: {exc}"
        self._next_partition = (self._next_partition + sum(totals)) % self._partitions()
        gathered = ranks.all_gather({"parts": parts, "error": error})
        failed = [g["error"] for g in gathered if g["error"]]
        if failed:
            raise DeliveryError(f"weight chunks of version {version} not written: {failed[0]}")
        base_hash = last.state_hash if last is not None else None
        merged = [
            merge_shards(enc.manifest, [g["parts"][k] for g in gathered], base_hash)
            for k, enc in enumerate(encoded)
        ]
        keyframe_version = keyframe_of(version, kinds, last.keyframe_version if last else None)
        refs = [
            {i: tuple(r) for g in gathered for i, r in g["parts"][k]["refs"].items()}
            for k in range(len(kinds))
        ]
        records = self._manifest_records(
            merged, refs, list(state), keyframe_version, created_ms, step_inputs, stats
        )
        whole = [codec.Encoded(m, []) for m in merged]
        return _Staged(version, shard, kinds, whole, records, keyframe_version, t0, encode_s)

    def _produce_shard(
        self,
        version: int,
        manifest: Mapping[str, Any],
        part: Mapping[str, Any],
        start: int,
        layout: ShardLayout,
    ) -> dict[int, Ref]:
        """Write this rank's chunks of one kind (``shard_part``), chunk ``i`` of the version at
        partition ``(start + i) % partitions``, and wait for them; their refs by index."""
        where = chunk_partitions(start, layout.total, self._partitions())
        items = []
        for local, (entry, payload) in enumerate(
            zip(part["chunks"], part["payloads"], strict=True)
        ):
            index = entry["index"]
            rec = {
                **chunk_record(manifest, local, payload, run=self.run, model=self.model),
                "index": index,
                "count": layout.total,
                "checksum": entry["checksum"],
            }
            items.append((index, rec, where[index]))
        return self._write_chunks(version, items)

    def _finish(self, staged: _Staged, produce: bool = True) -> dict[str, Any]:
        """Produce the manifests of ``staged`` (in the open transaction; not with ``produce``
        False: a rank other than 0 of a sharded publisher) and take the version as the next
        delta's base."""
        for rec in staged.records if produce else ():
            self._produce_manifest(rec)
        self._undo = (self._last, self._floor)
        self._last = _Published(
            staged.version,
            staged.state,
            staged.keyframe_version,
            staged.records[-1]["state_hash"] if self.ranks is not None else None,
        )
        self._floor = staged.version
        self.history += [{k: v for k, v in r.items() if k != "tensors"} for r in staged.records]
        produce_s = time.perf_counter() - staged.started - staged.encode_s
        self.last_stats = PublishStats.of(
            staged.version, staged.kinds, staged.encoded, staged.encode_s, produce_s
        )
        return staged.records[-1]

    def rollback(self) -> None:
        """Forget the last ``publish`` (its transaction was aborted): the next delta is computed
        against the version before it again."""
        if self._undo is None or self._last is None:
            return  # nothing published since the last resume or rollback
        dropped = self._last.version
        self.history = [m for m in self.history if m["version"] != dropped]
        (self._last, self._floor), self._undo = self._undo, None

    def publish_version(
        self,
        state: State,
        version: int,
        *,
        step_inputs: Sequence[Mapping[str, Any]] = (),
        stats: Mapping[str, float] | None = None,
        force_keyframe: bool = False,
        offsets: Sequence[TopicPartition] = (),
        group_metadata: object | None = None,
        timeout: float = 60.0,
        attempts: int = 1,
    ) -> dict[str, Any]:
        """Write the chunks of ``version`` (as long as they take, no transaction open), then
        commit its manifest in a transaction of its own with the consumer ``offsets`` (of the
        group ``group_metadata`` names) that formed the version, if any. ``timeout`` bounds each
        call of that transaction. On any failure the transaction is aborted, the publish rolled
        back (its chunks, if written, are orphans), and the error raised; an aborted transaction
        (``TransactionAborted``: e.g. a hung call that replaced the producer) is tried again, the
        whole publish, up to ``attempts`` times in all, when this publisher is the only rank."""
        for attempt in range(1, attempts + 1):
            try:
                return self._publish_version(
                    state, version, step_inputs, stats, force_keyframe, offsets, group_metadata,
                    timeout,
                )  # fmt: skip
            except TransactionAborted as exc:
                if self.ranks is not None or attempt == attempts:
                    raise
                log.warning(
                    "version %d not committed (%s): publishing it again (%d of %d)",
                    version, exc, attempt + 1, attempts,
                )  # fmt: skip
        raise AssertionError("unreachable: the last attempt returned or raised")

    def _publish_version(
        self,
        state: State,
        version: int,
        step_inputs: Sequence[Mapping[str, Any]],
        stats: Mapping[str, float] | None,
        force_keyframe: bool,
        offsets: Sequence[TopicPartition],
        group_metadata: object | None,
        timeout: float,
    ) -> dict[str, Any]:
        staged = self._stage(state, version, step_inputs, stats, force_keyframe)
        if self.ranks is not None and self.ranks.rank > 0:
            return self._await_commit(staged)
        try:
            with self.producer.transaction(timeout) as txn:
                rec = self._finish(staged)
                txn.send_offsets(offsets, group_metadata)
        except BaseException:
            if self._last is not None and self._last.version == version:
                self.rollback()
            if self.ranks is not None:
                self.ranks.all_gather(False)  # the other ranks learn the version is not
            raise
        if self.ranks is not None:
            self.ranks.all_gather(True)
        return rec

    def _await_commit(self, staged: _Staged) -> dict[str, Any]:
        """A rank other than 0: wait for rank 0's commit of ``staged``; take it as published if
        it committed, else raise."""
        assert self.ranks is not None
        if not self.ranks.all_gather(None)[0]:
            raise DeliveryError(f"version {staged.version} was not committed by rank 0")
        return self._finish(staged, produce=False)

    def prune(
        self, admin: AdminClient, keep_keyframes: int = 2, *, best_effort: bool = False
    ) -> dict[tuple[str, int], int]:
        """``retention.prune`` over the manifests this publisher wrote; forgets the ones
        pruned. With ``best_effort``, a Kafka error (a broker failing over while the records
        are deleted) is logged, nothing is forgotten and ``{}`` returned: the next call
        deletes the same records and more. A learner prunes after its version is committed,
        so the deletion is housekeeping that can wait for the next keyframe."""
        try:
            out = retention.prune(admin, self.history, keep_keyframes=keep_keyframes)
        except KafkaException as exc:
            if not best_effort:
                raise
            log.warning("weight chunks not pruned this time (%s); the next keyframe retries", exc)
            return {}
        keyframes = sorted({m["version"] for m in self.history if m["kind"] == "keyframe"})
        if out and len(keyframes) >= keep_keyframes:
            oldest = keyframes[-keep_keyframes]
            self.history = [m for m in self.history if m["version"] >= oldest]
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the chunk producer's records (there are none after a publish returned)."""
        self.chunk_producer.wait(timeout)

    # --- internals ---------------------------------------------------------------------------

    def _encode(self, kind: str, state: State, version: int) -> codec.Encoded:
        if kind == "keyframe":
            return codec.encode_keyframe(
                state,
                version=version,
                max_chunk_bytes=self.max_chunk_bytes,
                hash_algorithm=self.hash_algorithm,
            )
        assert self._last is not None
        return codec.encode_delta(
            self._last.state,
            state,
            version=version,
            base_version=self._last.version,
            max_chunk_bytes=self.max_chunk_bytes,
            hash_algorithm=self.hash_algorithm,
            fast_apply=self.fast_apply,
        )

    def _produce_chunks(
        self, version: int, kinds: Sequence[str], encoded: Sequence[codec.Encoded]
    ) -> dict[str, dict[int, Ref]]:
        """Write every chunk with the chunk producer, round-robin over the partitions, then wait
        for the broker's acknowledgements: their positions go into the manifest, and a failed
        chunk must fail the publish before the manifest exists."""
        count = sum(len(e.chunks) for e in encoded)
        where = iter(chunk_partitions(self._next_partition, count, self._partitions()))
        self._next_partition = (self._next_partition + count) % self._partitions()
        items = []
        for kind, enc in zip(kinds, encoded, strict=True):
            for index, payload in enumerate(enc.chunks):
                rec = chunk_record(enc.manifest, index, payload, run=self.run, model=self.model)
                items.append(((kind, index), rec, next(where)))
        written = self._write_chunks(version, items)
        refs: dict[str, dict[int, Ref]] = {kind: {} for kind in kinds}
        for (kind, index), ref in written.items():
            refs[kind][index] = ref
        return refs

    def _write_chunks(
        self, version: int, items: Sequence[tuple[Any, dict[str, Any], int]]
    ) -> dict[Any, Ref]:
        return write_chunks(
            self.chunk_producer,
            self.chunk_topic,
            items,
            self._serialize_chunk,
            self.flush_timeout,
            f"version {version}",
        )

    def _shard(self, state: State) -> tuple[State, int]:
        """This rank's shard of ``state`` and the index of its first tensor in the whole."""
        assert self.ranks is not None
        names, first = shard_names(state, self.ranks.rank, self.ranks.world)
        return {n: state[n] for n in names}, first

    def _partitions(self) -> int:
        if self._chunk_partitions is None:
            self._chunk_partitions = self.chunk_producer.partitions(self.chunk_topic)
        return self._chunk_partitions

    def _produce_manifest(self, rec: Mapping[str, Any]) -> None:
        self.producer.announce_schema(self.producer.store.current("weight_manifest")[0])
        value = self._serialize_manifest(rec, None)
        if len(value) > self._manifest_limit:
            raise ValueError(f"manifest of {len(value)} bytes > {self._manifest_limit}")
        key = topics.record_key("weights.manifests", rec)
        headers = self.signer.headers(value) if self.signer is not None else None
        self.producer.produce_raw(self.manifest_topic, value, key, headers)


def rank_publisher(
    settings: KafkaSettings,
    run: str,
    model: str,
    transactional_id: str,
    ranks: PublishingRanks | None = None,
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
    signer: Signer | None = None,
    fast_apply: bool = False,
) -> WeightPublisher:
    """The publisher of one learner rank (or of the only one, ``ranks`` None): rank 0 holds the
    transactional producer ``transactional_id`` (it commits manifests and offsets, signed by
    ``signer``) and gets a chunk producer of its own; another rank writes chunks only, with
    one plain idempotent producer (no transactional id, nothing to fence, nothing to sign).
    ``fast_apply``: deltas coded for fast applies. ``publisher.producer`` is the producer."""
    if ranks is None or ranks.rank == 0:
        producer, chunks = EventProducer.transactional(settings, transactional_id), None
    else:
        producer = chunks = EventProducer.connect(settings)
        signer = None
    return WeightPublisher(
        producer, run, model, keyframe_every=keyframe_every, ranks=ranks, signer=signer,
        chunk_producer=chunks, fast_apply=fast_apply,
    )  # fmt: skip

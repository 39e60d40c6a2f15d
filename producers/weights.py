"""Weight publication: every policy version as chunks plus a manifest, and chunk retention.

The learner calls ``WeightPublisher.publish_version`` with the new state (``TensorBits`` by
name) and the consumer offsets of the admitted records that formed the step. In one transaction
of the producer (``EventProducer.transaction``) the publisher encodes the state with the delta
codec and produces

1. every chunk of the version (``WeightChunk`` events on ``weights.chunks``, key
   MODEL/VERSION/INDEX), waits until the broker has acknowledged them, so that the manifest can
   name each chunk's log position (``ChunkRef.ref``), then
2. the ``WeightManifest`` (on ``weights.manifests``, key MODEL) last,

and commits them with the offsets: chunks, manifest and offsets become visible together or not
at all, so a manifest never points at missing data and a crashed learner resumes from the last
published version. (``publish`` is the same without the transaction, for a caller that holds
one open.)

Rules (pure functions below, unit-tested):

- kinds (``publish_kinds``): a version is a *keyframe* when forced, when the publisher has no
  previous state (version 0, a fresh process, a resume without state) or when
  ``version % keyframe_every == 0``; every version that has a previous state is also published
  as a *delta* against it, so at a keyframe version both exist (delta first). Workers that
  follow live never download a keyframe; new or lost workers start from one.
- ``keyframe_version`` of a manifest is the newest keyframe at or before its version.
- manifest mapping (``manifest_record``): the codec manifest becomes the Avro record; the codec's
  per-tensor piece table is not stored as such (the schema has no field for it): each tensor's
  pieces occupy one contiguous span of the concatenated chunk payloads, recorded in
  ``TensorEntry.offset``/``nbytes`` as the schema documents, and the chunks themselves describe
  their pieces, so ``codec_manifest`` (the subscriber's inverse mapping) rebuilds the table
  from the verified chunks and checks it against these spans. ``codec_version`` is the codec's
  format number; the tensors are listed in the caller's state-dict order.
- retention (``retention_cutoffs``/``prune``): keep every chunk of every version at or after the
  ``keep_keyframes``-th newest keyframe (default 2: a worker catching up from the older keyframe
  is never cut off when a new keyframe lands); per chunk partition, delete the records before
  the first kept chunk (or, where no kept chunk lies, up to the last dropped one). Manifests are
  never deleted: they are small and are the run's record. Chunks whose position is unknown make
  the rule delete nothing.

numpy and Kafka only: importing this module never loads torch.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from confluent_kafka import KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from rlstream.producers.producer import DeliveryError, EventProducer
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics
from rlstream.schemas.deltacodec_bits import DTYPE_WIDTHS
from rlstream.schemas.deltacodec_pieces import ENCODINGS, read_piece

log = logging.getLogger(__name__)

#: Weights codec format number written to ``WeightManifest.codec_version``.
CODEC_VERSION: Final = int(codec.FORMAT.rsplit("/", 1)[1])
#: Largest chunk payload the publisher asks the codec for (the topic catalog's limit).
MAX_CHUNK_BYTES: Final = topics.CHUNK_PAYLOAD_BYTES
DEFAULT_KEYFRAME_EVERY: Final = 8

State = Mapping[str, codec.TensorBits]
#: Fault injection for tests: ``(version, kind, index, payload) -> payload to send``.
FaultHook = Callable[[int, str, int, bytes], bytes]
Ref = tuple[str, int, int]  # topic, partition, offset


# --- rules -----------------------------------------------------------------------------------


def publish_kinds(
    version: int, keyframe_every: int, has_base: bool, force_keyframe: bool = False
) -> tuple[str, ...]:
    """What to publish for ``version``: ``("delta",)``, ``("keyframe",)`` or both, delta first.

    Rule: a keyframe when forced, without a previous state, or when ``version`` is a multiple of
    ``keyframe_every``; a delta whenever there is a previous state to diff against."""
    if keyframe_every < 1:
        raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
    keyframe = force_keyframe or not has_base or version % keyframe_every == 0
    return (("delta",) if has_base else ()) + (("keyframe",) if keyframe else ())


def tensor_spans(manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``name -> (offset, nbytes)`` of each tensor's pieces in the concatenated chunk payloads.

    Rule: chunks hold the codec's pieces in manifest order (tensors by name, pieces by start),
    each chunk after its ``CHUNK_HEADER``; a tensor's span runs from its first piece's start
    to its last piece's end (chunk headers in between included). A tensor without pieces gets
    an empty span at the position where its pieces would have started."""
    bases, total = [], 0
    for c in manifest["chunks"]:
        bases.append(total)
        total += c["nbytes"]
    cursor = [codec.CHUNK_HEADER.size] * len(bases)
    spans: dict[str, tuple[int, int]] = {}
    position = codec.CHUNK_HEADER.size if bases else 0
    for entry in manifest["tensors"]:
        first = end = None
        for chunk, _start, _stop, _enc, nbytes in entry["pieces"]:
            at = bases[chunk] + cursor[chunk]
            first = at if first is None else first
            cursor[chunk] += nbytes
            end = at + nbytes
        if first is None or end is None:
            spans[entry["name"]] = (position, 0)
        else:
            spans[entry["name"]] = (first, end - first)
            position = end
    return spans


def manifest_record(
    manifest: Mapping[str, Any],
    *,
    run: str,
    model: str,
    chunk_topic: str,
    keyframe_version: int,
    created_ms: int,
    order: Sequence[str] | None = None,
    refs: Mapping[int, Ref] | None = None,
    step_inputs: Sequence[Mapping[str, Any]] = (),
    stats: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The Avro ``WeightManifest`` of one encoded version (see the module rules).

    ``order`` is the state-dict order of the tensor names (the codec's order, sorted by name, if
    None); ``refs`` maps chunk index to where its record was written."""
    by_name = {t["name"]: t for t in manifest["tensors"]}
    spans = tensor_spans(manifest)
    names = list(order) if order is not None else list(by_name)
    if sorted(names) != sorted(by_name):
        raise ValueError("order must name exactly the manifest's tensors")
    refs = refs or {}
    return {
        "run": run,
        "model": model,
        "version": manifest["version"],
        "base_version": manifest["base_version"],
        "keyframe_version": int(keyframe_version),
        "kind": manifest["kind"],
        "created_ms": int(created_ms),
        "tensors": [_tensor_entry(by_name[n], spans[n]) for n in names],
        "chunks": [_chunk_ref(c, refs.get(c["index"])) for c in manifest["chunks"]],
        "chunk_topic": chunk_topic,
        "state_hash": manifest["state_hash"],
        "base_state_hash": manifest["base_state_hash"],
        "raw_bytes": manifest["raw_bytes"],
        "encoded_bytes": manifest["encoded_bytes"],
        "step_inputs": [dict(r) for r in step_inputs],
        "stats": {k: float(v) for k, v in (stats or {}).items()},
        "codec_version": CODEC_VERSION,
    }


_ENTRY_FIELDS = ("name", "dtype", "encoding", "changed", "hash", "base_hash")


def _tensor_entry(entry: Mapping[str, Any], span: tuple[int, int]) -> dict[str, Any]:
    same = {k: entry[k] for k in _ENTRY_FIELDS}
    return {**same, "shape": list(entry["shape"]), "offset": span[0], "nbytes": span[1]}


def _chunk_ref(chunk: Mapping[str, Any], ref: Ref | None) -> dict[str, Any]:
    where = None if ref is None else {"topic": ref[0], "partition": ref[1], "offset": ref[2]}
    return {
        "index": chunk["index"],
        "nbytes": chunk["nbytes"],
        "checksum": chunk["checksum"],
        "ref": where,
    }


def codec_manifest(record: Mapping[str, Any], chunks: Sequence[bytes | None]) -> dict[str, Any]:
    """The codec manifest of an Avro ``WeightManifest``, rebuilt with its verified chunks.

    Rule: every chunk is first checked against the record's size and checksum; the piece table
    is then read from the chunks (each piece names its tensor, element range and encoding), and
    each piece must lie inside its tensor's ``offset``/``nbytes`` span of the concatenated
    payloads. Raises ``ManifestInvalid``, ``MissingChunk`` or ``ChunkCorrupt``."""
    if record["codec_version"] != CODEC_VERSION:
        raise codec.ManifestInvalid(f"unknown weights codec version {record['codec_version']}")
    listed = [
        {"index": c["index"], "nbytes": c["nbytes"], "checksum": c["checksum"]}
        for c in record["chunks"]
    ]
    if len(chunks) != len(listed) or any(c is None for c in chunks):
        got = sum(c is not None for c in chunks)
        raise codec.MissingChunk(f"version {record['version']}: {got} of {len(listed)} chunks")
    tensors = sorted(record["tensors"], key=lambda t: t["name"])
    pieces: list[list[list[Any]]] = [[] for _ in tensors]
    base = 0
    for index, payload in enumerate(chunks):
        assert payload is not None
        codec.verify_chunk({"chunks": listed}, index, payload)
        for t, entry, at in _chunk_pieces(index, payload, len(tensors)):
            lo, n = tensors[t]["offset"], tensors[t]["nbytes"]
            if n and not lo <= base + at[0] < base + at[1] <= lo + n:  # nbytes 0: span unknown
                raise codec.ChunkCorrupt(f"chunk {index}: a piece lies outside its tensor's span")
            pieces[t].append(entry)
        base += len(payload)
    return {
        "format": codec.FORMAT,
        "version": record["version"],
        "base_version": record["base_version"],
        "kind": record["kind"],
        "tensors": [_codec_tensor(t, ps) for t, ps in zip(tensors, pieces, strict=True)],
        "chunks": listed,
        "state_hash": record["state_hash"],
        "base_state_hash": record["base_state_hash"],
        "raw_bytes": record["raw_bytes"],
        "encoded_bytes": record["encoded_bytes"],
        # not in the Avro record; decoding only needs a bound the chunks respect
        "max_chunk_bytes": max((c["nbytes"] for c in listed), default=0),
    }


def _chunk_pieces(
    index: int, payload: bytes, ntensors: int
) -> Iterator[tuple[int, list[Any], tuple[int, int]]]:
    """(tensor, piece entry, (start, end) in the payload) of every piece of one chunk."""
    buf = memoryview(payload)
    try:
        if len(buf) < codec.CHUNK_HEADER.size:
            raise ValueError("truncated chunk header")
        magic, fmt, count = codec.CHUNK_HEADER.unpack_from(buf, 0)
        if magic != codec.CHUNK_MAGIC or fmt != 1:
            raise ValueError("not a weight chunk")
        at = codec.CHUNK_HEADER.size
        for _ in range(count):
            piece, end = read_piece(buf, at)
            if piece.tensor >= ntensors:
                raise ValueError(f"piece of tensor {piece.tensor}, manifest has {ntensors}")
            entry = [index, piece.start, piece.stop, ENCODINGS[piece.encoding], end - at]
            yield piece.tensor, entry, (at, end)
            at = end
    except ValueError as exc:
        raise codec.ChunkCorrupt(f"chunk {index}: {exc}") from exc


def _codec_tensor(entry: Mapping[str, Any], pieces: list[list[Any]]) -> dict[str, Any]:
    return {
        **{k: entry[k] for k in _ENTRY_FIELDS},
        "shape": list(entry["shape"]),
        "raw_bytes": math.prod(entry["shape"]) * DTYPE_WIDTHS.get(entry["dtype"], 0),
        "encoded_bytes": sum(p[4] for p in pieces),
        "pieces": sorted(pieces, key=lambda p: p[1]),
    }


def retention_cutoffs(
    manifests: Iterable[Mapping[str, Any]], keep_keyframes: int = 2
) -> dict[tuple[str, int], int]:
    """``(topic, partition) -> offset`` before which chunk records may be deleted.

    Rule: kept = every manifest whose version is at or after the ``keep_keyframes``-th newest
    keyframe version; per partition the cutoff is the smallest offset of a kept chunk there, or
    one past the largest dropped chunk where no kept chunk lies. Nothing is cut when there are
    fewer keyframes than ``keep_keyframes`` or when a kept chunk's position is unknown."""
    if keep_keyframes < 1:
        raise ValueError("keep_keyframes must be >= 1")
    records = list(manifests)
    keyframes = sorted({m["version"] for m in records if m["kind"] == "keyframe"})
    if len(keyframes) < keep_keyframes:
        return {}
    oldest_kept = keyframes[-keep_keyframes]
    kept: dict[tuple[str, int], int] = {}
    dropped: dict[tuple[str, int], int] = {}
    for m in records:
        keep = m["version"] >= oldest_kept
        for chunk in m["chunks"]:
            ref = chunk.get("ref")
            if ref is None:
                if keep:
                    return {}  # a kept chunk could be anywhere: cut nothing
                continue
            tp = (ref["topic"], ref["partition"])
            if keep:
                kept[tp] = min(kept.get(tp, ref["offset"]), ref["offset"])
            else:
                dropped[tp] = max(dropped.get(tp, -1), ref["offset"])
    cut = {tp: off + 1 for tp, off in dropped.items() if tp not in kept}
    cut.update({tp: off for tp, off in kept.items() if off > 0})
    return cut


def prune(
    admin: AdminClient,
    manifests: Iterable[Mapping[str, Any]],
    *,
    keep_keyframes: int = 2,
    timeout: float = 30.0,
) -> dict[tuple[str, int], int]:
    """Delete the chunk records ``retention_cutoffs`` allows; returns the new low watermarks.

    Manifests are never deleted. ``manifests`` is the model's manifest history (for instance
    ``rlstream.consumers.weights.read_manifests``, or ``WeightPublisher.history``)."""
    cuts = retention_cutoffs(manifests, keep_keyframes)
    if not cuts:
        return {}
    request = [TopicPartition(t, p, off) for (t, p), off in sorted(cuts.items())]
    futures = admin.delete_records(request, request_timeout=timeout, operation_timeout=timeout)
    out: dict[tuple[str, int], int] = {}
    for tp, future in futures.items():
        out[(tp.topic, tp.partition)] = future.result().low_watermark
    log.info("pruned weight chunks up to %s", out)
    return out


# --- the publisher ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Published:
    """What the next delta is computed against."""

    version: int
    state: State
    keyframe_version: int | None


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

    ``producer`` must wrap a transactional producer whose ``init_transactions`` has been called.
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
        fault_hook: FaultHook | None = None,
    ) -> None:
        publish_kinds(0, keyframe_every, False)  # validates keyframe_every
        self.producer, self.run, self.model = producer, run, model
        self.chunk_topic = chunk_topic or topics.topic_name(run, "weights.chunks")
        self.manifest_topic = manifest_topic or topics.topic_name(run, "weights.manifests")
        self.keyframe_every, self.max_chunk_bytes = keyframe_every, max_chunk_bytes
        self.flush_timeout = flush_timeout
        self.fault_hook = fault_hook  # tests only: corrupts payloads, manifests stay truthful
        self.history: list[dict[str, Any]] = []  # manifests without tensors, for ``prune``
        self.last_stats: PublishStats | None = None
        self._last: _Published | None = None
        self._floor = -1  # versions at or below it were published (or resumed from)
        self._undo: tuple[_Published | None, int] | None = None  # what rollback restores
        self._serialize_chunk = events.serializer("weight_chunk", producer.store)
        self._serialize_manifest = events.serializer("weight_manifest", producer.store)
        self._chunk_limit = topics.STREAMS["weights.chunks"].max_value_bytes
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
    ) -> None:
        """Re-seed a restarted learner with the last published version.

        With ``state`` the next version is a delta against it (pass ``state_hash`` from the last
        manifest to have the state checked first); without ``state`` the next version is a
        keyframe only, and without ``keyframe_version`` it is a keyframe as well as a delta."""
        if state is not None and state_hash is not None and codec.state_hash(state) != state_hash:
            raise ValueError(f"state does not hash to the manifest of version {version}")
        self._undo = None
        self._last = None if state is None else _Published(version, state, keyframe_version)
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
        """Publish ``version`` inside the caller's open transaction; returns its manifest record
        (the keyframe's when the version has both). Call ``rollback`` if the transaction aborts.
        The caller must not mutate ``state`` afterwards: it is the next delta's base."""
        last = self._last
        if version <= self._floor:
            raise ValueError(f"version {version} is not after the last published {self._floor}")
        unknown_keyframe = last is not None and last.keyframe_version is None
        force = force_keyframe or unknown_keyframe
        kinds = publish_kinds(version, self.keyframe_every, last is not None, force)
        t0 = time.perf_counter()
        encoded = [self._encode(kind, state, version) for kind in kinds]
        encode_s = time.perf_counter() - t0
        created_ms = int(time.time() * 1000)
        refs = self._produce_chunks(version, kinds, encoded)
        keyframe_version = version if "keyframe" in kinds else _keyframe_of(last)
        record = functools.partial(
            manifest_record,
            run=self.run,
            model=self.model,
            chunk_topic=self.chunk_topic,
            keyframe_version=keyframe_version,
            created_ms=created_ms,
            order=list(state),
            step_inputs=step_inputs,
            stats=stats,
        )
        records = [record(e.manifest, refs=refs[k]) for k, e in zip(kinds, encoded, strict=True)]
        for rec in records:
            self._produce_manifest(rec)
        self._undo = (last, self._floor)
        self._last, self._floor = _Published(version, state, keyframe_version), version
        self.history += [{k: v for k, v in r.items() if k != "tensors"} for r in records]
        produce_s = time.perf_counter() - t0 - encode_s
        self.last_stats = PublishStats.of(version, kinds, encoded, encode_s, produce_s)
        return records[-1]

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
    ) -> dict[str, Any]:
        """``publish`` in a transaction of its own, committed with the consumer ``offsets`` (of
        the group ``group_metadata`` names) that formed the version, if any. On any failure the
        transaction is aborted, the publish rolled back, and the error raised."""
        try:
            with self.producer.transaction(timeout) as txn:
                rec = self.publish(
                    state,
                    version,
                    step_inputs=step_inputs,
                    stats=stats,
                    force_keyframe=force_keyframe,
                )
                txn.send_offsets(offsets, group_metadata)
        except BaseException:
            if self._last is not None and self._last.version == version:
                self.rollback()
            raise
        return rec

    def prune(self, admin: AdminClient, keep_keyframes: int = 2) -> dict[tuple[str, int], int]:
        """``prune`` over the manifests this publisher wrote; forgets the ones pruned."""
        out = prune(admin, self.history, keep_keyframes=keep_keyframes)
        keyframes = sorted({m["version"] for m in self.history if m["kind"] == "keyframe"})
        if out and len(keyframes) >= keep_keyframes:
            oldest = keyframes[-keep_keyframes]
            self.history = [m for m in self.history if m["version"] >= oldest]
        return out

    # --- internals ---------------------------------------------------------------------------

    def _encode(self, kind: str, state: State, version: int) -> codec.Encoded:
        if kind == "keyframe":
            return codec.encode_keyframe(
                state, version=version, max_chunk_bytes=self.max_chunk_bytes
            )
        assert self._last is not None
        return codec.encode_delta(
            self._last.state,
            state,
            version=version,
            base_version=self._last.version,
            max_chunk_bytes=self.max_chunk_bytes,
        )

    def _produce_chunks(
        self, version: int, kinds: Sequence[str], encoded: Sequence[codec.Encoded]
    ) -> dict[str, dict[int, Ref]]:
        """Produce every chunk, then wait for the broker's acknowledgements: their positions go
        into the manifest, and a failed chunk must fail the publish before the manifest exists."""
        serialize = self._serialize_chunk
        self.producer.announce_schema(self.producer.store.current("weight_chunk")[0])
        refs: dict[str, dict[int, Ref]] = {kind: {} for kind in kinds}
        errors: list[str] = []
        for kind, enc in zip(kinds, encoded, strict=True):
            count = len(enc.chunks)
            for index, payload in enumerate(enc.chunks):
                rec = {
                    "run": self.run,
                    "model": self.model,
                    "version": version,
                    "index": index,
                    "count": count,
                    "checksum": enc.manifest["chunks"][index]["checksum"],
                    "payload": self._maybe_fault(version, kind, index, payload),
                }
                value = serialize(rec, None)
                if len(value) > self._chunk_limit:
                    raise ValueError(f"chunk record of {len(value)} bytes > {self._chunk_limit}")
                key = topics.record_key("weights.chunks", rec)
                on_delivery = _on_ref(refs[kind], index, errors)
                self.producer.produce_raw(self.chunk_topic, value, key, on_delivery=on_delivery)
        remaining = self.producer.wait(self.flush_timeout)
        missing = sum(len(e.chunks) for e in encoded) - sum(len(r) for r in refs.values())
        if errors or remaining or missing:
            detail = "; ".join(errors[:3]) or f"{missing} chunk(s) unacknowledged"
            raise DeliveryError(f"weight chunks of version {version} not written: {detail}")
        return refs

    def _maybe_fault(self, version: int, kind: str, index: int, payload: bytes) -> bytes:
        return (
            payload if self.fault_hook is None else self.fault_hook(version, kind, index, payload)
        )

    def _produce_manifest(self, rec: Mapping[str, Any]) -> None:
        self.producer.announce_schema(self.producer.store.current("weight_manifest")[0])
        value = self._serialize_manifest(rec, None)
        if len(value) > self._manifest_limit:
            raise ValueError(f"manifest of {len(value)} bytes > {self._manifest_limit}")
        key = topics.record_key("weights.manifests", rec)
        self.producer.produce_raw(self.manifest_topic, value, key)


def _keyframe_of(last: _Published | None) -> int:
    """Keyframe version carried over to a delta-only version (which always has a base)."""
    if last is None or last.keyframe_version is None:
        raise AssertionError("a delta-only version needs a known keyframe before it")
    return last.keyframe_version


def _on_ref(into: dict[int, Ref], index: int, errors: list[str]) -> Callable[..., None]:
    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(f"chunk {index}: {err.str()}")
        else:
            into[index] = (msg.topic() or "", msg.partition() or 0, msg.offset() or 0)

    return on_delivery

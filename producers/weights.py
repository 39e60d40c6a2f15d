"""Weight publication: every policy version as chunks plus a manifest.

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

Rules (pure, unit-tested):

- kinds (``publish_kinds``): a version is a *keyframe* when forced, when the publisher has no
  previous state (version 0, a fresh process, a resume without state) or when
  ``version % keyframe_every == 0``; every version that has a previous state is also published
  as a *delta* against it, so at a keyframe version both exist (delta first). Workers that
  follow live never download a keyframe; new or lost workers start from one.
- ``keyframe_version`` of a manifest is the newest keyframe at or before its version.
- ``learner_epoch`` of a manifest is the publisher's ``epoch``: the learner's incarnation (one
  more than the newest epoch among the run's manifests, set by the learner when it starts), so
  readers can refuse a manifest of an older incarnation (``consumers.manifest_log``).

The records themselves (``WeightChunk``, ``WeightManifest``, and how the codec manifest maps to
them) are the wire format, owned by ``schemas.weight_format``; which chunks may be deleted is
the retention rule, owned by ``producers.weight_retention`` (``WeightPublisher.prune`` applies it
to the versions this publisher wrote).

numpy and Kafka only: importing this module never loads torch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from confluent_kafka import KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from rlstream.producers import weight_retention
from rlstream.producers.producer import DeliveryError, EventProducer
from rlstream.producers.weight_signing import Signer
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics
from rlstream.schemas.weight_format import Ref, chunk_record, manifest_record

#: Largest chunk payload the publisher asks the codec for (the topic catalog's limit).
MAX_CHUNK_BYTES: Final = topics.CHUNK_PAYLOAD_BYTES
DEFAULT_KEYFRAME_EVERY: Final = 8

State = Mapping[str, codec.TensorBits]
#: Fault injection for tests: ``(version, kind, index, payload) -> payload to send``.
FaultHook = Callable[[int, str, int, bytes], bytes]


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
        signer: Signer | None = None,
        epoch: int = 0,
    ) -> None:
        publish_kinds(0, keyframe_every, False)  # validates keyframe_every
        self.producer, self.run, self.model = producer, run, model
        self.chunk_topic = chunk_topic or topics.topic_name(run, "weights.chunks")
        self.manifest_topic = manifest_topic or topics.topic_name(run, "weights.manifests")
        self.keyframe_every, self.max_chunk_bytes = keyframe_every, max_chunk_bytes
        self.flush_timeout = flush_timeout
        self.fault_hook = fault_hook  # tests only: corrupts payloads, manifests stay truthful
        # Manifests are signed with the run's key (``weight_signing``); None: $RLSTREAM_WEIGHTS_
        # SIGNING_KEY, or unsigned when that is not set.
        self.signer = signer if signer is not None else Signer.from_env()
        self.epoch = epoch  # the learner's incarnation, written into every manifest
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
            learner_epoch=self.epoch,
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
        """``weight_retention.prune`` over the manifests this publisher wrote; forgets the ones
        pruned."""
        out = weight_retention.prune(admin, self.history, keep_keyframes=keep_keyframes)
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
            for index, payload in enumerate(enc.chunks):
                payload = self._maybe_fault(version, kind, index, payload)
                rec = chunk_record(enc.manifest, index, payload, run=self.run, model=self.model)
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
        headers = self.signer.headers(value) if self.signer is not None else None
        self.producer.produce_raw(self.manifest_topic, value, key, headers)


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

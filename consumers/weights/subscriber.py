"""Weight subscription: follow a model's manifests, fetch, verify, stage, then swap.

A ``WeightSubscriber`` follows the model's manifests through a ``ManifestLog``, plans the cheapest
route to the newest reachable version (``plan_route``), fetches and verifies the chunks, decodes
into a *staging* state, and only then hands over the complete state (``current()``/``latest()``,
``on_swap``). The records are the wire format of ``schemas.deltacodec.wire``.

Rules a maintainer must keep:
- never partial: the exposed state is always one complete, verified version; any failure leaves
  it as it was, is recorded in ``failures`` and excludes that manifest from later routes;
- bounds are checked before anything is fetched, allocated or decompressed;
- only chunks a committed manifest names are applied, matched by key and checksum;
- memory is bounded; in a rollout region it reads MirrorMaker's copies only, and a version whose
  chunks are still crossing is deferred, then refused after ``crossing_timeout_s``.

``poll`` is synchronous; ``start`` runs it in a background thread. numpy and Kafka only.
Details: docs/weight-sync.md (Following and applying).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from rlstream.consumers.read_to_end import retrying
from rlstream.consumers.weights.manifest_log import Key, ManifestLog
from rlstream.consumers.weights.routes import Link, Route, fetch_windows, plan_route, refusal
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime import metrics
from rlstream.producers.weights.signing import Verifier
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics
from rlstream.schemas.deltacodec.wire import (
    Bounds,
    TensorTable,
    check_bounds,
    chunk_keys,
    codec_manifest,
    default_max_state_bytes,
    tensor_table,
)

log = logging.getLogger(__name__)

# Chunk records of another cluster's clock may be stamped a little before the manifest before
# them; the time-based scan starts this much earlier.
CLOCK_SLACK_MS = 60_000
# A mirrored manifest whose chunks have not all crossed yet is tried again after this long.
RETRY_S = 5.0
# Entries kept in ``failures`` and ``reports`` (the latest ones).
HISTORY = 1000
_READER = {
    "enable.auto.commit": "false",
    "enable.partition.eof": "true",
    "auto.offset.reset": "error",  # a pruned position must fail loudly, not jump elsewhere
    "isolation.level": "read_committed",
    "max.partition.fetch.bytes": str(16 * 1024 * 1024),
    "fetch.max.bytes": str(64 * 1024 * 1024),
    "fetch.wait.max.ms": "50",
}
_CLOSED = {KafkaError._PARTITION_EOF, KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE}

State = dict[str, codec.TensorBits]
#: The delta (codec manifest, chunks) that made the version being served.
Kept = tuple[Mapping[str, Any], Sequence[bytes | None]]


def stage_step(
    manifest: Mapping[str, Any],
    chunks: Sequence[bytes | None],
    base: State | None,
    spare: State | None = None,
    kept: Kept | None = None,
    full_check_every: int = 1,
    spare_version: int | None = None,
) -> State:
    """The state after one step of a route. With a ``spare`` (buffers of the version before
    ``base``, given up by the caller) and ``kept`` (the delta that turned that version into
    ``base``), a delta is applied in place: the spare is brought to ``base`` with ``kept``,
    then to the new version (``codec.apply_in_place``: nothing tensor-sized is allocated or
    copied, and ``base`` is never written). Otherwise, or when that is refused, the step is
    decoded (into the spare's buffers when given). Raises the codec's errors.

    In place, a version that is a multiple of ``full_check_every`` is applied with every
    hash checked, the others with ``check="changes"`` (pieces that check themselves are
    verified by their chunks' and changes' checksums alone: ``codec.apply_in_place``). A spare
    whose hashes are known must match ``kept``'s base state hash; one brought to its version
    by a "changes" check, whose hashes are not known, must be ``spare_version``, the version
    the caller served from it."""
    if spare is not None and kept is not None and base is not None:
        before, before_chunks = kept
        algorithm = codec.hash_algorithm(before)
        if all(t.knows(algorithm) for t in spare.values()):
            fits = before["base_state_hash"] == codec.state_hash(spare, algorithm)
        else:
            fits = spare_version is not None and before["base_version"] == spare_version
        if (
            manifest["kind"] == before["kind"] == "delta"
            and before["state_hash"] == manifest["base_state_hash"]
            and fits
        ):

            def check(m: Mapping[str, Any]) -> str:
                return "full" if m["version"] % full_check_every == 0 else "changes"

            # a refusal (the spare sharing memory with the base included) or a failure leaves
            # the spare whole (at its version or the base's): decode() then reports the step's
            # own error, if it has one
            with contextlib.suppress(ValueError, codec.DeltaError):
                caught_up = codec.apply_in_place(
                    before, before_chunks, spare, keep=base, check=check(before)
                )
                return codec.apply_in_place(
                    manifest, chunks, caught_up, keep=base, check=check(manifest)
                )
    return codec.decode(manifest, chunks, base, recycle=spare)


# --- reports ---------------------------------------------------------------------------------


class Snapshot(NamedTuple):
    """One complete, verified version: unpacks as ``version, state``."""

    version: int
    state: State


@dataclass(frozen=True)
class Applied:
    """One version handed over: how it was reached and what it cost."""

    version: int
    steps: tuple[Key, ...]
    fetch_s: float
    decode_s: float
    apply_s: float  # fetch + verify + decode of every step
    bytes_fetched: int
    state_hash: str
    published_ms: int  # the target manifest's created_ms
    applied_ms: int  # wall clock when the state became current
    swap_ms: float | None = None  # time on_swap took (the pause), if there is one


class Failure(NamedTuple):
    """A manifest that could not be applied, and why."""

    version: int
    kind: str
    reason: str


@dataclass
class _Timing:
    ms: float = 0.0  # set when the block ends


@contextlib.contextmanager
def swap_timer(into: list[float] | None = None) -> Iterator[_Timing]:
    """Time a swap (the pause generation sees): ``with swap_timer() as t: ...; t.ms``."""
    timing = _Timing()
    t0 = time.perf_counter()
    try:
        yield timing
    finally:
        timing.ms = (time.perf_counter() - t0) * 1000
        if into is not None:
            into.append(timing.ms)


# --- the subscriber --------------------------------------------------------------------------


@dataclass
class _Fetch:
    """Chunks wanted for one manifest, matched by key and checksum."""

    keys: dict[bytes, tuple[int, str]]  # record key -> (index, checksum)
    got: dict[int, bytes] = field(default_factory=dict)
    nbytes: int = 0


class WeightSubscriber:
    """Follows one model's weight versions (see the module docstring for the guarantees).

    ``poll`` and the background thread (``start``) are two ways to drive it, never both.
    ``initial`` seeds a worker that already holds a version (its arrays are never written).
    ``recycle=True`` decodes each new version into the buffers of the version replaced at the
    hand-over before (a delta after a delta is applied in place there, ``stage_step``): only
    for callers that copy the state in ``on_swap`` and keep no reference to a snapshot's
    arrays afterwards. ``expected`` is the model's tensor table
    (None: learnt from the first version served) and ``max_state_bytes`` the largest state
    accepted (None: half the machine's memory). ``full_check_every`` (recycling only): applied
    in place, only versions that are its multiples are checked against every hash, the others
    by their pieces' own checksums where they carry them (deltas published for fast applies:
    ``stage_step``). ``verifier``: the run's public key as configured (else resolved by
    ``consumers.weights.trust.run_trust``: a mirrored copy needs it given)."""

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        model: str,
        *,
        manifest_topic: str | None = None,
        chunk_topic: str | None = None,
        source: str | None = None,
        on_swap: Callable[[Snapshot], None] | None = None,
        fetch_timeout: float = 30.0,
        initial: Snapshot | None = None,
        recycle: bool = False,
        expected: TensorTable | None = None,
        max_state_bytes: int | None = None,
        full_check_every: int = 1,
        verifier: Verifier | None = None,
        crossing_timeout_s: float = 600.0,
    ) -> None:
        if full_check_every < 1:
            raise ValueError(f"full_check_every must be >= 1, got {full_check_every}")
        self.full_check_every = full_check_every
        self.settings, self.run, self.model = settings, run, model
        self.source = source  # None: this cluster's own topics; else the region copied from
        self._manifests = ManifestLog.of_run(
            settings, run, model, manifest_topic, source=source, verifier=verifier
        )
        self.manifest_topic = self._manifests.topic
        if not self._manifests.exists():
            self._manifests.close()
            raise ValueError(f"no topic {self.manifest_topic}: create the run's topics first")
        self.chunk_topic = chunk_topic  # None: the topic each manifest names (its copy here)
        self.on_swap, self.fetch_timeout = on_swap, fetch_timeout
        self.failures: deque[Failure] = deque(maxlen=HISTORY)
        # the latest tries of versions whose chunks had not all crossed yet (bounded)
        self.deferred: deque[Failure] = deque(maxlen=64)
        self.crossing_timeout_s = crossing_timeout_s
        self._deferred_since: dict[Key, float] = {}  # first deferral of each version still late
        self._lag = metrics.freshness_lag().labels(model)
        self._epochs: dict[int, int] = {}  # version handed over -> its manifest's learner epoch
        self.reports: deque[Applied] = deque(maxlen=HISTORY)
        self.table: TensorTable | None = expected
        if self.table is None and initial is not None:
            self.table = tensor_table(initial.state)
        self.max_state_bytes = max_state_bytes or default_max_state_bytes()
        self._refused = metrics.weight_refusals()
        self._bad: dict[Key, str] = {}  # refused for good, and why
        self._later: dict[Key, float] = {}  # key -> when to try it again (chunks still crossing)
        self._snapshot: Snapshot | None = initial
        self.ceiling: int | None = None  # newest version to move to (None: the newest)
        self._initial = initial  # the caller's arrays: never recycled
        self.recycle = recycle
        self._spare: Snapshot | None = None  # the version replaced at the last hand-over
        self._kept: Kept | None = None  # the delta that made the version served (recycle)
        group = f"rlstream.{run}.weights-reader.{uuid.uuid4().hex[:8]}"  # never joined
        self._chunk_reader = Consumer({**settings.librdkafka(), **_READER, "group.id": group})
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the state ------------------------------------------------------------------------

    def current(self) -> Snapshot | None:
        """The version being served and its state (None before the first one)."""
        return self._snapshot

    latest = current  # the background thread's hand-over: one atomic reference read

    @property
    def version(self) -> int | None:
        return None if self._snapshot is None else self._snapshot.version

    @property
    def refused_manifests(self) -> list[tuple[int, int, str]]:
        """(partition, offset, reason) of the latest manifests the log refused: not authentic,
        of a non-cryptographic hash in a signed run, of another run, of an older or jumping
        learner epoch, or an implausible or replayed version (``manifest_log``)."""
        return list(self._manifests.refused)

    def newest_known(self) -> int | None:
        """The newest version any manifest read so far names."""
        return self._manifests.newest

    def epoch_of(self, version: int) -> int:
        """The learner epoch of the manifest ``version`` was handed over from (the latest 64
        versions; 0 when unknown). Safe from any thread."""
        return self._epochs.get(version, 0)

    def freshness_lag(self) -> int:
        """Versions between the newest verified manifest and the one served (0: up to date;
        the newest plus one while nothing is served)."""
        newest = self.newest_known()
        if newest is None:
            return 0
        return newest - (self.version if self.version is not None else -1)

    def refusal_of(self, version: int) -> str | None:
        """Why ``version`` can never be applied, or None while it still may be (see
        ``refusal``)."""
        links = [
            Link(v, k, m["base_version"], m["encoded_bytes"])
            for (v, k), m in self._manifests.items()
        ]
        return refusal(version, links, self._bad, self.newest_known(), self.version)

    # -- driving it -----------------------------------------------------------------------

    def poll(self, timeout: float = 1.0) -> list[Applied]:
        """Read new manifests (waiting up to ``timeout`` for some), then catch up; returns the
        versions handed over (usually one: intermediate versions of a route are not)."""
        for key in self._manifests.wait(timeout):
            self._bad.pop(key, None)  # a republished manifest gets another chance
        return self._catch_up()

    def wait_for(self, version: int, timeout: float = 30.0) -> Snapshot | None:
        """Poll until the current version is at least ``version`` or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while (self.version is None or self.version < version) and time.monotonic() < deadline:
            self.poll(min(0.5, max(0.0, deadline - time.monotonic())))
        return self._snapshot

    def start(self, interval: float = 0.5) -> None:
        """Follow in a background thread; read the newest complete state with ``latest()``."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._follow, args=(interval,), name=f"weights-{self.model}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._manifests.close()
        self._chunk_reader.close()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _follow(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.poll(interval)
            except Exception:  # keep serving the old version; the next round retries
                log.exception("weights: follow round failed")
                self._stop.wait(interval)

    # -- catching up ----------------------------------------------------------------------

    def _catch_up(self) -> list[Applied]:
        applied: list[Applied] = []
        while True:
            links = [
                Link(v, k, m["base_version"], m["encoded_bytes"])
                for (v, k), m in self._manifests.items()
                if self.ceiling is None or v <= self.ceiling
            ]
            route = plan_route(links, self.version, self._skip())
            if route is None:
                self._lag.set(self.freshness_lag())
                return applied
            report = self._apply(route)
            if report is not None:
                applied.append(report)
                self._forget()

    def _forget(self) -> None:
        """Drop manifests older than both the current version and the second-newest keyframe:
        no route starts there any more (and retention deletes their chunks), so a long run's
        history does not grow without bound in memory."""
        keyframes = sorted(v for v, kind in self._manifests if kind == "keyframe")
        if self.version is not None and len(keyframes) >= 2:
            self._manifests.forget_before(min(self.version, keyframes[-2]))
        self._deferred_since = {
            k: t for k, t in self._deferred_since.items() if k in self._manifests
        }

    def _apply(self, route: Route) -> Applied | None:
        """Apply a route into staging; hand it over only when every step verified."""
        t0 = time.perf_counter()
        staged = self._stage(route)
        if staged is None:
            return None
        state, fetch_s, decode_s, nbytes = staged
        target = self._manifests[route.steps[-1]]
        self._epochs = {
            **{v: e for v, e in self._epochs.items() if v > route.target - 64},
            route.target: int(target.get("learner_epoch", 0)),
        }  # replaced whole: readers in other threads see one dict or the other
        # the codec orders tensors by name; hand them over in the manifest's state-dict order
        snapshot = Snapshot(route.target, {t["name"]: state[t["name"]] for t in target["tensors"]})
        apply_s = time.perf_counter() - t0
        swap_ms = self._swap(snapshot)
        report = Applied(
            version=route.target,
            steps=route.steps,
            fetch_s=fetch_s,
            decode_s=decode_s,
            apply_s=apply_s,
            bytes_fetched=nbytes,
            state_hash=target["state_hash"],
            published_ms=target["created_ms"],
            applied_ms=int(time.time() * 1000),
            swap_ms=swap_ms,
        )
        self.reports.append(report)
        return report

    def _stage(self, route: Route) -> tuple[State, float, float, int] | None:
        """Fetch, verify and decode every step of ``route`` into new arrays (or recycled
        ones); None after recording the failure of a step."""
        state = None if route.from_keyframe or self._snapshot is None else self._snapshot.state
        fetch_s = decode_s = 0.0
        nbytes = 0
        for key in route.steps:
            rec = self._manifests[key]
            log.info("weights: applying version %d (%s, %d bytes)", *key, rec["encoded_bytes"])
            spare, self._spare = self._spare, None  # handed to the codec: consumed either way
            kept, self._kept = self._kept, None
            try:
                check_bounds(rec, Bounds(self.table, self.max_state_bytes))
                t1 = time.perf_counter()
                chunks, got = self._fetch(rec)
                t2 = time.perf_counter()
                manifest = codec_manifest(rec, chunks)
                state = stage_step(
                    manifest, chunks, state, spare.state if spare else None, kept,
                    self.full_check_every, spare.version if spare else None,
                )  # fmt: skip
                if self.recycle and len(route.steps) == 1 and manifest["kind"] == "delta":
                    self._kept = (manifest, chunks)  # brings the version replaced next forward
                fetch_s, decode_s = fetch_s + t2 - t1, decode_s + time.perf_counter() - t2
                nbytes += got
            except (codec.DeltaError, MemoryError) as exc:  # out of memory: refused, not a crash
                crossing = self.source is not None and isinstance(exc, codec.MissingChunk)
                self._refuse(key, exc, later=crossing)
                return None
        assert state is not None
        return state, fetch_s, decode_s, nbytes

    def _swap(self, snapshot: Snapshot) -> float | None:
        swap_ms = None
        if self.on_swap is not None:
            with swap_timer() as t:
                self.on_swap(snapshot)
            swap_ms = t.ms
        replaced, self._snapshot = self._snapshot, snapshot  # the hand-over: one assignment
        if self.table is None:  # the first version served fixes the model's tensors
            self.table = tensor_table(snapshot.state)
        if self.recycle and replaced is not None and replaced is not self._initial:
            self._spare = replaced
        return swap_ms

    def _refuse(self, key: Key, exc: Exception, later: bool = False) -> None:
        """Exclude ``key`` from routes: for good, or (``later``) for ``RETRY_S`` only."""
        kind = type(exc).__name__
        reason = f"{kind}: {exc}"
        now = time.monotonic()
        if later and now - self._deferred_since.setdefault(key, now) > self.crossing_timeout_s:
            kind = "ChunksLate"
            reason = (
                f"{kind}: not all its chunks arrived in {self.crossing_timeout_s:.0f}s ({reason})"
            )
            later = False
        if later:
            log.info(
                "weights: version %d (%s) not all crossed yet, again in %.0fs: %s",
                *key,
                RETRY_S,
                reason,
            )
            self.deferred.append(Failure(key[0], key[1], reason))
            self._later[key] = now + RETRY_S
            return
        self._deferred_since.pop(key, None)
        log.warning(
            "weights: refusing version %d (%s), staying on %s: %s", *key, self.version, reason
        )
        self.failures.append(Failure(key[0], key[1], reason))
        self._bad[key] = reason
        self._refused.labels(self.model, kind).inc()

    def _skip(self) -> set[Key]:
        now = time.monotonic()
        self._later = {k: t for k, t in self._later.items() if t > now}
        return set(self._bad) | set(self._later)

    # -- fetching chunks ------------------------------------------------------------------

    def _fetch(self, rec: Mapping[str, Any]) -> tuple[list[bytes | None], int]:
        """Chunk payloads of one manifest (None where missing) and their total size."""
        topic = self.chunk_topic or topics.remote_topic(self.source, rec["chunk_topic"])
        want = _Fetch(chunk_keys(rec))
        deadline = time.monotonic() + self.fetch_timeout
        windows = fetch_windows(rec["chunks"], topic)
        if windows:
            self._scan(topic, {p: w[0] for p, w in windows.items()}, windows, rec, want, deadline)
        if len(want.got) < len(want.keys):
            if windows:
                log.info(
                    "weights: version %d: chunks not at their positions; scanning", rec["version"]
                )
            starts = self._scan_starts(topic, rec)
            self._scan(topic, starts, {}, rec, want, deadline)
        return [want.got.get(i) for i in range(len(rec["chunks"]))], want.nbytes

    def _scan_starts(self, topic: str, rec: Mapping[str, Any]) -> dict[int, int]:
        """Per partition, the first offset at or after the previous manifest's time."""
        before = [m["created_ms"] for (v, _), m in self._manifests.items() if v < rec["version"]]
        since = max(0, max(before, default=0) - CLOCK_SLACK_MS)
        reader = self._chunk_reader  # both asked again while a partition's leader is elected
        meta = retrying(lambda: reader.list_topics(topic, timeout=10)).topics[topic].partitions
        query = [TopicPartition(topic, p, since) for p in meta]
        found = retrying(lambda: reader.offsets_for_times(query, timeout=10))
        return {tp.partition: tp.offset for tp in found if tp.offset >= 0}

    def _scan(
        self,
        topic: str,
        starts: Mapping[int, int],
        windows: Mapping[int, tuple[int, int]],
        rec: Mapping[str, Any],
        want: _Fetch,
        deadline: float,
    ) -> None:
        """Read partitions from ``starts`` until every chunk is found, each partition is past
        its window (or at its end), or the deadline."""
        reader = self._chunk_reader
        reader.assign([TopicPartition(topic, p, off) for p, off in starts.items()])
        open_parts = set(starts)
        try:
            while open_parts and len(want.got) < len(want.keys) and time.monotonic() < deadline:
                for msg in _next_batch(reader, 0.2):
                    p, err = msg.partition() or 0, msg.error()
                    if err is not None:
                        if err.code() in _CLOSED:
                            open_parts.discard(p)
                        elif not err.retriable():
                            raise RuntimeError(f"chunk reader: {err.str()}")
                        continue
                    self._match(msg, rec, want)
                    if p in windows and (msg.offset() or 0) >= windows[p][1]:
                        open_parts.discard(p)
                        reader.pause([TopicPartition(topic, p)])
        finally:
            # librdkafka keeps a partition's pause across assignments: undo it before leaving
            reader.resume([TopicPartition(topic, p) for p in starts])
            reader.unassign()

    def _match(self, msg: Message, rec: Mapping[str, Any], want: _Fetch) -> None:
        hit = want.keys.get(msg.key() or b"")
        if hit is None or hit[0] in want.got:
            return
        try:
            chunk = self._manifests.decode(msg.value(), "weight_chunk")
        except events.EventError as exc:
            log.warning("weights: undecodable chunk record at %s: %s", msg.offset(), exc)
            return
        # same key, other payload: the keyframe and the delta of one version share chunk keys
        if chunk["checksum"] == hit[1] and chunk["version"] == rec["version"]:
            want.got[hit[0]] = chunk["payload"]
            want.nbytes += len(chunk["payload"])


def _next_batch(consumer: Consumer, timeout: float, limit: int = 256) -> list[Message]:
    """Wait up to ``timeout`` for one message, then take what else is already there.
    (``consume(n, timeout)`` would wait for ``n`` messages: a delay on every small fetch.)"""
    first = consumer.poll(timeout)
    return [] if first is None else [first, *consumer.consume(limit - 1, 0)]

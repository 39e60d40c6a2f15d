"""The weight manifest log: a run's ``WeightManifest`` records of one model, as read so far.

Every reader of weight manifests reads them here: the weight subscriber, the version watcher,
the learner's ledger, retention (``read_manifests``) and replay.

Rules a maintainer must keep:
- a log reads from the beginning with a reader of its own (no consumer group, no commits),
  committed records only: a manifest's transaction is what makes a version exist;
- fail-closed: each record's signature is checked against the run's trust before it is decoded;
  forged, unsigned, non-cryptographically hashed, foreign-run, older-epoch, too-far-ahead or
  replayed manifests are refused, remembered in ``refused``, counted in
  ``rlstream_weights_refused_total`` and never kept; while no key is known, records are held;
- records are kept by (version, kind), a newer epoch replacing an older one; ``by_version``
  gives the delta where a version also has a keyframe.

One thread drives a log; ``newest`` may be read from any thread.
Details: docs/weight-sync.md (The manifest log).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition

from rlstream.consumers.consumer import load_schema_topic
from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader
from rlstream.consumers.weights.trust import run_trust
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime import metrics
from rlstream.producers.weights.signing import VERIFY_KEY_ENV, Trust, Verifier
from rlstream.schemas import events, topics
from rlstream.schemas.deltacodec import CRYPTOGRAPHIC, hash_algorithm
from rlstream.schemas.deltacodec.wire import VersionTips
from rlstream.schemas.errors import Refused

log = logging.getLogger(__name__)

Key = tuple[int, str]  # (version, kind) names one manifest
#: While no key is known for the run, the trust is looked up again at most this often.
RETRUST_S = 1.0
_HELD = object()  # what ``_take`` returns for a record held until the run's key is known
_SKIP = (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


class ManifestLog(Mapping[Key, dict[str, Any]]):
    """The manifests of ``model`` (every model's when None) on ``topic``, by (version, kind).

    ``verifier`` (the run's public key) or ``trust`` overrides the run's trust, else resolved
    from the run (``consumers.weights.trust.run_trust``; ``audit``: a replay, which accepts a
    run recorded before keys unverified and legacy hashes)."""

    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        model: str | None = None,
        *,
        name: str = "manifest-log",
        verifier: Verifier | None = None,
        trust: Trust | None = None,
        audit: bool = False,
    ) -> None:
        self.settings, self.topic, self.model = settings, topic, model
        self.audit = audit
        self._cryptographic_seen = False
        if trust is None and verifier is not None:
            trust = Trust(verifier, source="given")
        self.trust = trust or self._resolve()
        self._looked, self._said = time.monotonic(), 0.0  # the first wait is said at once
        self.held = False  # records wait for the run's key
        self._holding: set[int] = set()  # partitions held since they were last assigned
        self.refused: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=100)
        self.newest: int | None = None
        self._tips = VersionTips()
        self._refusals = metrics.weight_refusals()
        self._records: dict[Key, dict[str, Any]] = {}
        self._next: dict[int, int] = {}  # partition -> offset after the last record read
        self._parts: list[int] | None = None
        self._following = False  # assigned from ``_next`` on, fetching in the background
        self._store = events.default_store()
        self._decode = events.deserializer(self._store)
        self._reader = reader(settings, name, **{"fetch.wait.max.ms": "50"})

    @classmethod
    def of_run(
        cls,
        settings: KafkaSettings,
        run: str,
        model: str | None = None,
        topic: str | None = None,
        *,
        source: str | None = None,
        audit: bool = False,
        verifier: Verifier | None = None,
    ) -> ManifestLog:
        """The log of ``run``'s manifests topic (or of ``topic``); with ``source`` (a region
        name), of MirrorMaker's copy from that region, ``SOURCE.rl.RUN.weights.manifests``."""
        name = f"{run}.manifest-log"
        own = topics.remote_topic(source, topics.topic_name(run, "weights.manifests"))
        return cls(settings, topic or own, model, name=name, audit=audit, verifier=verifier)

    # -- the records ----------------------------------------------------------------------

    def __getitem__(self, key: Key) -> dict[str, Any]:
        return self._records[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[dict[str, Any]]:
        """Every record kept, by version, a delta before the keyframe of its version."""
        return [self._records[k] for k in sorted(self._records, key=_order)]

    def by_version(self) -> dict[int, dict[str, Any]]:
        """One manifest per version, the delta where a version also has a keyframe."""
        out: dict[int, dict[str, Any]] = {}
        for version, kind in sorted(self._records, key=_order):
            if version not in out or kind == "delta":
                out[version] = self._records[(version, kind)]
        return out

    def forget_before(self, version: int) -> None:
        """Drop the records of every version older than ``version``."""
        for key in [k for k in self._records if k[0] < version]:
            del self._records[key]

    # -- reading --------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the topic exists (it is looked for again until it does)."""
        return bool(self._partitions())

    def catch_up(self, timeout: float = 60.0) -> list[Key]:
        """Read the records after those read so far, up to the end as of the call; returns the
        keys read (a republished version's too). Raises ``TimeoutError`` (keeping what was
        read) if the end is not reached within ``timeout``."""
        starts = self._positions()
        self._holding.clear()  # read again from the last record judged
        new = []
        try:
            for msg in read_to_end(self._reader, starts, timeout):
                key = self._take(msg)
                if isinstance(key, tuple):
                    new.append(key)
        finally:
            self._following = False  # read_to_end assigned only what it read
            self._follow()  # follow on from here at once: the reader fetches ahead
        return new

    def wait(self, timeout: float) -> list[Key]:
        """Wait up to ``timeout`` for a record of the model after those read so far, then catch
        up; returns the keys read (empty if none came). With ``timeout`` 0 it takes what the
        reader has already fetched: between calls it stays assigned and fetches ahead."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._follow():
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                time.sleep(min(left, 1.0))  # no topic yet (a mirror may create it later)
                continue
            msg = self._first(deadline)
            if msg is None:
                return []
            first = self._take(msg)
            new = ([first] if isinstance(first, tuple) else []) + self.catch_up()
            if new:
                return new
            if self.held:  # the run's key is not known yet: look again in a while
                time.sleep(max(0.0, min(deadline - time.monotonic(), RETRUST_S)))

    def decode(self, value: bytes | None, event: str) -> dict[str, Any]:
        """The record of ``event`` in ``value``; a writer schema never seen is learned from
        ``rl.schemas`` first. Raises ``events.EventError`` for anything else."""
        try:
            decoded = self._decode(value, None)
        except events.DecodeError as exc:
            if exc.reason != "unknown_schema":
                raise
            load_schema_topic(self.settings, self._store)  # written by newer code: learn it
            decoded = self._decode(value, None)
        if decoded.event != event:
            raise events.DecodeError(f"expected {event}, got {decoded.event}", "unexpected_event")
        return decoded.record

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> ManifestLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _partitions(self) -> list[int]:
        if self._parts is None:
            self._parts = partitions_of(self._reader, self.topic)
        return self._parts or []

    def _positions(self) -> list[TopicPartition]:
        """Every partition, from the offset after the last record read (the beginning if none)."""
        return [
            TopicPartition(self.topic, p, self._next.get(p, OFFSET_BEGINNING))
            for p in self._partitions()
        ]

    def _follow(self) -> bool:
        """Assign the partitions from where reading stopped, unless they are; False when the
        topic does not exist (yet)."""
        if not self._following:
            starts = self._positions()
            if not starts:
                return False
            self._reader.assign(starts)
            self._holding.clear()
            self._following = True
        return True

    def _first(self, deadline: float) -> Message | None:
        """The next record of the assigned partitions, or None at ``deadline`` (at once, if
        nothing was fetched, when the deadline has passed)."""
        while True:
            left = deadline - time.monotonic()
            msg = self._reader.poll(max(0.0, min(left, 0.5)))
            if msg is None:
                if left <= 0:
                    return None
                continue
            err = msg.error()
            if err is None:
                return msg
            if err.code() not in _SKIP and not err.retriable():
                raise RuntimeError(f"reading {self.topic}: {err.str()}")

    def _resolve(self) -> Trust:
        """The run's trust (a topic of no run: ``$RLSTREAM_WEIGHTS_VERIFY_KEY``, or none)."""
        try:
            return run_trust(self.topic, audit=self.audit)
        except ValueError:  # not an rlstream topic: no run to look up
            key = Verifier.from_env()
            return Trust(key, source=f"${VERIFY_KEY_ENV}") if key else Trust(insecure=self.audit)

    def _trusting(self) -> bool:
        """Whether records may be judged: the run's key (or insecure choice) is known, looked up
        again at most every ``RETRUST_S`` until it is."""
        if not self.trust.known and time.monotonic() - self._looked >= RETRUST_S:
            self.trust, self._looked = self._resolve(), time.monotonic()
        self.held = not self.trust.known
        if self.held and time.monotonic() - self._said >= 60:
            log.warning("manifests of %s held: %s", self.topic, self.trust.source)
            self._said = time.monotonic()
        return not self.held

    def _take(self, msg: Message) -> Key | object | None:
        """The key of the record kept, None (refused or skipped), or ``_HELD`` (not judged:
        the run's key is not known yet; the record is read again later)."""
        partition = int(msg.partition() or 0)
        if partition in self._holding or not self._trusting():
            # every later record of the partition waits too, until it is assigned again from
            # the last record judged: none is judged before the one held
            self._holding.add(partition)
            self._following = False
            return _HELD
        self._next[partition] = int(msg.offset() or 0) + 1
        try:
            self.trust.check(msg.value(), msg.headers())
        except Refused as exc:
            self._refuse(msg, self.model or "", "signature", str(exc))
            return None
        try:
            rec = self.decode(msg.value(), "weight_manifest")
        except events.EventError as exc:
            log.warning("manifests: skipping undecodable record at %s: %s", msg.offset(), exc)
            return None
        if self.model is not None and rec["model"] != self.model:
            return None
        why = self._judge(rec)
        if why is not None:
            self._refuse(msg, rec["model"], *why)
            return None
        key = (int(rec["version"]), str(rec["kind"]))
        self._records[key] = rec  # a version republished by a newer epoch replaces the older
        self.newest = key[0] if self.newest is None else max(self.newest, key[0])
        return key

    def _judge(self, rec: dict[str, Any]) -> tuple[str, str] | None:
        """``(reason kind, reason)`` when an authentic record is refused all the same."""
        algorithm = hash_algorithm(rec)
        # a replay accepts a legacy hash only in a log that has used no cryptographic one yet
        weak_ok = self.audit and not self._cryptographic_seen
        if self.trust.verifier is not None and not weak_ok and algorithm not in CRYPTOGRAPHIC:
            return "hash", f"hash algorithm {algorithm} is not cryptographic (a signed run)"
        self._cryptographic_seen |= algorithm in CRYPTOGRAPHIC
        run = _run_of(self.topic)
        if run is not None and rec["run"] != run:
            return "run", f"a manifest of run {rec['run']!r} on {self.topic}"
        epoch = int(rec.get("learner_epoch", 0))
        return self._tips.admit(rec["model"], int(rec["version"]), epoch, str(rec["kind"]))

    def _refuse(self, msg: Message, model: str, kind: str, reason: str) -> None:
        log.warning("manifests: refusing the record at offset %s: %s", msg.offset(), reason)
        self.refused.append((int(msg.partition() or 0), int(msg.offset() or 0), reason))
        self._refusals.labels(model, kind).inc()


def _run_of(topic: str) -> str | None:
    try:
        return topics.parse_topic(topic).run
    except ValueError:
        return None


def _order(key: Key) -> tuple[int, bool]:
    return key[0], key[1] == "keyframe"


def read_manifests(
    settings: KafkaSettings,
    run: str,
    model: str,
    *,
    topic: str | None = None,
    timeout: float = 15.0,
) -> list[dict[str, Any]]:
    """Every manifest record of ``model`` by version, delta before keyframe (for ``prune``)."""
    with ManifestLog.of_run(settings, run, model, topic) as manifests:
        manifests.catch_up(timeout)
        return manifests.records()


def manifests_by_version(
    settings: KafkaSettings,
    run: str,
    model: str | None = None,
    timeout: float = 60.0,
    *,
    audit: bool = False,
    source: str | None = None,
    verifier: Verifier | None = None,
) -> dict[int, dict[str, Any]]:
    """One committed manifest per version of ``run`` (``ManifestLog.by_version``), read to the
    end as of the call (``audit``: by a replay, see ``ManifestLog``; ``source``: from
    MirrorMaker's copy of that region's log, see ``ManifestLog.of_run``; ``verifier``: the
    run's key, given rather than looked up)."""
    with ManifestLog.of_run(
        settings, run, model, source=source, audit=audit, verifier=verifier
    ) as manifests:
        manifests.catch_up(timeout)
        return manifests.by_version()

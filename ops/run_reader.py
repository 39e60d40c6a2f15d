"""Read a run's streams for analytics: every partition, from the beginning, without a group.

Like ``rlstream run tap``, the reader assigns partitions itself and never commits, so watching
a run never moves a role's offsets, never shows up as a consumer group and never triggers a
rebalance. Topics are found by pattern (``ops.analytics.run_topic_regex``): the run's local
streams and their MirrorMaker 2 copies ``REGION.rl.RUN.STREAM``. A following reader looks for new
topics and partitions every ``refresh_s`` (a region's mirror may appear mid-run); a reader
that does not follow stops once every partition reached the end it had when it was first seen.

Records are decoded with the writer schema they name; a schema this code has never seen is
learned from ``rl.schemas`` (once per unknown fingerprint). Undecodable records are reported,
not dropped silently.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from rlstream.consumers.consumer import load_schema_topic
from rlstream.ops.analytics import role_of_group, run_topic_regex
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import events

Sink = Callable[[str, dict[str, Any], int | None], None]
"""Called with (topic, decoded record, Kafka timestamp ms or None) for each record."""
ErrorSink = Callable[[str, str], None]
"""Called with (topic, reason) for each record that could not be decoded."""

READER_CONF = {
    "group.id": "rlstream.analytics",  # required by librdkafka; never joined, never committed
    "enable.auto.commit": "false",
    "enable.partition.eof": "true",
    "isolation.level": "read_committed",
    "max.partition.fetch.bytes": str(16 * 1024 * 1024),
    "fetch.max.bytes": str(64 * 1024 * 1024),
    "queued.max.messages.kbytes": str(64 * 1024),
}


class RunReader:
    """Reads a run's streams (see the module docstring); not thread-safe, one thread drives it."""

    def __init__(
        self, settings: KafkaSettings, run: str, refresh_s: float = 5.0, timeout: float = 10.0
    ) -> None:
        self.settings, self.run, self.refresh_s, self.timeout = settings, run, refresh_s, timeout
        self.pattern = re.compile(run_topic_regex(run))
        self.store = events.SchemaStore()
        load_schema_topic(settings, self.store, timeout)
        self.decode = events.deserializer(self.store)
        self._unknown: set[bytes] = set()
        self.consumer = Consumer({**settings.librdkafka(), **READER_CONF})
        self.assigned: set[tuple[str, int]] = set()
        self.open: set[tuple[str, int]] = set()
        """Partitions not yet read to the end they had when assigned."""
        self._refreshed = 0.0
        self.records = 0

    def refresh(self) -> list[str]:
        """Assign new partitions of matching topics, from the beginning; returns new topics."""
        self._refreshed = time.monotonic()
        meta = self.consumer.list_topics(timeout=self.timeout).topics
        new_parts, new_topics = [], []
        for topic, tmeta in sorted(meta.items()):
            if tmeta.error is not None or not self.pattern.match(topic):
                continue
            fresh = [
                (topic, p) for p in sorted(tmeta.partitions) if (topic, p) not in self.assigned
            ]
            if fresh and not any(t == topic for t, _ in self.assigned):
                new_topics.append(topic)
            new_parts += fresh
        if new_parts:
            self.consumer.incremental_assign(
                [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in new_parts]
            )
            self.assigned.update(new_parts)
            self.open.update(new_parts)
        return new_topics

    def pump(
        self, sink: Sink, on_error: ErrorSink, max_records: int = 500, timeout: float = 0.5
    ) -> int:
        """Read up to ``max_records`` records into ``sink``; returns how many were read."""
        if time.monotonic() - self._refreshed >= self.refresh_s:
            self.refresh()
        count = 0
        for msg in self.consumer.consume(max_records, timeout):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self.open.discard((msg.topic(), msg.partition()))
                elif not (err.retriable() or err.code() in _BENIGN):
                    raise RuntimeError(f"analytics reader: {err.str()}")
                continue
            count += 1
            self._deliver(msg, sink, on_error)
        self.records += count
        return count

    def _deliver(self, msg: Message, sink: Sink, on_error: ErrorSink) -> None:
        value, topic = msg.value(), msg.topic() or ""
        if value is None:
            return  # a tombstone carries no event
        kind, ts = msg.timestamp()
        ts_ms = ts if kind != 0 and ts > 0 else None  # 0 = TIMESTAMP_NOT_AVAILABLE
        try:
            decoded = self._decode(value)
        except events.EventError as exc:
            on_error(topic, exc.reason)
            return
        sink(topic, decoded.record, ts_ms)

    def _decode(self, value: bytes) -> events.Decoded:
        try:
            return self.decode(value, None)
        except events.DecodeError as exc:
            fp = events.fingerprint_of(value)
            if exc.reason != "unknown_schema" or fp is None or fp in self._unknown:
                raise
            # written by code newer than ours: learn its writer schema from rl.schemas, once
            self._unknown.add(fp)
            load_schema_topic(self.settings, self.store, self.timeout)
            return self.decode(value, None)

    def read_to_end(
        self,
        sink: Sink,
        on_error: ErrorSink,
        idle_s: float = 10.0,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Read every matching partition to its end; False if it stopped after ``idle_s`` idle."""
        self.refresh()
        idle_since = time.monotonic()
        while self.open:
            if self.pump(sink, on_error, timeout=0.5):
                idle_since = time.monotonic()
                if progress:
                    progress(self.records)
            elif time.monotonic() - idle_since > idle_s:
                return False
        return True

    def close(self) -> None:
        self.consumer.close()


_BENIGN = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


def run_manifests(settings: KafkaSettings, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """The latest manifest of every run in ``rl.runs`` (compacted: the last record per key wins)."""
    from rlstream.schemas import topics

    consumer = Consumer({**settings.librdkafka(), **READER_CONF})
    store = events.SchemaStore()
    load_schema_topic(settings, store, timeout)
    decode = events.deserializer(store, expect="run_manifest")
    try:
        meta = consumer.list_topics(topics.RUNS_TOPIC, timeout=timeout).topics.get(
            topics.RUNS_TOPIC
        )
        if meta is None or meta.error is not None:
            return {}
        pending = set(meta.partitions)
        consumer.assign([TopicPartition(topics.RUNS_TOPIC, p, OFFSET_BEGINNING) for p in pending])
        latest: dict[str, dict[str, Any]] = {}
        while pending:
            msg = consumer.poll(timeout)
            if msg is None:
                break
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                continue
            key = (msg.key() or b"").decode(errors="replace")
            if msg.value() is None:
                latest.pop(key, None)  # a tombstone deletes the run's manifest
                continue
            try:
                latest[key] = decode(msg.value(), None).record
            except events.EventError:
                continue  # not ours to judge here; `rlstream dlq` is where bad records show
        return latest
    finally:
        consumer.close()


def latest_run(manifests: dict[str, dict[str, Any]]) -> str | None:
    """The run whose manifest was updated last; None when there is none."""
    if not manifests:
        return None
    return max(manifests.values(), key=lambda m: (int(m.get("updated_ms", 0)), m["run"]))["run"]


def measure_lag(admin: Any, run: str, timeout: float = 10.0) -> dict[str, dict[str, int]]:
    """Lag per topic of every consumer group of ``run`` that has committed offsets."""
    from rlstream.producers.admin import group_lag

    listing = admin.list_consumer_groups(request_timeout=timeout).result()
    groups = sorted(g.group_id for g in listing.valid if role_of_group(run, g.group_id))
    lags = {}
    for group in groups:
        lag = group_lag(admin, group, timeout)
        if lag:  # a group that never committed (a tap, a monitor) has no lag to show
            lags[group] = lag
    return lags

"""Read a run's streams for analytics: every partition, from the beginning, without a group.

Like ``rlstream run tap``, the reader assigns partitions itself and never commits, so watching
a run never moves a role's offsets, never shows up as a consumer group and never triggers a
rebalance. Topics are found by pattern (``ops.observe.analytics.run_topic_regex``): the run's local
streams and their MirrorMaker 2 copies ``REGION.rl.RUN.STREAM``. A reader either follows
(``pump``: it looks for new topics and partitions every ``refresh_s``, as a region's mirror may
appear mid-run) or reads to the end once (``read_to_end``, through the one read-to-end helper:
every partition up to the end it had when the pass started).

Run manifests (``rl.runs``) are not read here: the run log (``consumers.run_log``) reads them.

Records are decoded with the writer schema they name; a schema this code has never seen is
learned from ``rl.schemas`` (once per unknown fingerprint). Undecodable records are reported,
not dropped silently.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition

from rlstream.consumers.consumer import load_schema_topic
from rlstream.consumers.read_to_end import read_to_end, reader
from rlstream.ops.observe.analytics import role_of_group, run_topic_regex
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events

Sink = Callable[[str, dict[str, Any], int | None], None]
"""Called with (topic, decoded record, Kafka timestamp ms or None) for each record."""
ErrorSink = Callable[[str, str], None]
"""Called with (topic, reason) for each record that could not be decoded."""

_FETCH = {
    "max.partition.fetch.bytes": str(16 * 1024 * 1024),
    "fetch.max.bytes": str(64 * 1024 * 1024),
    "queued.max.messages.kbytes": str(64 * 1024),
}
#: ``read_to_end`` reports progress every this many records.
PROGRESS_EVERY = 500


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
        self.consumer = reader(settings, "analytics", **_FETCH)
        self.assigned: set[tuple[str, int]] = set()
        self._refreshed = 0.0
        self.records = 0

    def refresh(self) -> list[str]:
        """Assign new partitions of matching topics, from the beginning; returns new topics."""
        self._refreshed = time.monotonic()
        new_parts = [tp for tp in self._matching() if tp not in self.assigned]
        seen = {t for t, _ in self.assigned}
        new_topics = sorted({t for t, _ in new_parts} - seen)
        if new_parts:
            self.consumer.incremental_assign(
                [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in new_parts]
            )
            self.assigned.update(new_parts)
        return new_topics

    def _matching(self) -> list[tuple[str, int]]:
        """Every partition of the topics that match the run's pattern."""
        meta = self.consumer.list_topics(timeout=self.timeout).topics
        return [
            (topic, p)
            for topic, tmeta in sorted(meta.items())
            if tmeta.error is None and self.pattern.match(topic)
            for p in sorted(tmeta.partitions)
        ]

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
                if not (err.retriable() or err.code() in _BENIGN):
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
        """Read every matching partition from the beginning to its end; False if a pass read
        nothing for ``idle_s``.

        Each pass reads to the end as of its start (``read_to_end``); a pass that runs out of
        time having read something is followed by another from where it stopped."""
        positions = {tp: OFFSET_BEGINNING for tp in self._matching()}
        self.assigned.update(positions)
        while True:
            starts = [TopicPartition(t, p, off) for (t, p), off in positions.items()]
            before = self.records
            try:
                for msg in read_to_end(self.consumer, starts, idle_s):
                    positions[(str(msg.topic()), int(msg.partition() or 0))] = (
                        int(msg.offset() or 0) + 1
                    )
                    self.records += 1
                    self._deliver(msg, sink, on_error)
                    if progress and self.records % PROGRESS_EVERY == 0:
                        progress(self.records)
                return True
            except TimeoutError:
                if self.records == before:
                    return False

    def close(self) -> None:
        self.consumer.close()


_BENIGN = (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


def measure_lag(admin: Any, run: str, timeout: float = 10.0) -> dict[str, dict[str, int]]:
    """Lag per topic of every consumer group of ``run`` that has committed offsets."""
    from rlstream.producers.client.admin import group_lag

    listing = admin.list_consumer_groups(request_timeout=timeout).result()
    groups = sorted(g.group_id for g in listing.valid if role_of_group(run, g.group_id))
    lags = {}
    for group in groups:
        lag = group_lag(admin, group, timeout)
        if lag:  # a group that never committed (a tap, a monitor) has no lag to show
            lags[group] = lag
    return lags

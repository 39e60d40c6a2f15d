"""Read a topic (or some of its partitions) to its end as of the call: how every role catches up.

Roles rebuild state from the log before they act: admission the groups already decided, the
scheduler how many tasks it released, feedback-rl the ids it already decided, a weight follower
the manifests published so far, a tap or a report what a run holds. They all do it here, and
read single records by position (``read_at``: feedback-rl reading the completion a feedback
names) with the same kind of reader.

Rules:

- the end of each partition is fixed when the call starts (its high watermark then); records
  written afterwards are not waited for, so catching up always finishes on a live topic;
- only committed transactional data is read (``read_committed``): a partition is also done when
  the reader reaches its end of committed data (a transaction still open never holds it up);
- a reader assigns partitions itself: no consumer group, no commits, no rebalance of any role;
- the call raises ``TimeoutError`` if the end is not reached within ``timeout``: a caller never
  takes a partial read for the whole log;
- a reader still assigned from its last call is paused before the ends are asked for: a broker
  answers a connection's requests in order, so each end's query would otherwise wait behind
  the reader's idle long-poll fetch (``fetch.wait.max.ms``, 500 ms by default): measured 4.7 s
  for a 12-partition topic against 0.01 s paused, and the admission of every group waited for it.
  It is resumed once the ends are known (a pause would outlive the caller's next ``assign``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events

_READER = {
    "enable.auto.commit": "false",
    "enable.partition.eof": "true",
    "isolation.level": "read_committed",
    "auto.offset.reset": "earliest",
}
#: Errors a reader skips: the end of a partition is handled, a topic may appear later.
T = TypeVar("T")
#: Errors of a metadata or offset request that pass by themselves (leaders being elected).
_TRANSIENT = (
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    # The partition's leader left the metadata (a replica broker killed) while the request
    # waited for it: librdkafka drops that broker's handle; the next try asks the new leader.
    KafkaError._DESTROY_BROKER,
    # A new leader answers offset requests so until its high watermark has caught up (KIP-207),
    # a moment after a failover: a role's read of the manifests failed so in a fresh-clone run.
    KafkaError.OFFSET_NOT_AVAILABLE,
)
_SKIP = (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


def reader(settings: KafkaSettings, name: str, **overrides: str) -> Consumer:
    """A consumer that assigns partitions itself, never commits and reads committed data only.

    ``name`` only labels it (``group.id`` is required by the client but no group is joined)."""
    conf: dict[str, Any] = {**settings.librdkafka(), **_READER, "group.id": f"rlstream.{name}"}
    conf.update(overrides)
    return Consumer(conf)


def lookup_reader(settings: KafkaSettings, name: str) -> Consumer:
    """A ``reader`` for reads on demand (``read_at``, short catch-ups): its fetches wait at most
    20 ms for data at a partition's end, not librdkafka's 500 ms. A broker answers a
    connection's requests in order, so each read after the reader reached an end otherwise
    queued behind that idle long-poll: feedback-rl's lookups of served completions took about
    a second each (measured: 28 looked up in 41 s of a demo with editor feedback)."""
    return reader(settings, name, **{"fetch.wait.max.ms": "20"})


def partitions_of(consumer: Consumer, topic: str, timeout: float = 10.0) -> list[int] | None:
    """The partition ids of ``topic`` (None when the topic does not exist). A metadata request
    that times out while a broker fails over is asked again (``retrying``), and so is an answer
    whose topic carries a passing error (a topic created a moment ago whose leaders are not
    known yet): taken for "no topic", a feedback replica started on a new run followed no
    partition and never learned another replica's ids (seen in a fresh-clone run)."""

    def ask() -> list[int] | None:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None:
            return None
        if meta.error is not None:
            code = meta.error.code()
            if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                return None
            raise KafkaException(meta.error)  # retried by ``retrying`` if it passes by itself
        return sorted(meta.partitions)

    return retrying(ask)


def read_to_end(
    consumer: Consumer, partitions: Iterable[TopicPartition], timeout: float = 60.0
) -> Iterator[Message]:
    """Assign ``partitions`` (each from its offset, e.g. ``OFFSET_BEGINNING``) to ``consumer``
    and yield their records up to the end each had at the call (see the module rules).

    The consumer must report partition ends (``enable.partition.eof``, as ``reader`` does)."""
    starts = list(partitions)
    held = consumer.assignment()
    consumer.pause(held)  # no new fetch queues before the ends' queries
    try:
        remaining = {(tp.topic, tp.partition): end for tp, end in _ends(consumer, starts, timeout)}
    finally:
        consumer.resume(held)  # a pause outlives a later assign of the same partitions
    remaining = {tp: end for tp, end in remaining.items() if end is not None}
    if not remaining:
        return
    consumer.assign([tp for tp in starts if (tp.topic, tp.partition) in remaining])
    deadline = time.monotonic() + timeout
    while remaining:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sorted(remaining)} not read to their end in {timeout:.0f}s")
        msg = consumer.poll(0.2)
        if msg is None:
            continue
        tp = (str(msg.topic()), int(msg.partition() or 0))
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                remaining.pop(tp, None)
            elif err.code() not in _SKIP and not err.retriable():
                raise RuntimeError(f"reading {tp[0]}[{tp[1]}]: {err.str()}")
            continue
        end = remaining.get(tp)
        if end is None:
            continue  # past its end as of the call
        yield msg
        if int(msg.offset() or 0) + 1 >= end:
            remaining.pop(tp)


def read_topic(
    settings: KafkaSettings,
    topic: str,
    *,
    name: str,
    partitions: Iterable[int] | None = None,
    timeout: float = 60.0,
) -> Iterator[Message]:
    """Every record of ``topic`` (or of the given partitions) from the beginning to its end as
    of the call, with a reader of its own. A topic that does not exist yields nothing."""
    consumer = reader(settings, name)
    try:
        parts = list(partitions) if partitions is not None else partitions_of(consumer, topic)
        if parts:
            starts = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts]
            yield from read_to_end(consumer, starts, timeout)
    finally:
        consumer.close()


def read_at(
    consumer: Consumer, topic: str, partition: int, offset: int, timeout: float = 10.0
) -> dict[str, Any] | None:
    """The decoded record at one log position, or None if it is not there (or not decodable)."""
    consumer.assign([TopicPartition(topic, partition, offset)])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        if msg.error() is not None:
            return None  # end of partition (or an error) before the position: not there
        if msg.offset() != offset:
            return None  # the position was deleted or compacted away
        try:
            return events.decode(msg.value() or b"").record
        except events.EventError:
            return None
    return None


def retrying(call: Callable[[], T], timeout: float = 60.0) -> T:
    """``call()``, retried with a short backoff while it fails with a retriable Kafka error
    (a partition without a leader yet, just after its topic was created or after its leader
    died) for up to ``timeout``. A new leader is elected only once the controller has seen the
    dead broker's session expire (9 s by default) and the client has fresh metadata: measured
    over 15 s on a loaded 2-core machine, where a shorter wait made a role exit."""
    deadline, pause = time.monotonic() + timeout, 0.05
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0]
            transient = err.retriable() or err.code() in _TRANSIENT
            if not transient or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _ends(
    consumer: Consumer, starts: list[TopicPartition], timeout: float
) -> Iterator[tuple[TopicPartition, int | None]]:
    """Per partition, the offset to read up to; None when there is nothing to read from the
    start asked for (an empty partition, or a start at or past the end)."""
    for tp in starts:
        if tp.offset == OFFSET_END:
            yield tp, None
            continue
        where = TopicPartition(tp.topic, tp.partition)
        low, high = retrying(
            lambda: consumer.get_watermark_offsets(where, timeout=timeout, cached=False)  # noqa: B023 (called at once)
        )
        first = low if tp.offset < 0 else max(low, tp.offset)
        yield tp, (high if high > first else None)

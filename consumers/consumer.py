"""Role consumers: derived group ids, manual commits, read-committed, graceful stop.

Rules:
- the group id is derived (``rlstream.RUN.ROLE[.NAME]``), never typed by hand;
- auto-commit is off: a loop commits offsets after its effect (or inside its transaction);
- only committed transactional data is read (``isolation.level=read_committed``);
- SIGTERM and SIGINT set a stop flag; the loop finishes its batch, commits, and closes, which
  leaves the group at once so a rebalance hands its partitions over without waiting;
- a record that cannot be decoded goes to the dead-letter stream and the consumer goes on.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from rlstream.consumers.read_to_end import read_topic, reader
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.run_keys import RunKeys
from rlstream.schemas import events, topics

log = logging.getLogger(__name__)

CONSUMER_DEFAULTS = {
    "enable.auto.commit": "false",
    "enable.auto.offset.store": "false",
    "auto.offset.reset": "earliest",
    "isolation.level": "read_committed",
    "partition.assignment.strategy": "cooperative-sticky",
    "max.partition.fetch.bytes": str(16 * 1024 * 1024),
    "fetch.max.bytes": str(64 * 1024 * 1024),
    # Roles are static members (group.instance.id): a member that restarts takes its partitions
    # back at once, so a long session costs nothing there, and it lets a member ride out a
    # broker restart with its membership intact (a member whose session lapsed rejoins under a
    # new member id while its old one may still be in flight, and the broker fences it).
    "session.timeout.ms": "45000",
    "heartbeat.interval.ms": "1000",
}


_BENIGN = (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


class Stopper:
    """A stop flag set by SIGTERM/SIGINT (when installed) or by ``stop()``."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> Stopper:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._event.set())
        return self

    def stop(self) -> None:
        self._event.set()

    @property
    def stopped(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)


C = TypeVar("C")  # the role's config class (``ops.run.config``)


@dataclass(frozen=True)
class RoleContext(Generic[C]):
    """What ``rlstream run ROLE`` hands a role's entry point.

    Every role module exposes ``run_role(ctx: RoleContext)``, which runs the role until
    ``ctx.stopper`` is stopped (or its work is done) and returns what it did, for the log."""

    settings: KafkaSettings
    run: str
    cfg: C  # the role's config (``RunConfig.role``), validated
    stopper: Stopper
    member: str = "0"  # stable member name: static membership and transactional id
    name: str | None = None  # the judge's rubric name (judge role only)
    log: Callable[[str], None] = print
    region: str = "trainer"  # the region this role runs in; ``settings`` reach its cluster
    regions: topics.Regions = field(default_factory=topics.Regions)  # the run's regions
    keys: RunKeys = field(default_factory=RunKeys.from_env)  # the run's weight keys, as given

    def pattern(self, stream: str) -> str:
        """This role's subscription to ``stream``: the copies its region may read
        (``topics.Regions.sources``), never another region's cluster."""
        return self.regions.pattern(self.run, stream, self.region)


@dataclass
class Record:
    """A consumed record with its decoded event (None when it failed to decode)."""

    message: Message
    event: events.Decoded | None
    error: str | None = None
    reason: str | None = None  # a DeadLetter.reason symbol when decoding failed

    @property
    def key(self) -> bytes | None:
        return self.message.key()

    @property
    def topic_partition(self) -> tuple[str, int]:
        return str(self.message.topic()), int(self.message.partition() or 0)

    @property
    def offset(self) -> int:
        return int(self.message.offset() or 0)

    @property
    def position(self) -> tuple[str, int, int]:
        """(topic, partition, offset): where the record is in the log."""
        return (*self.topic_partition, self.offset)

    @property
    def value(self) -> dict[str, Any]:
        assert self.event is not None, self.error
        return self.event.record


def make_consumer(settings: KafkaSettings, group_id: str, **overrides: str) -> Consumer:
    conf: dict[str, Any] = {**settings.librdkafka(), **CONSUMER_DEFAULTS, "group.id": group_id}
    conf.update(overrides)
    return Consumer(conf)


class RoleConsumer:
    """A thin wrapper over ``Consumer`` that decodes events and batches polls."""

    def __init__(
        self,
        consumer: Consumer,
        topics: Iterable[str],
        store: events.SchemaStore | None = None,
        on_assign: Callable[[list[TopicPartition]], None] | None = None,
        on_revoke: Callable[[list[TopicPartition]], None] | None = None,
        settings: KafkaSettings | None = None,
    ) -> None:
        self._consumer = consumer
        self.store = store or events.default_store()
        self.decode = events.deserializer(self.store)
        self._settings = settings  # to learn unknown writer schemas from rl.schemas
        self._on_assign, self._on_revoke = on_assign, on_revoke
        consumer.subscribe(
            list(topics), on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked
        )

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._on_assign:
            self._on_assign(partitions)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._on_revoke:
            self._on_revoke(partitions)

    def poll_batch(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, decoded; partition EOFs and transient errors skipped."""
        # Block for the first record only, then take what is already fetched: a batch never
        # waits for ``max_records`` to arrive (consume(n, t) would, adding up to t of latency).
        first = self._consumer.poll(timeout)
        if first is None:
            return []
        messages = (
            [first, *self._consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]
        )
        batch = []
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.code() in _BENIGN or err.retriable():
                    continue  # a subscribed topic may be created (or mirrored) later
                raise RuntimeError(f"consumer error: {err.str()}")
            batch.append(self._decode(msg))
        return batch

    def _decode(self, msg: Message) -> Record:
        try:
            return Record(msg, self.decode(msg.value(), None))
        except events.DecodeError as exc:
            if exc.reason == "unknown_schema" and self._settings is not None:
                # Written by code we have never seen: learn its schema from rl.schemas, once.
                load_schema_topic(self._settings, self.store)
                try:
                    return Record(msg, self.decode(msg.value(), None))
                except events.EventError as again:
                    return Record(msg, None, str(again), again.reason)
            return Record(msg, None, str(exc), exc.reason)
        except events.EventError as exc:
            return Record(msg, None, str(exc), exc.reason)

    def commit(self, records: list[Record]) -> None:
        """Synchronously commit the offsets after ``records`` (their effect is done)."""
        if records:
            self._consumer.commit(offsets=next_offsets(records), asynchronous=False)

    def group_metadata(self) -> object:
        """The group's metadata, for committing offsets inside a producer's transaction."""
        return self._consumer.consumer_group_metadata()

    def committed(
        self, partitions: list[TopicPartition], timeout: float = 30.0
    ) -> list[TopicPartition]:
        """The group's committed offsets of ``partitions`` (negative where none yet)."""
        return list(self._consumer.committed(partitions, timeout=timeout))

    def rewind(self) -> None:
        """Seek every assigned partition back to its committed offset (the beginning where none
        is committed yet): after an aborted transaction, exactly the uncommitted records are
        read again."""
        assigned = self._consumer.assignment()
        if not assigned:
            return
        for tp in self.committed(assigned):
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    def close(self) -> None:
        self._consumer.close()


def next_offsets(records: Iterable[Record]) -> list[TopicPartition]:
    """The offset to resume from, per partition: one past the last record seen."""
    last: dict[tuple[str, int], int] = {}
    for rec in records:
        msg = rec.message
        tp = (str(msg.topic()), int(msg.partition() or 0))
        last[tp] = max(last.get(tp, -1), int(msg.offset() or 0))
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


def load_schema_topic(
    settings: KafkaSettings, store: events.SchemaStore, timeout: float = 30.0
) -> int:
    """Read every writer schema in ``rl.schemas`` and in its mirrored copies
    (``REGION.rl.schemas``, in a rollout region the trainer region's) into ``store``; returns
    how many records were read.

    A record that is no usable schema (not UTF-8, not an Avro schema, a key that is not its
    fingerprint) is skipped with a warning: it cannot describe any record, and a reader must not
    stop on it. This is how a consumer decodes records written by code it has never seen,
    wherever that code ran: schemas are keyed by fingerprint, so every copy is as good as the original. Only
    copies this client may see are listed (the broker filters metadata by ACL)."""
    count = 0
    for topic in schema_topics(settings):
        for msg in read_topic(settings, topic, name="schema-reader", timeout=timeout):
            value = msg.value()
            if value is None:
                continue
            try:
                store.add_record(msg.key() or b"", value)
            except (events.EventError, UnicodeDecodeError) as exc:
                # garbage in the schema log never stops a reader: skipped, said once per record
                where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
                log.warning("skipped an unusable writer schema at %s: %s", where, exc)
                continue
            count += 1
    return count


def schema_topics(settings: KafkaSettings, timeout: float = 10.0) -> list[str]:
    """``rl.schemas`` and the mirrored copies of it on the cluster (copies sorted by name)."""
    consumer = reader(settings, "schema-topics")
    try:
        names = consumer.list_topics(timeout=timeout).topics
    finally:
        consumer.close()
    copies = sorted(t for t in names if _is_schema_copy(t))
    return [topics.SCHEMAS_TOPIC, *copies]


def _is_schema_copy(topic: str) -> bool:
    try:
        name = topics.parse_topic(topic)
    except ValueError:
        return False
    return name.region is not None and name.stream == "schemas"

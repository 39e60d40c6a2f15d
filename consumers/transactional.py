"""Exactly-once consume-transform-produce: the loop the judges, admission, rollout workers and
feedback-rl share (the learner commits through the same producer transaction).

Each batch is one Kafka transaction holding its outputs, its dead letters and the consumer
offsets after it: all become visible or none does, so after any crash each input is reflected
in the output exactly once. The processor is a plain function ``records -> outputs``;
``on_abort`` and ``on_commit`` let it drop, or make permanent, the state a batch built.

Rules a maintainer must keep:
- poison records never stop the role: ``Refused`` is dead-lettered as ``invalid_record``; any
  other exception re-reads the batch in halves (a failing half is halved again, a passing one
  commits) down to the one record that fails, dead-lettered as ``processing_error``: a poison
  record in a batch of n costs about 2·log2(n) transactions, not n; only fatal Kafka errors
  (fenced) end the role;
- a batch is processed before its transaction begins, so a processor that raises never aborts a
  transaction (aborting right after producing can kill a librdkafka producer for good);
- ``close`` never raises and never commits.

Details: docs/streams.md (Consume-transform-produce).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from rlstream.consumers.consumer import Record, RoleConsumer, Stopper, make_consumer, next_offsets
from rlstream.consumers.dlq import dead_letter, dead_letter_headers
from rlstream.producers.client.producer import EventProducer, TransactionAborted
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime.metrics import LoopMetrics
from rlstream.schemas.errors import Refused

log = logging.getLogger(__name__)

#: Most poison positions remembered per member (each is skipped when read again).
MAX_POISON = 10_000


@dataclass
class Output:
    """One record to produce in the batch's transaction: an event, or raw bytes if ``raw``."""

    topic: str
    event: str | None
    value: Any
    key: str | bytes | None = None
    headers: Sequence[tuple[str, bytes]] = ()


Processor = Callable[[list[Record]], Iterable[Output]]


@dataclass
class LoopStats:
    batches: int = 0
    records: int = 0
    outputs: int = 0
    dead_letters: int = 0
    aborts: int = 0
    last_batch_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class TransactionalLoop:
    """Consume ``topics`` as ``group_id``; process; produce and commit in one transaction."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str,
        topics: Iterable[str],
        transactional_id: str,
        dlq_topic: str,
        process: Processor,
        on_abort: Callable[[], None] | None = None,
        on_commit: Callable[[], None] | None = None,
        on_assign: Callable[[list[TopicPartition]], None] | None = None,
        on_revoke: Callable[[list[TopicPartition]], None] | None = None,
        batch_size: int = 500,
        poll_timeout: float = 0.5,
        tick_commits: bool = False,
        instance_id: str | None = None,
        offsets: Callable[[list[Record]], list[TopicPartition]] | None = None,
        tick_s: float | None = None,
        consumer_conf: dict[str, str] | None = None,
    ) -> None:
        self.group_id, self.dlq_topic = group_id, dlq_topic
        self.process, self.on_abort, self.on_commit = process, on_abort, on_commit
        self.batch_size, self.poll_timeout = batch_size, poll_timeout
        self.tick_commits = tick_commits  # a tick's transaction sends ``offsets([])`` too
        # A stable instance id (static membership) lets a restarted member take its partitions
        # back at once instead of after the dead member's session times out.
        static = {"group.instance.id": instance_id} if instance_id else {}
        static.update(consumer_conf or {})
        self.consumer = RoleConsumer(
            make_consumer(settings, group_id, **static),
            topics,
            on_assign=on_assign,
            on_revoke=lambda parts: self._revoked(parts, on_revoke),
            settings=settings,
        )
        self.producer = EventProducer.transactional(settings, transactional_id)
        # ``offsets`` lets a stateful processor commit less than it read (e.g. admission keeps
        # pending groups re-readable); ``tick_s`` calls ``process([])`` when idle that often,
        # for time-based decisions.
        self.offsets = offsets or next_offsets
        self.tick_s, self._last_tick = tick_s, time.monotonic()
        self.stats = LoopStats()
        # Positions up to which records are read in probe batches of ``_probe`` (after a
        # failure), and the records known to fail: both only grow while a poison record is near.
        self._isolate: dict[tuple[str, int], int] = {}
        self._probe = batch_size
        self._poison: dict[tuple[str, int, int], str] = {}
        # Prometheus export of ``stats`` (off unless RLSTREAM_METRICS_PORT is set).
        self.metrics = LoopMetrics.for_loop(group_id)

    def run(self, stopper: Stopper, idle_exit_s: float | None = None) -> LoopStats:
        """Process batches until stopped (or idle for ``idle_exit_s``), then close cleanly."""
        idle_since = time.monotonic()
        try:
            while not stopper.stopped:
                consumed = self.run_once()
                self.metrics.observe(self.stats)
                if consumed:
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
        finally:
            self.close()
        return self.stats

    def run_once(self) -> int:
        """One batch: poll, transform, produce and commit atomically. Returns records consumed."""
        size = self._probe if self._isolate else self.batch_size
        records = self.consumer.poll_batch(size, self.poll_timeout)
        if not records:
            if self.tick_s is not None and time.monotonic() - self._last_tick >= self.tick_s:
                self._tick()
            return 0
        self._last_tick = time.monotonic()
        started = time.monotonic()
        self._passed(records)
        try:
            letters, outputs = self._process_batch(records)
        except KafkaException:
            raise  # a Kafka failure is no poison record: the role exits and is restarted
        except Exception as exc:
            self._failed(records, exc)
            return 0
        if not self.commit(lambda: self.produce(letters + outputs), records):
            return 0
        self.stats.dead_letters += len(letters)
        self.stats.outputs += len(outputs)
        self.stats.batches += 1
        self.stats.records += len(records)
        self.stats.last_batch_s = time.monotonic() - started
        return len(records)

    def commit(self, produce: Callable[[], None], records: list[Record] | None = None) -> bool:
        """Run ``produce`` in one transaction and commit it with the consumer offsets after
        ``records`` (``offsets(records)``; none when ``records`` is None). On an abort, rewind to
        the committed offsets, call ``on_abort`` and return False."""
        try:
            with self.producer.transaction() as txn:
                produce()
                if records is not None:
                    txn.send_offsets(self.offsets(records), self.consumer.group_metadata())
        except TransactionAborted:
            self.stats.aborts += 1
            self.consumer.rewind()
            if self.on_abort:
                self.on_abort()
            return False
        if self.on_commit:
            self.on_commit()
        return True

    def _tick(self) -> None:
        """Run ``process([])`` in a transaction of its own: outputs only, and with
        ``tick_commits`` the offsets ``offsets([])`` gives (a processor that holds records back
        commits them with the outputs it releases on a tick)."""
        self._last_tick = time.monotonic()
        outputs = list(self.process([]))
        if outputs and self.commit(
            lambda: self.produce(outputs), [] if self.tick_commits else None
        ):
            self.stats.outputs += len(outputs)

    def produce(self, outputs: list[Output]) -> None:
        """Produce ``outputs`` into the open transaction (call it inside ``commit``); the caller
        counts them in ``stats`` once the transaction committed."""
        for out in outputs:
            if out.event is None:
                self.producer.produce_raw(out.topic, out.value, out.key, out.headers)
            else:
                self.producer.produce(out.topic, out.event, out.value, out.key, out.headers)

    def _failed(self, records: list[Record], exc: Exception) -> None:
        """The processor raised (no transaction was begun): reset, and find the poison."""
        self.stats.aborts += 1
        self.consumer.rewind()
        if self.on_abort:
            self.on_abort()
        if len(records) == 1:
            rec = records[0]
            position = (*rec.topic_partition, rec.offset)
            self._probe = self.batch_size  # found: the rest is read whole (it is skipped there)
            self._poison[position] = f"{type(exc).__name__}: {exc}"
            while len(self._poison) > MAX_POISON:  # bounded: forget the oldest
                del self._poison[next(iter(self._poison))]
            log.warning("record %s/%s/%s fails processing, dead-lettered: %r", *position, exc)
            return
        self._probe = max(1, len(records) // 2)
        log.warning(
            "a batch of %d failed (%r): re-reading it %d record(s) at a time",
            len(records),
            exc,
            self._probe,
        )
        for rec in records:
            tp = rec.topic_partition
            self._isolate[tp] = max(self._isolate.get(tp, -1), rec.offset)

    def _revoked(
        self,
        partitions: list[TopicPartition],
        then: Callable[[list[TopicPartition]], None] | None,
    ) -> None:
        for tp in partitions:
            self._isolate.pop((tp.topic, tp.partition), None)
        if then is not None:
            then(partitions)

    def _passed(self, records: list[Record]) -> None:
        """Leave one-record mode for partitions read past the failed batch."""
        for rec in records:
            tp = rec.topic_partition
            if tp in self._isolate and rec.offset > self._isolate[tp]:
                del self._isolate[tp]

    def _process_batch(self, records: list[Record]) -> tuple[list[Output], list[Output]]:
        """The batch's dead letters (undecodable, refused and poison records) and outputs."""
        letters, good = [], []
        for rec in records:
            poison = self._poison.get((*rec.topic_partition, rec.offset))
            if rec.event is None:
                letters.append(self.dead_letter(rec, rec.reason or "other", rec.error or ""))
            elif poison is not None:
                letters.append(self.dead_letter(rec, "processing_error", poison))
            else:
                good.append(rec)
        try:
            outputs = list(self.process(good)) if good else []
        except Refused as refused:
            # Refusal of one record: dead-letter it and re-run the rest of the batch.
            letters.append(self.dead_letter(refused.record, "invalid_record", refused.reason))
            rest = [r for r in good if r is not refused.record]
            outputs = list(self.process(rest)) if rest else []
        return letters, outputs

    def dead_letter(self, rec: Record, reason: str, error: str) -> Output:
        """The dead-letter output for ``rec`` (a processor may return it among its outputs to
        refuse one record while keeping the state it built from the others)."""
        return Output(
            self.dlq_topic,
            "dead_letter",
            dead_letter(rec.message, reason, error, self.group_id),
            rec.message.topic(),
            dead_letter_headers(rec.message, reason, error),
        )

    def close(self) -> None:
        """Wait for the producer's deliveries, then leave the group; never raises (see the
        module docstring)."""
        try:
            queued = self.producer.wait(10)
            if queued:
                log.warning("closing with %d record(s) undelivered", queued)
        except KafkaException as exc:
            # e.g. a fatal error (fenced, or librdkafka's INVALID_TXN_STATE): whatever it left
            # open is never committed; the error that ended the role, if any, is already raised
            log.warning("producer closed in an error state: %s", exc.args[0])
        try:
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("consumer closed with an error: %s", exc)

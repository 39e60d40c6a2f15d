"""Producers: idempotent, acks=all, zstd; delivery failures surfaced; flushed on shutdown.

``EventProducer`` wraps a confluent-kafka ``Producer`` thinly and keeps it private: it serializes
events with the schema codec, makes sure each writer schema it uses is in ``rl.schemas`` before
the first record that names it, and raises ``DeliveryError`` from ``flush`` if any record was not
acknowledged.

It is the one owner of Kafka transactions: every transactional writer (the exactly-once loop,
feedback-rl, the learner, the weight publisher) writes inside ``with producer.transaction()``.
A producer made by ``connect`` or ``transactional`` knows its settings: ``non_transactional``
makes a plain (idempotent, acks=all) producer with the same settings and credentials, for
records that must be durable before a transaction opens rather than inside it (weight chunks).
Rules of a transaction:

- it begins on entry and commits on a clean exit, together with the consumer offsets handed to
  ``Transaction.send_offsets`` (consume-transform-produce) if any;
- when the broker says the transaction must be aborted (a retriable failure), it is aborted and
  ``TransactionAborted`` is raised: nothing of it became visible, and the caller rewinds to its
  committed state and tries again;
- a retriable error of a transactional call (init, offsets, commit, abort: a timeout, a
  coordinator moving) is retried with exponential backoff and jitter, up to ``RETRIES`` times;
- any other exception, a non-fatal Kafka error included, aborts it as well (a failed abort is
  logged) and propagates;
- a fatal error (fenced by a newer instance of the same transactional id) propagates as the
  ``KafkaException`` it is: the role must exit;
- a transactional call that blocks past ``hung_call_exit_s`` (``HungCall``) is left to its
  thread; a new instance of the same transactional id replaces the producer (its
  ``init_transactions`` fences the stuck one) and ``TransactionAborted`` is raised. Past
  ``MAX_REPLACEMENTS``, or when the new instance blocks too, the process exits (``HUNG_EXIT_CODE``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics
from rlstream.schemas.errors import RlstreamError

#: Settings every rlstream producer has; callers may add, not weaken.
PRODUCER_DEFAULTS = {
    "enable.idempotence": "true",
    "acks": "all",
    "compression.type": "zstd",
    "linger.ms": "5",
    "message.max.bytes": str(16 * 1024 * 1024),
    "max.in.flight.requests.per.connection": "5",
}

Headers = Sequence[tuple[str, bytes]]
DeliveryCallback = Callable[[KafkaError | None, Message], None]

log = logging.getLogger(__name__)


class DeliveryError(RlstreamError, RuntimeError):
    """One or more records were not acknowledged by the broker."""


RETRIES = 5


class HungCall(RlstreamError, RuntimeError):
    """A Kafka call blocked past its limit; it goes on in a thread of its own, its result unused."""


def retry_retriable(call: Callable[[], Any], what: str, hung_after: float | None = None) -> Any:
    """``call()``, retried with exponential backoff and jitter while it raises a retriable
    ``KafkaException`` that does not require an abort (at most ``RETRIES`` attempts).

    ``hung_after`` (a supervised role's ``KafkaSettings.hung_call_exit_s``): an attempt that blocks
    longer raises ``HungCall`` (the call runs in a thread of its own: a thread blocked in C
    cannot be interrupted, so it is left behind). librdkafka's ``send_offsets_to_transaction`` has
    been seen to block for good after its broker was killed and restarted (librdkafka #5456,
    #5511); ``EventProducer.transaction`` then replaces the producer. The limit is per attempt:
    a call that times out after its own ``timeout`` and is retried is slow, not hung."""
    for attempt in range(RETRIES):
        try:
            return _bounded(call, what, hung_after)
        except KafkaException as exc:
            err = exc.args[0]
            if not err.retriable() or err.txn_requires_abort() or attempt == RETRIES - 1:
                raise
            delay = min(2.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning("%s: %s; retrying in %.2fs", what, err.str(), delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


HUNG_EXIT_CODE = 75


#: Producers a process replaces after hung calls before it exits instead (each replaced one
#: leaves a thread blocked in librdkafka behind).
MAX_REPLACEMENTS = 3


def _bounded(call: Callable[[], Any], what: str, limit: float | None) -> Any:
    """``call()``, or ``HungCall`` when it has not returned after ``limit`` seconds."""
    if limit is None:
        return call()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"kafka {what}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise HungCall(f"{what} blocked for {limit:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _exit_hung(why: str) -> NoReturn:
    print(f"{why}; exiting so that the role restarts", flush=True)
    os._exit(HUNG_EXIT_CODE)


class TransactionAborted(RlstreamError, RuntimeError):
    """The broker required the transaction to abort, and it was: nothing of it is visible."""


class Transaction:
    """The open transaction inside ``EventProducer.transaction()``."""

    def __init__(self, producer: Producer, timeout: float, hung_after: float | None) -> None:
        self._producer, self._timeout, self._hung_after = producer, timeout, hung_after

    def send_offsets(self, offsets: Sequence[TopicPartition], group_metadata: object) -> None:
        """Commit these consumer offsets (of the group ``group_metadata`` names) with it."""
        if offsets:
            retry_retriable(
                lambda: self._producer.send_offsets_to_transaction(
                    list(offsets), group_metadata, self._timeout
                ),
                "send offsets",
                self._hung_after,
            )


def make_producer(
    settings: KafkaSettings, transactional_id: str | None = None, **overrides: str
) -> Producer:
    conf: dict[str, Any] = {**settings.librdkafka(), **PRODUCER_DEFAULTS, **overrides}
    if transactional_id:
        conf["transactional.id"] = transactional_id
        conf.setdefault("transaction.timeout.ms", "60000")
    return Producer(conf)


class EventProducer:
    """Produces schema-tagged events; see the module docstring for its guarantees."""

    def __init__(self, producer: Producer, store: events.SchemaStore | None = None) -> None:
        self._producer = producer
        self.store = store or events.default_store()
        self._serializers: dict[str, Any] = {}
        self._announced: set[bytes] = set()
        self._errors: list[str] = []
        # how it was made (``connect``/``transactional``), for ``non_transactional``
        self._origin: tuple[KafkaSettings, dict[str, str]] | None = None
        self._hung_after: float | None = None  # the settings' ``hung_call_exit_s``
        self._transactional_id: str | None = None
        self.replacements = 0  # producers replaced after a hung call (module rules)

    @classmethod
    def connect(cls, settings: KafkaSettings, **overrides: str) -> EventProducer:
        out = cls(make_producer(settings, **overrides))
        out._origin, out._hung_after = (settings, overrides), settings.hung_call_exit_s
        return out

    @classmethod
    def transactional(
        cls, settings: KafkaSettings, transactional_id: str, timeout: float = 60.0, **overrides: str
    ) -> EventProducer:
        """A producer with ``transactional_id``, initialised: fences any older instance of the
        id and aborts the transaction it left open."""
        producer = make_producer(settings, transactional_id=transactional_id, **overrides)
        retry_retriable(lambda: producer.init_transactions(timeout), "init transactions")
        out = cls(producer)
        out._origin, out._hung_after = (settings, overrides), settings.hung_call_exit_s
        out._transactional_id = transactional_id
        return out

    def non_transactional(self) -> EventProducer:
        """A new non-transactional producer with this one's settings, credentials, overrides
        (less the transactional ones) and schema store: idempotent and acks=all like every
        rlstream producer, its records visible once acknowledged, never fenced or aborted."""
        if self._origin is None:
            raise ValueError("made without settings (not by connect or transactional)")
        settings, overrides = self._origin
        plain = {k: v for k, v in overrides.items() if not k.startswith("transaction")}
        out = EventProducer(make_producer(settings, **plain), self.store)
        out._origin = (settings, plain)
        return out

    @contextlib.contextmanager
    def transaction(self, timeout: float = 60.0) -> Iterator[Transaction]:
        """Begin, yield, commit (see the module's rules of a transaction)."""
        self._producer.begin_transaction()
        try:
            yield Transaction(self._producer, timeout, self._hung_after)
            retry_retriable(
                lambda: self._producer.commit_transaction(timeout), "commit", self._hung_after
            )
        except KafkaException as exc:
            err = exc.args[0]
            if err.fatal():
                raise  # e.g. fenced by a newer instance: the role must exit
            if not err.txn_requires_abort():
                self._abort_quietly(timeout)  # never leave the transaction open behind an error
                raise
            log.warning("transaction aborted: %s", err.str())
            retry_retriable(lambda: self._producer.abort_transaction(timeout), "abort")
            raise TransactionAborted(err.str()) from exc
        except HungCall as exc:  # never call the stuck producer again: replace it
            self._replace(str(exc), timeout)
            raise TransactionAborted(f"{exc}: the producer was replaced") from exc
        except BaseException:
            self._abort_quietly(timeout)
            raise

    def _replace(self, why: str, timeout: float) -> None:
        """A new producer of the same transactional id in place of the stuck one, whose open
        transaction the new one's ``init_transactions`` fences and aborts (module rules)."""
        if self._origin is None or self._transactional_id is None:
            _exit_hung(why)
        self.replacements += 1
        if self.replacements > MAX_REPLACEMENTS:
            _exit_hung(f"{why} ({MAX_REPLACEMENTS} producers replaced already)")
        assert self._origin is not None and self._transactional_id is not None
        settings, overrides = self._origin
        log.warning("%s: replacing the producer (fencing the stuck one)", why)
        fresh = make_producer(settings, transactional_id=self._transactional_id, **overrides)
        # a new instance waits for a coordinator that is still loading, which may take longer
        # than a call of a settled producer may: its limit is the call's own timeout, and more
        limit = None if self._hung_after is None else self._hung_after + 2 * timeout
        try:
            retry_retriable(lambda: fresh.init_transactions(timeout), "init", limit)
        except HungCall as exc:
            _exit_hung(f"{why}, and its replacement's {exc}")
        self._producer = fresh

    def _abort_quietly(self, timeout: float) -> None:
        """Abort the open transaction after another error, which is the one raised; a failed
        abort is logged (a fatal one shows again at the producer's next call)."""
        try:
            self._producer.abort_transaction(timeout)
        except KafkaException as exc:
            log.warning("abort after an error failed: %s", exc.args[0].str())

    def produce(
        self,
        topic: str,
        event: str,
        record: Mapping[str, Any],
        key: str | bytes | None = None,
        headers: Headers | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        """Produce ``record`` as ``event`` (``on_delivery``: see ``produce_raw``)."""
        value = self._serializer(event)(record, None)
        self.produce_raw(topic, value, key, headers, on_delivery)

    def produce_raw(
        self,
        topic: str,
        value: bytes | None,
        key: str | bytes | None = None,
        headers: Headers | None = None,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
    ) -> None:
        """Produce already-encoded bytes (None: a tombstone), waiting for queue space when the
        local buffer is full; to ``partition``, or (None) the one the key hashes to.

        With ``on_delivery`` the caller handles the record's delivery report (and its failure)
        itself; ``flush`` then does not report it."""
        while True:
            try:
                self._producer.produce(
                    topic,
                    value,
                    key,
                    partition=-1 if partition is None else partition,  # -1: by the key
                    headers=list(headers or []),
                    on_delivery=on_delivery or self._on_delivery,
                )
                return
            except BufferError:
                self._producer.poll(0.1)

    def partitions(self, topic: str, timeout: float = 10.0) -> int:
        """How many partitions ``topic`` has (from the cluster's metadata)."""
        meta = self._producer.list_topics(topic, timeout=timeout).topics[topic]
        if meta.error is not None:
            raise KafkaException(meta.error)
        return len(meta.partitions)

    def _serializer(self, event: str) -> Any:
        if event not in self._serializers:
            fingerprint, _ = self.store.current(event)
            self.announce_schema(fingerprint)
            self._serializers[event] = events.serializer(event, self.store)
        return self._serializers[event]

    def announce_schema(self, fingerprint: bytes) -> None:
        """Put a writer schema into the compacted ``rl.schemas`` topic (once per process)."""
        if fingerprint in self._announced:
            return
        schema_json = self.store.canonical(fingerprint) or ""
        self.produce_raw(topics.SCHEMAS_TOPIC, schema_json.encode(), fingerprint.hex())
        self._announced.add(fingerprint)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._errors.append(f"{msg.topic()}: {err.str()}")

    def poll(self, timeout: float = 0.0) -> None:
        self._producer.poll(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait up to ``timeout`` for every delivery report; returns how many are still queued."""
        return int(self._producer.flush(timeout))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every record; raise ``DeliveryError`` if any failed or is still queued."""
        remaining = self._producer.flush(timeout)
        errors, self._errors = self._errors, []
        if remaining:
            errors.append(f"{remaining} record(s) still queued after {timeout:.0f}s")
        if errors:
            raise DeliveryError("; ".join(errors[:5]) + (" ..." if len(errors) > 5 else ""))

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

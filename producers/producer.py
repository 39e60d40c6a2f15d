"""Producers: idempotent, acks=all, zstd; delivery failures surfaced; flushed on shutdown.

``EventProducer`` wraps a confluent-kafka ``Producer`` thinly: it serializes events with the
schema codec, makes sure each writer schema it uses is in ``rl.schemas`` before the first record
that names it, and raises ``DeliveryError`` from ``flush`` if any record was not acknowledged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import events, topics

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


class DeliveryError(RuntimeError):
    """One or more records were not acknowledged by the broker."""


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
        self.producer = producer
        self.store = store or events.default_store()
        self._serializers: dict[str, Any] = {}
        self._announced: set[bytes] = set()
        self._errors: list[str] = []

    @classmethod
    def connect(cls, settings: KafkaSettings, **overrides: str) -> EventProducer:
        return cls(make_producer(settings, **overrides))

    def produce(
        self,
        topic: str,
        event: str,
        record: Mapping[str, Any],
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> None:
        value = self._serializer(event)(record, None)
        self.produce_raw(topic, value, key, headers)

    def produce_raw(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> None:
        """Produce already-encoded bytes, waiting for queue space when the local buffer is full."""
        while True:
            try:
                self.producer.produce(
                    topic, value, key, headers=list(headers or []), on_delivery=self._on_delivery
                )
                return
            except BufferError:
                self.producer.poll(0.1)

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
        self.producer.poll(timeout)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every record; raise ``DeliveryError`` if any failed or is still queued."""
        remaining = self.producer.flush(timeout)
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

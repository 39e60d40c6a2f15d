"""Writing a version's chunks: with the chunk producer (idempotent, acks=all, outside any
transaction), each at the partition the placement rule gave it, and waiting for the broker's
acknowledgements, whose log positions go into the manifest (``producers.weights.publisher``
states why the manifest comes after them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, Message

from rlstream.producers.client.producer import DeliveryError, EventProducer
from rlstream.schemas import topics
from rlstream.schemas.deltacodec.wire import Ref


def write_chunks(
    producer: EventProducer,
    topic: str,
    items: Sequence[tuple[Any, dict[str, Any], int]],
    serialize: Callable[[Any, Any], bytes],
    timeout: float,
    what: str,
) -> dict[Any, Ref]:
    """Produce ``(slot, record, partition)`` chunk records and wait for the broker's
    acknowledgements; their refs by slot, or ``DeliveryError`` naming ``what`` (a record over
    the chunk topic's limit: ``ValueError``, before anything is sent)."""
    limit = topics.STREAMS["weights.chunks"].max_value_bytes
    producer.announce_schema(producer.store.current("weight_chunk")[0])
    refs: dict[Any, Ref] = {}
    errors: list[str] = []
    for slot, rec, part in items:
        value = serialize(rec, None)
        if len(value) > limit:
            raise ValueError(f"chunk record of {len(value)} bytes > {limit}")
        key = topics.record_key("weights.chunks", rec)
        on_delivery = _on_ref(refs, slot, errors)
        producer.produce_raw(topic, value, key, on_delivery=on_delivery, partition=part)
    try:
        producer.flush(timeout)  # the chunks, and the schema record before them
    except DeliveryError as exc:
        errors.append(str(exc))
    missing = len(items) - len(refs)
    if errors or missing:
        detail = "; ".join(errors[:3]) or f"{missing} chunk(s) unacknowledged"
        raise DeliveryError(f"weight chunks of {what} not written: {detail}")
    return refs


def _on_ref(into: dict[Any, Ref], slot: Any, errors: list[str]) -> Callable[..., None]:
    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(f"chunk {slot}: {err.str()}")
        else:
            into[slot] = (msg.topic() or "", msg.partition() or 0, msg.offset() or 0)

    return on_delivery

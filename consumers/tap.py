"""Tap: read any stream without joining a role's group or committing anything.

A tap assigns every partition itself (no consumer group, no commits), so watching a stream
never moves a role's offsets or triggers a rebalance. Records are decoded with the writer
schema they name; raw array fields are shown as numbers (numpy views, no Python loop to decode).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    Message,
    TopicPartition,
)

from rlstream.consumers.consumer import load_schema_topic
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import arrays, events

_ARRAY_DTYPES = {
    "token_ids": arrays.TOKEN_DTYPE,
    "logprobs": arrays.LOGPROB_DTYPE,
    "loss_mask": arrays.MASK_DTYPE,
    "routed_experts": arrays.EXPERT_DTYPE,
}


def tap(
    settings: KafkaSettings,
    topic: str,
    follow: bool = False,
    from_end: bool = False,
    limit: int | None = None,
    idle_s: float = 2.0,
) -> Iterator[tuple[Message, events.Decoded | None, str | None]]:
    """Yield (message, decoded or None, error or None) from every partition of ``topic``.

    Without ``follow`` it stops once every partition reached its end as of the start.
    """
    store = events.SchemaStore()
    load_schema_topic(settings, store)
    decode = events.deserializer(store)
    consumer = Consumer(
        {
            **settings.librdkafka(),
            "group.id": "rlstream.tap",
            "enable.auto.commit": "false",
            "enable.partition.eof": "true",
            "isolation.level": "read_committed",
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            raise SystemExit(f"error: topic {topic} does not exist")
        start = OFFSET_END if from_end else OFFSET_BEGINNING
        consumer.assign([TopicPartition(topic, p, start) for p in meta.partitions])
        yield from _drain(consumer, decode, set(meta.partitions), follow, limit, idle_s)
    finally:
        consumer.close()


def _drain(
    consumer: Consumer,
    decode: Any,
    open_parts: set[int],
    follow: bool,
    limit: int | None,
    idle_s: float,
) -> Iterator[tuple[Message, Any, str | None]]:
    seen, last = 0, time.monotonic()
    while (follow or open_parts) and (limit is None or seen < limit):
        msg = consumer.poll(0.5)
        if msg is None:
            if not follow and time.monotonic() - last > idle_s:
                return
            continue
        last = time.monotonic()
        if (err := msg.error()) is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                open_parts.discard(msg.partition())
            continue
        seen += 1
        try:
            yield msg, decode(msg.value(), None), None
        except events.EventError as exc:
            yield msg, None, f"{exc.reason}: {exc}"


def jsonable(value: Any, field: str = "", full: bool = True) -> Any:
    """A JSON-friendly copy of a decoded record: array fields as numbers, other bytes base64."""
    if isinstance(value, dict):
        return {k: jsonable(v, k, full) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v, field, full) for v in value]
    if isinstance(value, bytes):
        if field in _ARRAY_DTYPES and len(value) % _ARRAY_DTYPES[field].itemsize == 0:
            numbers = np.frombuffer(value, _ARRAY_DTYPES[field])
            if not full and numbers.size > 16:
                return f"<{numbers.size} x {_ARRAY_DTYPES[field].name}: {numbers[:8].tolist()} ...>"
            return numbers.tolist()
        text = base64.b64encode(value).decode()
        return text if full or len(text) <= 64 else f"<{len(value)} bytes>"
    return value

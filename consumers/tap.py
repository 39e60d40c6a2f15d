"""Tap: read any stream without joining a role's group or committing anything.

A tap assigns every partition itself (no consumer group, no commits), so watching a stream
never moves a role's offsets or triggers a rebalance. Records are decoded with the writer
schema they name; raw array fields are shown as numbers (numpy views, no Python loop to decode).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, Message, TopicPartition

from rlstream.consumers.consumer import load_schema_topic
from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import arrays, events

_ARRAY_DTYPES: dict[str, np.dtype[Any]] = {
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
) -> Iterator[tuple[Message, events.Decoded | None, str | None]]:
    """Yield (message, decoded or None, error or None) from every partition of ``topic``.

    Without ``follow`` it stops once every partition reached its end as of the start.
    """
    store = events.SchemaStore()
    load_schema_topic(settings, store)
    decode = events.deserializer(store)
    consumer = reader(settings, "tap")
    try:
        parts = partitions_of(consumer, topic)
        if parts is None:
            raise SystemExit(f"error: topic {topic} does not exist")
        start = OFFSET_END if from_end else OFFSET_BEGINNING
        assigned = [TopicPartition(topic, p, start) for p in parts]
        messages = _follow(consumer, assigned) if follow else read_to_end(consumer, assigned)
        for seen, msg in enumerate(messages):
            if limit is not None and seen >= limit:
                return
            try:
                yield msg, decode(msg.value(), None), None
            except events.EventError as exc:
                yield msg, None, f"{exc.reason}: {exc}"
    finally:
        consumer.close()


def _follow(consumer: Consumer, assigned: list[TopicPartition]) -> Iterator[Message]:
    """Every record of the assigned partitions, waiting for new ones without end."""
    consumer.assign(assigned)
    while True:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            yield msg


def jsonable(
    value: Any, field: str = "", full: bool = True, dtypes: dict[str, np.dtype[Any]] | None = None
) -> Any:
    """A JSON-friendly copy of a decoded record: array fields as numbers (expert ids at the
    record's ``expert_bytes`` width), other bytes base64."""
    dtypes = _ARRAY_DTYPES if dtypes is None else dtypes
    if isinstance(value, dict):
        if value.get("expert_bytes") is not None:
            width = arrays.record_expert_bytes(value)
            dtypes = {**dtypes, "routed_experts": arrays.expert_dtype(width)}
        return {k: jsonable(v, k, full, dtypes) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v, field, full, dtypes) for v in value]
    if isinstance(value, bytes):
        dtype = dtypes.get(field)
        if dtype is not None and len(value) % dtype.itemsize == 0:
            numbers = np.frombuffer(value, dtype)
            if not full and numbers.size > 16:
                return f"<{numbers.size} x {dtype.name}: {numbers[:8].tolist()} ...>"
            return numbers.tolist()
        text = base64.b64encode(value).decode()
        return text if full or len(text) <= 64 else f"<{len(value)} bytes>"
    return value

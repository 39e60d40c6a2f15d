"""The dead-letter stream: records that could not be decoded or validated, kept with the reason.

A dead letter holds the original key, value and headers untouched, so it can be inspected or
re-driven; the reason (a ``DeadLetter.reason`` symbol), the error text, and the source topic,
partition and offset are in the record and repeated in headers for tools that read no Avro.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from rlstream.schemas import events

HEADER_REASON = "rlstream.dlq.reason"
HEADER_ERROR = "rlstream.dlq.error"
HEADER_SOURCE = "rlstream.dlq.source"


def dead_letter(msg: Message, reason: str, error: str, group: str = "") -> dict[str, Any]:
    """The ``dead_letter`` event for ``msg``: where it came from, why, and its original bytes."""
    kind, stamp = msg.timestamp()
    fingerprint = events.fingerprint_of(msg.value())
    return {
        "source_topic": msg.topic(),
        "partition": msg.partition(),
        "offset": msg.offset(),
        "key": msg.key(),
        "value": msg.value() or b"",
        "headers": [{"key": h[0], "value": h[1]} for h in (msg.headers() or [])],
        "timestamp_ms": None if kind == TIMESTAMP_NOT_AVAILABLE else stamp,
        "reason": reason,
        "error": error[:4000],
        "failed_ms": int(time.time() * 1000),
        "consumer_group": group,
        "fingerprint": fingerprint.hex() if fingerprint else None,
        "attempts": 1,
    }


def dead_letter_at(
    topic: str, partition: int, offset: int, reason: str, error: str, group: str = ""
) -> dict[str, Any]:
    """A dead letter naming a record by its position only (its bytes stay in the source topic,
    e.g. the admitted stream, which is kept forever): for a role that no longer holds them."""
    return {
        "source_topic": topic,
        "partition": partition,
        "offset": offset,
        "key": None,
        "value": b"",
        "headers": [],
        "timestamp_ms": None,
        "reason": reason,
        "error": error[:4000],
        "failed_ms": int(time.time() * 1000),
        "consumer_group": group,
        "fingerprint": None,
        "attempts": 1,
    }


def dead_letter_headers(msg: Message, reason: str, error: str) -> list[tuple[str, bytes]]:
    source = f"{msg.topic()}/{msg.partition()}/{msg.offset()}"
    return [
        (HEADER_REASON, reason.encode()),
        (HEADER_ERROR, error.encode()[:1000]),
        (HEADER_SOURCE, source.encode()),
    ]

"""feedback-ingest deduplication: the feedback ids the broker acknowledged recently.

A retried request is stored once: the service answers ``duplicate`` for an id its ``Dedupe``
contains, without writing again (see ``producers.feedback.service`` for the in-flight half).
``IdempotencyLRU`` is the memory of one process; ``consumers.feedback.seen.FeedbackIdLog``
fills one from the feedback stream itself, so it survives restarts and is shared by replicas.

Namespaces (rule): a feedback id is an id *of the client that sent it*, the credential that
authenticated the request (``principal_of_token``, ``principal_of_key``). Every deduplication,
here and in feedback-rl, is by ``dedupe_key(principal, feedback id)``, so one client can never
claim, or make a duplicate of, another client's ids. The principal travels with each stored
record in its ``feedback_client`` header (next to ``feedback_id``), which is how the stream-backed
dedupe and feedback-rl read it back durably; a record without it (written before namespaces, or
by a tool) is in the empty namespace.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

ID_HEADER = "feedback_id"
CLIENT_HEADER = "feedback_client"


def principal_of_token(token: bytes) -> str:
    """The namespace of a bearer token: a prefix of its SHA-256 (the token itself is never
    stored)."""
    return "token:" + hashlib.sha256(token).hexdigest()[:16]


def principal_of_key(key_id: str) -> str:
    """The namespace of an HMAC key id."""
    return f"key:{key_id}"


def dedupe_key(principal: str, feedback_id: str) -> str:
    """The id deduplication compares: unique per (principal, feedback id), since a feedback id
    holds no space (``models``) and the principal comes first."""
    return f"{principal} {feedback_id}" if principal else feedback_id


def record_headers(principal: str, feedback_id: str) -> list[tuple[str, bytes]]:
    """The headers a stored feedback record carries (see the namespace rule)."""
    return [(ID_HEADER, feedback_id.encode()), (CLIENT_HEADER, principal.encode())]


Headers = Mapping[str, Any] | Sequence[tuple[str, Any]] | None
"""A record's headers as the Kafka client gives them (pairs, or a mapping)."""


def _header(headers: Headers, name: str) -> str | None:
    pairs = headers.items() if isinstance(headers, Mapping) else headers or []
    for key, value in pairs:
        if key == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def client_of_headers(headers: Headers) -> str:
    """The client namespace a stored record names (``""`` without a ``feedback_client``)."""
    return _header(headers, CLIENT_HEADER) or ""


def key_of_headers(headers: Headers) -> str | None:
    """The dedupe key of a stored record from its headers (None without ``feedback_id``)."""
    fid = _header(headers, ID_HEADER)
    return None if fid is None else dedupe_key(client_of_headers(headers), fid)


class Dedupe(Protocol):
    """The ids a feedback service answers as duplicates."""

    def __contains__(self, feedback_id: object) -> bool: ...

    def add(self, feedback_id: str, age_s: float = 0.0) -> None: ...


class IdempotencyLRU:
    """Feedback ids acknowledged by the broker within the last ``window_s`` seconds.

    Rule: an id is a duplicate while it is younger than ``window_s`` and among the newest
    ``max_ids`` ids; older ids are forgotten (downstream, the request-id key and the feedback id
    in each record still let consumers spot a late retry). Not thread-safe: one event loop owns it.
    """

    def __init__(
        self, window_s: float, max_ids: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s, self.max_ids, self._clock = window_s, max_ids, clock
        self._ids: OrderedDict[str, float] = OrderedDict()

    def _expire(self, now: float) -> None:
        while self._ids:
            oldest, at = next(iter(self._ids.items()))
            if now - at < self.window_s and len(self._ids) <= self.max_ids:
                return
            del self._ids[oldest]

    def __contains__(self, feedback_id: object) -> bool:
        self._expire(self._clock())
        return feedback_id in self._ids

    def add(self, feedback_id: str, age_s: float = 0.0) -> None:
        """Remember ``feedback_id`` as acknowledged ``age_s`` seconds ago (refreshes an id
        already known). Ids are expected in about the order they were acknowledged."""
        now = self._clock()
        self._ids[feedback_id] = now - max(0.0, age_s)
        self._ids.move_to_end(feedback_id)
        self._expire(now)

    def __len__(self) -> int:
        return len(self._ids)

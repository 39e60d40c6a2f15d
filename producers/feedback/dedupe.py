"""feedback-ingest deduplication: the feedback ids the broker acknowledged recently.

A retried request is stored once: the service answers ``duplicate`` for an id its ``Dedupe``
contains, without writing again (see ``producers.feedback.service`` for the in-flight half).
``IdempotencyLRU`` is the memory of one process; ``consumers.feedback.seen.FeedbackIdLog``
fills one from the feedback stream itself, so it survives restarts and is shared by replicas.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


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

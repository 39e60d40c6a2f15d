"""feedback-ingest's load limits: per-client rate, and the bounded queue of bodies to parse.

Rules (pure, no socket: the service in ``producers.feedback.service`` applies them):

- rate: each client principal (``dedupe.principal_of_*``) has a token bucket of ``burst``
  requests refilled at ``rate_per_s``; a request that finds it empty is refused 429 with
  ``Retry-After`` = the whole seconds until the next token. A request is charged to a client
  only once its credential is proven, so nobody can spend another client's budget with forged
  requests. At most ``max_clients`` buckets are kept (the least recently used goes: a forgotten
  client starts full again, which only errs towards letting a request in);
- parse queue: bodies parsed off the event loop wait in a queue of at most ``bound`` (those
  being parsed included); a request that would exceed it is refused 503 with ``Retry-After``
  before its body is read, so memory held by waiting bodies is bounded by ``bound`` times the
  largest body.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimiter:
    """Token buckets per client principal (see the module rules). One event loop owns it."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        max_clients: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or max_clients < 1:
            raise ValueError("rate_per_s > 0, burst >= 1 and max_clients >= 1 are required")
        self.rate, self.burst, self.max_clients, self._clock = rate_per_s, burst, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def take(self, principal: str) -> int | None:
        """Charge one request to ``principal``: None when allowed, else the seconds to wait."""
        now = self._clock()
        tokens, at = self._buckets.pop(principal, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[principal] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        if allowed:
            return None
        return max(1, math.ceil((1.0 - tokens) / self.rate))

    def __len__(self) -> int:
        return len(self._buckets)


class ParseSlots:
    """The bounded parse queue (see the module rules): ``reserve`` before reading a body that
    will be parsed off the loop, ``release`` once it is parsed (or refused)."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"bound must be >= 1, got {bound}")
        self.bound, self.used = bound, 0

    def reserve(self) -> bool:
        if self.used >= self.bound:
            return False
        self.used += 1
        return True

    def release(self) -> None:
        self.used = max(0, self.used - 1)

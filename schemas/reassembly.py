"""Joining split records as their pieces arrive (``schemas.arrays`` splits them).

A consumer joins pieces with a ``Reassembler``, which is bounded: it buffers at most
``max_pieces`` pieces (default ``MAX_PENDING_PIECES``) over all its incomplete items, so its
memory stays under that many records of the stream's largest message; past it, the item whose
first piece is oldest is evicted (``pop_evicted`` gives its key to the owner, which treats it
like an item that never completed). ``trajectory_reassembler`` joins trajectory segments,
``group_reassembler`` the parts of an admission decision.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final

from .arrays import join_group, join_segments

#: Pieces a ``Reassembler`` buffers at most by default, over all its incomplete items.
MAX_PENDING_PIECES: Final = 4096


class Reassembler:
    """Buffers the pieces of split records until an item is complete, then joins it.

    ``add`` returns the joined record when the last piece of its item arrives, else None; an
    unsplit record passes straight through. Duplicated pieces of a pending item are ignored. A
    piece arriving after its item completed starts the item afresh, on purpose: a re-read after
    a rebalance or an aborted transaction must be able to complete it again. The owner drops
    items that never complete (``stale`` + ``discard``, e.g. on admission's timeout).

    Bounded: past ``max_pieces`` buffered pieces the oldest incomplete items are evicted;
    ``pop_evicted`` hands their keys to the owner (the latest 1024 are kept), ``evicted_total``
    counts them all.
    """

    def __init__(
        self,
        key: Callable[[Mapping[str, Any]], Hashable],
        index_field: str,
        count_field: str,
        join: Callable[[list[Mapping[str, Any]]], dict[str, Any]],
        max_pieces: int = MAX_PENDING_PIECES,
    ) -> None:
        if max_pieces < 1:
            raise ValueError(f"max_pieces must be >= 1, got {max_pieces}")
        self._key, self._index, self._count, self._join = key, index_field, count_field, join
        self.max_pieces = max_pieces
        self.pieces = 0  # pieces buffered now
        self.evicted_total = 0
        self._evicted: deque[Hashable] = deque(maxlen=1024)
        self._pending: dict[Hashable, dict[int, Mapping[str, Any]]] = {}
        self._since: dict[Hashable, float] = {}

    def add(self, record: Mapping[str, Any]) -> dict[str, Any] | None:
        """Take one piece; return the joined record if it completes its item."""
        count = int(record.get(self._count, 1))
        if count == 1:
            return dict(record)
        key = self._key(record)
        if key not in self._pending:
            self._pending[key], self._since[key] = {}, time.monotonic()
        pieces = self._pending[key]
        index = int(record.get(self._index, 0))
        if index not in pieces:
            pieces[index] = record
            self.pieces += 1
        if len(pieces) < count:
            self._trim()
            return None
        self.discard(key)
        return self._join(list(pieces.values()))

    def discard(self, key: Hashable) -> int:
        """Drop the buffered pieces of an item; returns how many there were."""
        self._since.pop(key, None)
        dropped = len(self._pending.pop(key, {}))
        self.pieces -= dropped
        return dropped

    def pop_evicted(self) -> list[Hashable]:
        """Keys of the items evicted since the last call."""
        out = list(self._evicted)
        self._evicted.clear()
        return out

    def _trim(self) -> None:
        """Evict the oldest incomplete items until at most ``max_pieces`` are buffered."""
        while self.pieces > self.max_pieces:
            oldest = next(iter(self._pending))  # dicts keep insertion order: the oldest first
            self.discard(oldest)
            self._evicted.append(oldest)
            self.evicted_total += 1

    def stale(self, max_age_s: float) -> list[Hashable]:
        """Keys of incomplete items whose first piece arrived more than ``max_age_s`` ago."""
        now = time.monotonic()
        return [key for key, since in self._since.items() if now - since > max_age_s]

    def keys(self) -> list[Hashable]:
        """Keys of the items still incomplete."""
        return list(self._pending)

    def __len__(self) -> int:
        return len(self._pending)


def trajectory_reassembler(max_pieces: int = MAX_PENDING_PIECES) -> Reassembler:
    """Reassembler of trajectory segments, keyed by (run, group_id, sample_index)."""
    return Reassembler(
        lambda r: (r["run"], r["group_id"], r["sample_index"]),
        "segment_index",
        "segment_count",
        join_segments,
        max_pieces,
    )


def group_reassembler(max_pieces: int = MAX_PENDING_PIECES) -> Reassembler:
    """Reassembler of admission decision parts, keyed by (run, group_id)."""
    return Reassembler(
        lambda r: (r["run"], r["group_id"]), "part_index", "part_count", join_group, max_pieces
    )

"""Where the codec works: the memory it may write and the threads it spreads tensors over.

- ``Spans``: address ranges already in use, so a recycled buffer never overlaps the base or
  another output; ``output_array`` picks a tensor's output (a recycled buffer when one fits);
  ``writable_views`` refuses state memory that cannot be written or that tensors share.
- ``each``: a function over tensors on up to ``workers`` threads (the kernels, zstd and the
  hashes release the GIL), every call finished before it returns or raises; ``PerThread``:
  one zstd context per thread.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Final, TypeVar

import numpy as np

from .bits import DTYPE_WIDTHS, UINT_BY_WIDTH, TensorBits

#: Threads the codec spreads tensors over unless told otherwise: the cores, at most 8.
DEFAULT_WORKERS: Final = max(1, min(8, os.cpu_count() or 1))

_T = TypeVar("_T")
_R = TypeVar("_R")


def each(fn: Callable[[_T], _R], items: Sequence[_T], workers: int) -> list[_R]:
    """``[fn(x) for x in items]``, on up to ``workers`` threads. Every call has finished
    before this returns or raises (the first failure in ``items`` order), so a caller that
    undoes writes on failure never races a thread still writing."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="deltacodec") as pool:
        futures = [pool.submit(fn, x) for x in items]
        wait(futures)
    return [f.result() for f in futures]


class PerThread:
    """One zstd context per thread (a context is not shared between threads)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._local = threading.local()

    def get(self) -> Any:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = self._make()
        return ctx


class Spans:
    """Address ranges already in use (the base, then each recycled buffer), so that a
    recycled buffer never overlaps the base or another output."""

    def __init__(self, tensors: Iterable[TensorBits]) -> None:
        # Base tensors may overlap (tied weights): merge so that spans stay disjoint and a
        # claim only needs to look at its two neighbours.
        self._spans: list[tuple[int, int]] = []
        for lo, hi in sorted(s for t in tensors if (s := span(t.bits))[1] > s[0]):
            if self._spans and lo < self._spans[-1][1]:
                self._spans[-1] = (self._spans[-1][0], max(hi, self._spans[-1][1]))
            else:
                self._spans.append((lo, hi))

    def claim(self, array: np.ndarray) -> bool:
        lo, hi = span(array)
        i = bisect.bisect_left(self._spans, (lo, hi))
        neighbours = self._spans[max(0, i - 1) : i + 1]
        if any(a < hi and lo < b for a, b in neighbours):
            return False
        self._spans.insert(i, (lo, hi))
        return True


def span(array: np.ndarray) -> tuple[int, int]:
    lo = int(array.__array_interface__["data"][0])
    return lo, lo + array.nbytes


def output_array(entry: Mapping[str, Any], old: TensorBits | None, taken: Spans) -> np.ndarray:
    """Where a tensor is decoded to: a recycled buffer when one fits, else a new array."""
    dtype = UINT_BY_WIDTH[DTYPE_WIDTHS[entry["dtype"]]]
    n = math.prod(entry["shape"])
    if old is not None and old.dtype == entry["dtype"] and old.numel == n and n:
        buf = old.bits.view()
        try:
            buf.flags.writeable = True
        except ValueError:  # memory we may not write (e.g. a bytes buffer): allocate
            return np.empty(n, dtype=dtype)
        if taken.claim(buf):
            old.forget_hash()
            return buf
    return np.empty(n, dtype=dtype)


def writable_views(
    state: Mapping[str, TensorBits], keep: Mapping[str, TensorBits]
) -> dict[str, np.ndarray]:
    """Writable views of the state's memory; ``ValueError`` unless every tensor's memory may
    be written and no two tensors share memory, with each other or with ``keep``."""
    taken = Spans(keep.values())
    views: dict[str, np.ndarray] = {}
    for name, t in state.items():
        v = t.bits.view()
        try:
            v.flags.writeable = True
        except ValueError as exc:
            raise ValueError(f"{name!r}: memory that cannot be written") from exc
        if v.size and not taken.claim(v):
            raise ValueError(f"{name!r} shares memory with another tensor")
        views[name] = v
    return views

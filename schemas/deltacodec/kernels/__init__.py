"""The delta codec's numba kernels, one module per coder (``exponent``: bucket ranks and plans;
``rangecoder``: the adaptive binary range coder; ``rans``: the static rANS coder; ``direct``:
changes in element order) and the raw bit I/O they share (``bits``), at module level so that
numba's on-disk cache (``__pycache__`` beside each module) serves every process after the
first. They are imported on first use only (``load``), so that importing the codec stays cheap
(no numba); ``rlstream delta warm`` compiles them all once.

Numba keys a kernel's cache on its own file only, and ``rans`` and ``direct`` inline helpers of
``bits`` (``direct`` of ``rans`` too): so the first ``load`` of a process compares a digest of
every source file here with the one stamped beside the cache and, when they differ, removes
the folder's numba cache first (``fresh_cache``). An edited helper is compiled into every
kernel that uses it; nothing is deleted by hand.

Each coder's decoder kernel takes the same arguments and fills the same arrays: the coded
bytes, the bucket mask, its own header values, then ``buckets``, ``starts``, ``gaps`` and
``values``; it returns the bucket count, or -1 for a stream it refuses (``run_decoder``).
Encoder kernels take the bucket table and the numbers alike (``table_args``).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np

#: An exponent plan's countdown for "no further change in this bucket": never reaches 0.
FAR: Final = 1 << 62
STAMP = "kernel-sources.sha256"
_checked = False


def load(name: str) -> ModuleType:
    """The kernel module ``name``, compiled (or loaded from numba's cache) on first use."""
    global _checked
    if not _checked:
        fresh_cache(Path(__file__).parent)
        _checked = True
    return importlib.import_module(f"{__name__}.{name}")


def fresh_cache(folder: Path) -> bool:
    """Remove ``folder``'s numba cache when any of its source files changed since the cache was
    stamped (see the module docstring); True when it did. A folder that cannot be written (an
    install numba caches elsewhere, ``NUMBA_CACHE_DIR``) is left as it is."""
    sources = sorted(folder.glob("*.py"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources))
    cache, want = folder / "__pycache__", digest.hexdigest()
    try:
        if (cache / STAMP).read_text() == want:
            return False
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for stale in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            stale.unlink(missing_ok=True)
        part = cache / f"{STAMP}.{os.getpid()}"
        part.write_text(want)
        os.replace(part, cache / STAMP)  # processes starting at once agree on one stamp
    except OSError:
        return False
    return True


def table_args(
    buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A coder's bucket table and numbers as its encoder kernel takes them (contiguous)."""
    return (
        np.ascontiguousarray(buckets, np.int64),
        np.ascontiguousarray(gaps, np.int64),
        np.ascontiguousarray(values, np.uint64),
        np.ascontiguousarray(starts, np.int64),
    )


def run_decoder(
    kernel: Callable[..., Any], buf: np.ndarray, count: int, mask: int, *header: Any, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(buckets, starts, gaps, zigzag differences)`` a decoder kernel fills from ``buf``
    (``count`` changes, buckets within ``mask``; ``header``: the kernel's arguments between
    the mask and the arrays); ``ValueError`` naming ``what`` when it refuses the stream."""
    buckets, starts = np.empty(mask + 1, np.int64), np.empty(mask + 2, np.int64)
    gaps, values = np.empty(count, np.int64), np.empty(count, np.uint64)
    nb = kernel(np.ascontiguousarray(buf, np.uint8), mask, *header, buckets, starts, gaps, values)
    if nb < 0:
        raise ValueError(f"{what} piece: coded stream is truncated or inconsistent")
    return buckets[:nb], starts[: nb + 1], gaps, values

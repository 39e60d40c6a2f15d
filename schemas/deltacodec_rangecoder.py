"""An adaptive binary range coder for the ``exponent`` piece's gaps and differences.

Why not zstd there: a zstd stream pays for its Huffman table and frame, which a bucket of a
few thousand changes does not earn back, and Huffman spends at least one bit per symbol.
An adaptive binary coder learns each bucket's statistics as it goes (no table is sent) and
spends fractions of a bit, so the code length follows the empirical entropy of each
bucket closely.

Coder: the LZMA range coder (32-bit range, carry through a cached byte, 5 bytes flushed),
with 16-bit probabilities of a 0 bit: each context averages two estimates, one moved 1/16
and one 1/128 of the way to every bit it codes (quick to learn, steady once learnt).
Numbers: a value v >= 1 is coded as its bit length n - 1 in unary (a 1 per extra bit, then a
0 unless n is 64), then its bits below the top one, high to low: the first three under
adaptive contexts chosen by (n, the bits so far), the rest as plain bits (they are close to
uniform for the distributions met here). One set of contexts codes gaps (as gap + 1) and one
zigzag differences; they learn bucket after bucket in ascending exponent order, each bucket
starting from what the one below left (neighbouring exponents have alike statistics: on a
real network's Adam step this codes 5% smaller than starting every bucket afresh).

Layout of a coded stream: the bucket table (bucket count + 1, then per bucket, ascending,
its distance from the previous one (the first: bucket + 1) and its changes, under contexts of
their own), then for each bucket its gaps, then its differences. ``decode`` raises ``ValueError`` when the stream is exhausted early or a
number does not fit its element width; anything else wrong shows as a piece that does not
match its range, or a hash mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

_kernels: dict[str, Callable[..., Any]] = {}
MANTISSA_CONTEXT_BITS = 3
FAST, SLOW = 4, 7  # adaptation shifts of the two probability estimates a context averages
TOP = 1 << 24  # the range is renormalised (a byte out) whenever it falls below this


def _compiled() -> dict[str, Callable[..., Any]]:
    """The numba kernels, compiled (or loaded from numba's cache) on first use only. The
    coder's state lives in local variables (helpers are inlined and return it), so that it
    stays in registers."""
    if _kernels:
        return _kernels
    from . import deltacodec_rangecoder_kernels as k

    _kernels.update(encode=k.encode, decode=k.decode)
    return _kernels


def encode(buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray) -> bytes:
    """The coded stream of the bucket table and the per-bucket gaps and zigzag differences
    (module docstring)."""
    args = (
        np.ascontiguousarray(buckets, np.int64),
        np.ascontiguousarray(gaps, np.int64),
        np.ascontiguousarray(values, np.uint64),
        np.ascontiguousarray(starts, np.int64),
    )
    out = np.zeros(64 + 8 * buckets.size + 4 * gaps.size, np.uint8)
    n = _compiled()["encode"](*args, out)
    if n > out.size:  # rare: numbers far from what the contexts learnt
        out = np.zeros(n, np.uint8)
        n = _compiled()["encode"](*args, out)
    return out[:n].tobytes()


def decode(
    buf: np.ndarray, count: int, mask: int, width_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(buckets, starts, gaps, zigzag differences)`` of ``encode``'s stream of ``count``
    changes, buckets within ``mask``, differences within ``width_bits``."""
    buckets, starts = np.empty(mask + 1, np.int64), np.empty(mask + 2, np.int64)
    gaps, values = np.empty(count, np.int64), np.empty(count, np.uint64)
    nb = _compiled()["decode"](
        np.ascontiguousarray(buf, np.uint8), mask, width_bits, buckets, starts, gaps, values
    )
    if nb < 0:
        raise ValueError("exponent piece: coded stream is truncated or inconsistent")
    return buckets[:nb], starts[: nb + 1], gaps, values

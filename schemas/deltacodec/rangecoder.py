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

Second model (``encode2``/``decode2``, the ``exponent2`` pieces), measured against the
conditioned bound on real Adam steps and the learner's (``rlstream bench deltas``); the same
byte-level coder, with:

- contexts that count what they coded: a context's n-th bit moves its probability by
  2**-min(6, bit length of n + 1) (1/2, 1/4, 1/4, 1/8, ...), so it learns like a frequency
  count at first and then follows slow drifts;
- gaps under a geometric law instead of learnt contexts: within a bucket, a gap g with the
  bucket's rate estimate p (its changes over its elements so far, plus a prior of one change
  at the previous bucket's rate, the piece's for the first, and never below the bucket's
  changes over the range's elements) is sent as g >> m in unary then its m low bits, m the
  smallest with (1 - p)**(2**m) <= 1/2, the top ``GAP_EXACT_BITS`` of them with their
  probabilities under that law (integer arithmetic, Q30), the others plain (their
  probabilities are within 0.011 of 1/2): the cost follows the bucket's binary entropy of its changed mask
  within ~log2(changes) / 2 bits, where learnt contexts spent ~25 bits per bucket re-learning
  (the rate halves from one exponent to the next). A unary run of ``GAP_ESCAPE`` ends in an
  escape: the rest as a number;
- differences with six context bits below the top one (the learner's steps are ±k ULP, whose
  low bits are not uniform), and the value contexts' counts cut back to ``RESET_COUNT`` at
  every bucket, so they re-learn quickly what the next exponent changes;
- no first byte (always 0 in this coder) and a flush that ends in as many zero bytes as the
  final interval allows, which are dropped (the decoder reads zeros past the end).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

MANTISSA_CONTEXT_BITS = 3
FAST, SLOW = 4, 7  # adaptation shifts of the two probability estimates a context averages
TOP = 1 << 24  # the range is renormalised (a byte out) whenever it falls below this
_kernels: dict[str, Callable[..., Any]] = {}


def _compiled() -> dict[str, Callable[..., Any]]:
    """The numba kernels of both models (``encode``/``decode``, ``encode2``/``decode2``),
    compiled (or loaded from numba's cache) on first use only. The coder's state lives in local
    variables (helpers are inlined and return it), so that it stays in registers."""
    if _kernels:
        return _kernels
    from .kernels import rangecoder as k1
    from .kernels import rangecoder2 as k2

    _kernels.update(encode=k1.encode, decode=k1.decode, encode2=k2.encode, decode2=k2.decode)
    return _kernels


def _numbers(
    buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The table and numbers as the encoder kernels take them."""
    return (
        np.ascontiguousarray(buckets, np.int64),
        np.ascontiguousarray(gaps, np.int64),
        np.ascontiguousarray(values, np.uint64),
        np.ascontiguousarray(starts, np.int64),
    )


def _encoded(kernel: str, args: tuple[Any, ...]) -> np.ndarray:
    """The bytes an encoder kernel writes: into a buffer sized for the usual case, again into
    one of the size it asked for when that was short (rare: numbers far from what the contexts
    learnt)."""
    buckets, gaps = args[0], args[1]
    out = np.zeros(64 + 8 * buckets.size + 4 * gaps.size, np.uint8)
    size = _compiled()[kernel](*args, out)
    if size > out.size:
        out = np.zeros(size, np.uint8)
        size = _compiled()[kernel](*args, out)
    return out[:size]


def _decoded(
    kernel: str, buf: np.ndarray, count: int, mask: int, *header: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(buckets, starts, gaps, zigzag differences)`` a decoder kernel fills from ``buf``
    (``header``: its arguments between the mask and the arrays)."""
    buckets, starts = np.empty(mask + 1, np.int64), np.empty(mask + 2, np.int64)
    gaps, values = np.empty(count, np.int64), np.empty(count, np.uint64)
    nb = _compiled()[kernel](
        np.ascontiguousarray(buf, np.uint8), mask, *header, buckets, starts, gaps, values
    )
    if nb < 0:
        raise ValueError("exponent piece: coded stream is truncated or inconsistent")
    return buckets[:nb], starts[: nb + 1], gaps, values


def encode(buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray) -> bytes:
    """The coded stream of the bucket table and the per-bucket gaps and zigzag differences
    (module docstring)."""
    return _encoded("encode", _numbers(buckets, gaps, values, starts)).tobytes()


def decode(
    buf: np.ndarray, count: int, mask: int, width_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(buckets, starts, gaps, zigzag differences)`` of ``encode``'s stream of ``count``
    changes, buckets within ``mask``, differences within ``width_bits``."""
    return _decoded("decode", buf, count, mask, width_bits)


def encode2(
    buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray, n: int
) -> bytes:
    """The second model's stream of the same table and numbers as ``encode``, for a range of
    ``n`` elements (module docstring)."""
    out = _encoded("encode2", (*_numbers(buckets, gaps, values, starts), int(n)))
    if out[0]:
        raise AssertionError("range coder: a first byte other than 0")
    end = out.size
    while end > max(1, out.size - 4) and not out[end - 1]:
        end -= 1
    return out[1:end].tobytes()


def decode2(
    buf: np.ndarray, count: int, mask: int, width_bits: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(buckets, starts, gaps, zigzag differences)`` of ``encode2``'s stream of ``count``
    changes in a range of ``n`` elements, buckets within ``mask``, differences within
    ``width_bits``."""
    return _decoded("decode2", buf, count, mask, width_bits, int(n))

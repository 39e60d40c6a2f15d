"""An adaptive binary range coder for the gaps and differences of ``exponent2`` pieces (and,
decoding only, of the first encoder's ``exponent`` pieces).

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

Layout of a coded stream (both models): the bucket table (bucket count + 1, then per bucket,
ascending, its distance from the previous one (the first: bucket + 1) and its changes, under
contexts of their own), then for each bucket its gaps, then its differences. The first model
(``exponent`` pieces, no longer written) is only decoded (``decode_first``, for ``legacy``). A
decoder raises ``ValueError`` when the stream is exhausted early or a number does not fit its
element width; anything else wrong shows as a piece that does not match its range, or a hash
mismatch.

The model written now (``encode``/``decode``, the ``exponent2`` pieces), measured against the
conditioned bound on real Adam steps and the learner's (``rlstream bench deltas``); the same
byte-level coder, with:

- contexts that count what they coded: a context's n-th bit moves its probability by
  2**-min(6, bit length of n + 1) (1/2, 1/4, 1/4, 1/8, ...), so it learns like a frequency
  count at first and then follows slow drifts;
- gaps under a geometric law instead of learnt contexts: within a bucket, a gap g with the bucket's
  rate estimate p (its changes over its elements so far, plus a prior of one change at the previous
  bucket's rate, the piece's for the first, and never below the bucket's changes over the range's
  elements) is sent as g >> m in unary then its m low bits, m the smallest with (1 - p)**(2**m) <=
  1/2, the top ``GAP_EXACT_BITS`` of them with their probabilities under that law (integer
  arithmetic, Q30), the others plain (their probabilities are within 0.011 of 1/2): the cost follows
  the bucket's binary entropy of its changed mask within ~log2(changes) / 2 bits, where learnt
  contexts spent ~25 bits per bucket re-learning (the rate halves from one exponent to the next). A
  unary run of ``GAP_ESCAPE`` ends in an escape: the rest as a number;
- differences with six context bits below the top one (the learner's steps are ±k ULP, whose
  low bits are not uniform), and the value contexts' counts cut back to ``RESET_COUNT`` at
  every bucket, so they re-learn quickly what the next exponent changes;
- no first byte (always 0 in this coder) and a flush that ends in as many zero bytes as the
  final interval allows, which are dropped (the decoder reads zeros past the end).

The kernels (``kernels.rangecoder``) hold both models' constants and write the shared parts once:
the byte-level coder, the number and table decoders.
"""

from __future__ import annotations

import numpy as np

from . import kernels


def encode(
    buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray, n: int
) -> bytes:
    """The coded stream of the bucket table (present buckets ascending, ``starts`` their
    ranges of ``gaps`` and ``values``) and of the per-bucket gaps and zigzag differences, for
    a range of ``n`` elements (module docstring). The kernel writes into a buffer sized for the
    usual case, again into one of the size it asked for when that was short (rare: numbers far
    from what the contexts learnt)."""
    args = (*kernels.table_args(buckets, gaps, values, starts), int(n))
    kernel = kernels.load("rangecoder").encode
    out = np.zeros(64 + 8 * buckets.size + 4 * gaps.size, np.uint8)
    size = kernel(*args, out)
    if size > out.size:
        out = np.zeros(size, np.uint8)
        size = kernel(*args, out)
    out = out[:size]
    if out[0]:
        raise AssertionError("range coder: a first byte other than 0")
    end = out.size
    while end > max(1, out.size - 4) and not out[end - 1]:
        end -= 1
    return out[1:end].tobytes()


def decode(
    buf: np.ndarray, count: int, mask: int, width_bits: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(buckets, starts, gaps, zigzag differences)`` of ``encode``'s stream of ``count``
    changes in a range of ``n`` elements, buckets within ``mask``, differences within
    ``width_bits``."""
    kernel = kernels.load("rangecoder").decode
    return kernels.run_decoder(kernel, buf, count, mask, width_bits, int(n), what="exponent2")


def decode_first(
    buf: np.ndarray, count: int, mask: int, width_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The same from a stream of the first model (``exponent`` pieces)."""
    kernel = kernels.load("rangecoder").decode_first
    return kernels.run_decoder(kernel, buf, count, mask, width_bits, what="exponent")

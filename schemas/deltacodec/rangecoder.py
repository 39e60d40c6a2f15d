"""An adaptive binary range coder for the gaps and differences of ``exponent2`` pieces (and,
decoding only, of the first encoder's ``exponent`` pieces).

Why not zstd: a zstd stream pays for its Huffman table and frame, and Huffman spends at least one
bit per symbol; an adaptive binary coder learns each bucket as it goes and spends fractions of a
bit. The coder is LZMA's; the model written now (``encode``/``decode``) counts what it coded,
sends gaps under a geometric law and cuts the value contexts back at every bucket.

Rules a maintainer must keep: the first model is only decoded (``decode_first``); a decoder
raises ``ValueError`` when the stream ends early or a number does not fit its element width.
The kernels (``kernels.rangecoder``) hold both models' constants.

Details: docs/delta-codec.md (The adaptive binary range coder).
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

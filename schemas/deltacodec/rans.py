"""A static rANS coder for the ``exponent3`` piece's gaps and differences.

Why: the adaptive range coder spends 10-20 binary decisions per change; here each bucket's
statistics are measured by the encoder and sent in the stream's header, and every gap and
difference is one table-driven rANS symbol plus plain bits, within ~1% of the range coder's
size and several times faster.

Rules a maintainer must keep: every probability is an integer count out of 4096, so encoder and
decoder build the same tables; ``decode`` raises ``ValueError`` on any inconsistency (a table out
of range, a number that does not fit, a wrong final state, words or bits missing or left over).

Details: docs/delta-codec.md (The static rANS coder).
"""

from __future__ import annotations

import numpy as np

from . import kernels


def varint(v: int) -> bytes:
    """``v`` (>= 0) as LEB128 bytes."""
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def encode(buckets: np.ndarray, gaps: np.ndarray, values: np.ndarray, starts: np.ndarray) -> bytes:
    """The coded stream of the bucket table (present buckets ascending, ``starts`` their
    ranges of ``gaps`` and ``values``) and of the per-bucket gaps and zigzag differences."""
    kernel = kernels.load("rans").encode
    header, words, raw, nraw = kernel(*kernels.table_args(buckets, gaps, values, starts))
    plain = raw.astype("<u8").tobytes()[:nraw]
    return b"".join((header.tobytes(), varint(words.size), words.astype("<u2").tobytes(), plain))


def decode(
    buf: np.ndarray, count: int, mask: int, width_bits: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of ``encode``: the table and numbers (``kernels.run_decoder``) of ``count``
    changes in a range of ``n`` elements of ``width_bits`` bits, buckets within ``mask``."""
    kernel = kernels.load("rans").decode
    return kernels.run_decoder(kernel, buf, count, mask, width_bits, int(n), what="exponent3")

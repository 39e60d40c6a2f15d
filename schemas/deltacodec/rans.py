"""A static rANS coder for the ``exponent3`` piece's gaps and differences.

Why: the adaptive binary range coder (``deltacodec.rangecoder``) spends 10-20 binary decisions
per change, ~70 ns decoding and ~100 ns encoding one. Here each bucket's statistics are
measured by the encoder and sent as a small model in the stream's header, and every gap and
difference is one table-driven rANS symbol plus plain bits, at a code length within ~1% of the
first coder's on bf16 Adam steps. Measured on the synthetic bf16 step of ``bench deltas``
(50M weights, 1.7% changed, Intel Xeon): ~30 ns a change encoding (branch-free output of words
and plain bits; the branching forms took ~80) and ~40-45 ns decoding, where the one state's
chain of dependent table reads sets the pace (branch-free reading gained nothing there).

Models, per bucket of the base exponent (``deltacodec.exponent``):

- gaps under a geometric law: with the bucket's rate p = changes / (gaps + changes), a gap g
  is its quotient q = g >> m, m the smallest with (1 - p)**(2**m) <= 0.84, as one symbol of
  the law (1 - t) t**q (t = (1 - p)**(2**m), sent as one byte; up to 48 symbols while they
  round to a count, then an escape followed by q's excess as an Elias-gamma number), then
  its m low bits plain (their law is within 0.84 of uniform: ~0.002 bits lost a gap);
- differences: v = zigzag difference - 1 as one symbol, its own below 16, then two symbols
  per bit length (the bit below the top one) up to 20 bits with the rest as plain bits, then
  an escape with v - (2**20 - 1) as a gamma number; the bucket's symbol counts are sent,
  normalised to 2**b (b from 6 to 12, twice the bucket's changes: a table of few changes is
  noisy anyway and cheaper so).

All probabilities are counts out of 4096 (a model is normalised with integer arithmetic, so
encoder and decoder build the same tables); one rANS state (32 bits, 16-bit renormalisation)
codes every symbol, the plain bits go to a separate bit stream.

Layout of a coded stream: the header (LEB128 numbers: the bucket count, then per bucket,
ascending, its distance from the previous one (the first: bucket + 1), its changes, m, the
ratio byte, the value symbol count s and the first s - 1 normalised counts (the last is the
rest)), the rANS word count, the words (16-bit little-endian, the decoder's reading order),
then the plain bits (least significant first, the last byte padded with zeros). Symbols are
coded bucket by bucket: its gaps, then its differences. ``decode`` raises ``ValueError`` on
any inconsistency: a table out of range, a number that does not fit, a final rANS state other
than the encoder's first, words or bits missing or left over.
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

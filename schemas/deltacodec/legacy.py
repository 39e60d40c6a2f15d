"""Decoders of piece encodings no longer written, kept together so that a version in an old log
still decodes (replay, lineage, a tap reading last year's run). Each one has golden bytes of the
encoder that wrote it in ``tests/unit/data/deltacodec/`` (the script that made them beside
them), decoded and applied in place bit for bit by ``tests/unit/test_deltacodec_exponent.py``.

- ``exponent`` (encoding 6), the first base-conditioned encoding (``deltacodec.exponent``
  states the bucket model): piece ``count`` = changed elements, ``aux`` = 0; two stored
  streams: the field, little-endian uint32 ``[shift, mask]``, and the stream of the range
  coder's first model (``deltacodec.rangecoder``: the bucket table, then the gaps and
  differences, bucket by bucket). Golden bytes: ``exponent-delta.rlwd``. ``exponent2`` (the
  same table with the coder's second model and the field named in ``aux``) replaced it.

Every other encoding an earlier encoder wrote (``unchanged``, ``sparse``, ``xor``, ``diff``,
``planes``, ``raw``, ``exponent2``) is still written and decoded by the current code (golden
bytes ``v1-delta.rlwd``, ``exponent2-delta.rlwd``).
"""

from __future__ import annotations

import numpy as np

from . import rangecoder
from .exponent import MAX_BUCKETS, ExponentPlan, plan_of
from .pieces import STORED, Piece


def decode_exponent(piece: Piece, n: int, dtype: np.dtype) -> ExponentPlan:
    """The plan of an ``exponent`` piece over ``n`` elements of ``dtype`` (checks the
    header's size before decoding anything)."""
    k = piece.count
    if not 0 < k <= n or len(piece.streams) != 2 or piece.aux:
        raise ValueError("exponent piece must hold 1 to its element count changes")
    (head_codec, head), (codec, coded) = piece.streams
    if head_codec != STORED or codec != STORED or len(head) != 8:
        raise ValueError("exponent piece: two stored streams, the first of 8 bytes")
    shift, mask = (int(x) for x in np.frombuffer(head, "<u4"))
    if shift >= 8 * dtype.itemsize or mask >= MAX_BUCKETS or mask & (mask + 1):
        raise ValueError(f"bad exponent field ({shift}, {mask:#x})")
    width = 8 * dtype.itemsize
    z = np.frombuffer(coded, np.uint8)
    buckets, starts, gaps, values = rangecoder.decode_first(z, k, mask, width)
    return plan_of(shift, mask, dtype, buckets, starts, gaps, values)

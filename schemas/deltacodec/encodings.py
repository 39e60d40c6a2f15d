"""Which encoding a piece gets, and how a piece of each encoding is decoded.

``encode_best`` encodes a range every way that may pay off at its changed fraction and keeps the
smallest (``deltacodec.pieces`` lists the encodings and their layout): ``unchanged`` when nothing
changed; else ``sparse`` (changed fraction <= 0.9), for a float dtype ``exponent3`` and, on few
changes or many, ``exponent2`` (``deltacodec.exponent``), ``xor`` and ``diff`` (>= 0.5); and
``raw`` when nothing else is smaller; asked for fast applies, ``direct`` (``deltacodec.direct``)
in place of ``sparse`` and the exponent encodings. Without a base: ``planes`` or ``raw``.

``decode_piece`` decodes every encoding ever written, the retired ones through
``deltacodec.legacy``; it raises ValueError on any inconsistency and the codec turns it into its
own error.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import zstandard

from .bits import as_bytes
from .direct import apply_direct, encode_direct
from .exponent import decode_exponent2, encode_exponent2, encode_exponent3
from .legacy import decode_exponent
from .pieces import (
    DIFF,
    DIRECT,
    ENCODINGS,
    EXPONENT,
    EXPONENT2,
    EXPONENT3,
    PIECE_HEADER,
    PLANES,
    RAW,
    SPARSE,
    STREAM_HEADER,
    UNCHANGED,
    XOR,
    Changes,
    Hasher,
    Piece,
    Undo,
    apply_changes,
    blocks,
    encode_dense,
    encode_sparse,
    join_planes,
    same_memory,
    sparse_changes,
    unpack_stream,
    unzigzag,
)

NEEDS_BASE: Final = frozenset(
    {UNCHANGED, SPARSE, XOR, DIFF, EXPONENT, EXPONENT2, EXPONENT3, DIRECT}
)
#: Pieces that verify what they write without the tensor's hash: ``direct`` (its changes'
#: checksum) and ``unchanged`` (writes nothing).
SELF_CHECKED: Final = frozenset({UNCHANGED, DIRECT})
BY_EXPONENT: Final = frozenset({EXPONENT, EXPONENT2, EXPONENT3})
# Sparse is tried up to this changed fraction and the dense fallbacks from the next one on:
# on simulated bf16 RL steps sparse still wins at 90% changed, dense only near 100%.
SPARSE_MAX_FRACTION: Final = 0.9
DENSE_MIN_FRACTION: Final = 0.5
# exponent2 (the adaptive coder, ~100 ns a change) is tried beside exponent3 on pieces of at
# most this many changes, where its learning beats exponent3's header, and on pieces with at
# least this changed fraction (the learner's Adam steps: its contexts follow the wide
# differences 0.5-2% closer); elsewhere it would cost encode time for nothing.
EXPONENT2_MAX_CHANGES: Final = 4096
EXPONENT2_MIN_FRACTION: Final = 0.2


def encode_best(
    tensor: int,
    start: int,
    old: np.ndarray | None,
    new: np.ndarray,
    ch: Changes | None,
    cctx: zstandard.ZstdCompressor,
    field: tuple[int, int] | None = None,
    fast_apply: bool = False,
) -> Piece:
    """The smallest encoding of ``new`` (elements ``start..``) given ``old`` and its changes.
    Without a base: ``planes`` or ``raw``. With one: ``unchanged`` when nothing changed, else
    the smallest of ``sparse`` (changed fraction <= 0.9), for a float dtype (its exponent
    ``field``) ``exponent3`` and, on few changes or many, ``exponent2``, ``xor`` and ``diff``
    (>= 0.5), and ``raw`` (its size is known without building it). With ``fast_apply``, a
    float range's changes are coded ``direct`` instead of ``sparse`` and the exponent
    encodings (the dense fallbacks and ``raw`` still win where they are smaller)."""
    n = new.size
    stop = start + n
    if old is None or ch is None:
        cands = [encode_dense(tensor, start, None, new, PLANES, cctx)]
    elif ch.pos.size == 0:
        return Piece(tensor, start, stop, UNCHANGED, 0, 0, ())
    else:
        cands = []
        k = int(ch.pos.size)
        if field is not None and fast_apply:
            aux, streams = encode_direct(old, ch.pos, ch.diff, field)
            cands.append(Piece(tensor, start, stop, DIRECT, aux, k, tuple(streams)))
        elif k <= SPARSE_MAX_FRACTION * n:
            cands.append(encode_sparse(tensor, start, stop, ch, cctx))
        if field is not None and not fast_apply:
            aux, streams = encode_exponent3(old, ch.pos, ch.diff, field)
            cands.append(Piece(tensor, start, stop, EXPONENT3, aux, k, tuple(streams)))
        exponent2 = k <= EXPONENT2_MAX_CHANGES or k >= EXPONENT2_MIN_FRACTION * n
        if field is not None and not fast_apply and exponent2:
            aux, streams = encode_exponent2(old, ch.pos, ch.diff, field)
            cands.append(Piece(tensor, start, stop, EXPONENT2, aux, k, tuple(streams)))
        if k >= DENSE_MIN_FRACTION * n:
            cands += [encode_dense(tensor, start, old, new, e, cctx) for e in (XOR, DIFF)]
    best = min(cands, key=lambda p: p.nbytes)
    raw_size = PIECE_HEADER.size + STREAM_HEADER.size + new.nbytes
    return best if best.nbytes < raw_size else encode_dense(tensor, start, None, new, RAW, cctx)


def decode_piece(
    piece: Piece,
    base: np.ndarray | None,
    out: np.ndarray,
    dctx: zstandard.ZstdDecompressor,
    old_hasher: Hasher | None = None,
    new_hasher: Hasher | None = None,
    undo: Undo | None = None,
) -> None:
    """Write the piece's elements into ``out`` (the range's slice of the new tensor), reading
    the same range of ``base``, and feed the hashers with the base and output bytes of the
    range. ``out`` may be ``base`` itself (applied in place: each block is hashed as base
    before it is written, only changed elements are written, and ``undo``, when given,
    records what restores it). Never writes outside ``out``; raises ValueError when the piece
    is inconsistent with itself or with the tensor."""
    n, dtype = out.size, out.dtype
    if piece.encoding in NEEDS_BASE and base is None:
        raise ValueError(f"{ENCODINGS[piece.encoding]} piece for a tensor without base")
    if base is not None and piece.encoding in BY_EXPONENT:
        if piece.encoding == EXPONENT:
            plan = decode_exponent(piece, n, dtype)
        else:
            plan = decode_exponent2(piece, n, dtype, ENCODINGS[piece.encoding])
        blocks(base, out, old_hasher, new_hasher, plan.run)
        if undo is not None and same_memory(base, out):
            undo.append((out, plan.done[: plan.ndone], plan.old[: plan.ndone]))
        plan.finish()
        return
    if base is not None and piece.encoding == DIRECT:
        if old_hasher is not None:
            old_hasher.update(as_bytes(base))
        if not same_memory(base, out):
            np.copyto(out, base)
        done, old, error = apply_direct(piece, out)
        if undo is not None and same_memory(base, out):
            undo.append((out, done, old))
        if error is not None:
            raise error
        if new_hasher is not None:
            new_hasher.update(as_bytes(out))
        return
    if base is not None and piece.encoding in (UNCHANGED, SPARSE):
        pos, deltas = sparse_changes(piece, n, dtype, dctx)
        if undo is not None and same_memory(base, out):
            undo.append((out, pos, base.take(pos)))
        apply_changes(base, out, pos, deltas, old_hasher, new_hasher)
        return
    if old_hasher is not None and base is not None:
        old_hasher.update(as_bytes(base))
    if undo is not None:
        undo.append((out, None, out.copy()))
    if piece.encoding == RAW:
        if len(piece.streams) != 1:
            raise ValueError("raw piece needs one stream")
        out.view(np.uint8)[:] = unpack_stream(piece.streams[0], dctx, out.nbytes)
    else:
        if len(piece.streams) != dtype.itemsize:
            raise ValueError("wrong number of byte planes")
        x = join_planes([unpack_stream(s, dctx, n) for s in piece.streams], dtype.itemsize, n)
        if piece.encoding == XOR and base is not None:
            np.bitwise_xor(base, x, out=out)
        elif piece.encoding == DIFF and base is not None:
            np.add(base, unzigzag(x), out=out)
        else:
            np.copyto(out, x)
    if new_hasher is not None:
        new_hasher.update(as_bytes(out))

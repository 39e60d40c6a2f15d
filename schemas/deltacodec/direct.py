"""The ``direct`` piece encoding (encoding 9): changes coded in element order, so that applying
one reads and writes only the changed elements, and a checksum of the changes, so that the
apply is verified without hashing the whole tensor.

Why: an ``exponent3`` piece codes each bucket's changes by their rank within the bucket, so the
decoder turns ranks back into positions by counting every element of the range by bucket: at
1.7% changed that scan is most of an apply's time and grows with the model, not with the
change. Here positions are coded as gaps in element order under one geometric law for the
piece (``kernels.rans``'s quotient symbol and plain remainder bits), which costs more bits than
per-bucket gaps; the differences keep the per-bucket value laws of ``exponent3`` (the decoder
reads the base element at each decoded position, its bucket picks the law), which is where
base conditioning pays most. Gaps and differences run on two rANS states (two independent
chains of table reads, decoded side by side), plain bits in a third stream.

The checksum is the wrapping sum, over the changes, of a 64-bit mix of (position in the range,
base bits, new bits) (``kernels.direct.change_sum``), computed by the encoder from its base and
checked by the decoder from the base it holds, as it applies. With the chunk's checksum (the
chunk is the encoder's) it makes an apply that hashes nothing else exact on every element it
writes: each changed element's base bits were the encoder's and its new bits are. What it does
not see is a base element the delta does not change: ``codec.apply_in_place``'s full check (the
tensor and state hashes) does, and a subscriber runs it every few versions.

Layout of the one stored stream (``aux`` names the exponent field as for ``exponent3``,
``count`` the changes): the header (LEB128: the gap remainder bits m, one byte for the gap
law's ratio, the bucket count, then per bucket, ascending, its distance from the previous one,
its changes, its value symbol count s and the first s - 1 normalised counts), the checksum (8
bytes, little-endian); then the gap words and the difference words (each a LEB128 count, then
16-bit little-endian words in the decoder's order), the plain bit count (LEB128) and the plain
bits (32-bit little-endian words, least significant bit first).
"""

from __future__ import annotations

import numpy as np

from ..errors import RlstreamError
from . import kernels
from .exponent import FIELD_IDS, ID_OF_FIELD
from .pieces import STORED, Piece, Stream, zigzag
from .rans import varint


class ChangesMismatch(RlstreamError, ValueError):
    """The changed elements' checksum differs: the base held is not the encoder's there (the
    codec raises it as ``BaseMismatch``)."""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    v = shift = 0
    while pos < len(buf) and shift < 35:
        byte = buf[pos]
        pos += 1
        v |= (byte & 0x7F) << shift
        if byte < 0x80:
            return v, pos
        shift += 7
    raise ValueError("direct piece: truncated stream")


def encode_direct(
    old: np.ndarray, pos: np.ndarray, diff: np.ndarray, field: tuple[int, int]
) -> tuple[int, list[Stream]]:
    """``aux`` and the one stream of a ``direct`` piece of the changes ``(pos, diff)`` (at
    least one, ``pos`` ascending) of a range whose base is ``old``."""
    kernel = kernels.load("direct")
    shift, mask = field
    pos = pos.astype(np.int64, copy=False)
    base = old[pos]
    bkt = ((base.astype(np.int64) >> shift) & mask).astype(np.uint16)
    counts = np.bincount(bkt, minlength=mask + 1)
    present = np.flatnonzero(counts)
    rowof = np.full(mask + 1, -1, np.int64)
    rowof[present] = np.arange(present.size)
    z = zigzag(diff).astype(np.uint64)
    gaps = np.diff(pos, prepend=-1) - 1
    starts = np.concatenate([[0], np.cumsum(counts[present])]).astype(np.int64)
    check = kernel.checksum(old, pos, base + diff)
    head, *parts = kernel.encode(
        gaps,
        rowof[bkt],
        z,
        present.astype(np.int64),
        starts,
        z.take(np.argsort(bkt, kind="stable")),
        np.uint64(check),
    )
    out = [head.tobytes()]
    for i in (0, 4):  # the gaps', then the differences' two lanes of words and plain bits
        *lanes, raw, nbits = parts[i : i + 4]
        for words in lanes:
            out += [varint(words.size), words.astype("<u2").tobytes()]
        out.append(varint(nbits))
        out.append(raw.astype("<u8").tobytes()[: 4 * ((nbits + 31) // 32)])
    stream = b"".join(out)
    return ID_OF_FIELD[field], [(STORED, stream)]


def apply_direct(piece: Piece, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, ValueError | None]:
    """Apply a ``direct`` piece to ``out`` (the range, holding its base), change by change:
    returns the positions written and their base bits (what puts them back), and None or the
    error that refuses the piece (the caller raises it once it has recorded what was
    written): ``ChangesMismatch`` when only the checksum differs, ValueError when the stream
    is damaged. Raises ValueError at once when the piece is refused before any write."""
    k, n, dtype = piece.count, out.size, out.dtype
    if not 0 < k <= n or len(piece.streams) != 1 or piece.streams[0][0] != STORED:
        raise ValueError("direct piece: 1 to its element count changes, one stored stream")
    field = FIELD_IDS.get(piece.aux)
    if field is None or field[1] != dtype.itemsize:
        raise ValueError(f"direct piece: field {piece.aux} for {dtype.itemsize}-byte elements")
    (shift, mask), width = field[0], 8 * dtype.itemsize
    kernel = kernels.load("direct")
    data = memoryview(piece.streams[0][1]).cast("B")
    buf = np.frombuffer(data, np.uint8)
    rowof = np.full(mask + 1, -1, np.int64)
    tables = np.empty((min(mask + 1, k), kernel.TOTAL), np.uint32)
    gtable = np.empty(kernel.TOTAL, np.uint32)
    m, at, check = kernel.read_header(buf, mask, k, rowof, tables, gtable)
    if m < 0:
        raise ValueError("direct piece: header is truncated or inconsistent")
    parts = []
    for _ in range(2):  # the gaps', then the differences' two lanes of words and plain bits
        lanes = []
        for _ in range(2):
            count, at = _read_varint(data, int(at))
            if count < 2 or at + 2 * count > len(data):
                raise ValueError("direct piece: truncated words")
            lanes.append(np.frombuffer(data, "<u2", count, at).astype(np.uint16))
            at += 2 * count
        nbits, at = _read_varint(data, at)
        nraw = (nbits + 31) // 32
        if at + 4 * nraw > len(data):
            raise ValueError("direct piece: truncated plain bits")
        padded = bytearray(8 * ((nraw + 1) // 2 + 2))  # whole 64-bit words, a zero one after
        padded[: 4 * nraw] = data[at : at + 4 * nraw]
        parts.append((*lanes, np.frombuffer(padded, "<u8").astype(np.uint64), nbits))
        at += 4 * nraw
    if at != len(data):
        raise ValueError("direct piece: bytes left over")
    done = np.empty(k, np.int64)
    if not kernel.positions(np.int64(m), gtable, *parts[0], np.int64(n), done):
        raise ValueError("direct piece: coded positions are truncated or inconsistent")
    old, state = np.empty(k, dtype), np.zeros(2, np.int64)
    kernel.apply(
        done, rowof, tables, *parts[1], np.uint64(check),
        np.int64(shift), np.int64(mask), np.int64(width), out, old, state,
    )  # fmt: skip
    written, status = int(state[0]), int(state[1])
    error: ValueError | None = None
    if status == kernel.DAMAGED:
        error = ValueError("direct piece: coded stream is truncated or inconsistent")
    elif status == kernel.MISMATCH:
        error = ChangesMismatch("the changed elements' checksum differs from the encoder's")
    return done[:written], old[:written], error

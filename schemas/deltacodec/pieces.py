"""Piece encodings of the weight-delta codec: what the bytes inside a chunk mean.

A *piece* is the element range ``[start, stop)`` of one tensor, encoded on its own so that a
chunk (a run of whole pieces) decodes without any other chunk. Values are bit patterns; nothing
here ever reads them as floats. Encodings, the smallest kept per piece: ``unchanged``,
``sparse``, ``exponent3``/``exponent2``, ``direct``, ``xor``/``diff``, ``planes`` and ``raw``.

Rules a maintainer must keep: encodings are only ever added (``ENCODINGS`` keeps their numbers),
so a decoder reads every piece an earlier encoder wrote; decoders raise ``ValueError`` on any
inconsistency.

Details: docs/delta-codec.md (Piece encodings).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import zstandard

from .bits import UINT_BY_WIDTH, as_bytes

UNCHANGED, SPARSE, XOR, DIFF, PLANES, RAW, EXPONENT, EXPONENT2, EXPONENT3, DIRECT = range(10)
ENCODINGS: Final = (
    "unchanged",
    "sparse",
    "xor",
    "diff",
    "planes",
    "raw",
    "exponent",
    "exponent2",
    "exponent3",
    "direct",
)
STORED, ZSTD = 0, 1
PIECE_HEADER: Final = struct.Struct("<IQQBBBxQ")
STREAM_HEADER: Final = struct.Struct("<BI")
ZSTD_LEVEL: Final = 1

# Pack value symbols in b bits when at least this share of them fits without an escape.
PACK_MIN_SHARE: Final = 0.8
# 8-byte words compared per step: two blocks of 512 KiB stay in L2 while compared and hashed.
BLOCK_WORDS: Final = 1 << 16


class Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...


Stream = tuple[int, bytes | memoryview]


@dataclass(frozen=True)
class Piece:
    """One encoded element range of one tensor (see the module docstring for the layout)."""

    tensor: int
    start: int
    stop: int
    encoding: int
    aux: int
    count: int
    streams: tuple[Stream, ...]

    @property
    def nbytes(self) -> int:
        return PIECE_HEADER.size + sum(STREAM_HEADER.size + len(d) for _, d in self.streams)

    def to_bytes(self) -> bytes:
        head = PIECE_HEADER.pack(
            self.tensor,
            self.start,
            self.stop,
            self.encoding,
            len(self.streams),
            self.aux,
            self.count,
        )
        parts = [head] + [STREAM_HEADER.pack(c, len(d)) for c, d in self.streams]
        return b"".join(parts + [bytes(d) for _, d in self.streams])


def read_piece(buf: memoryview, offset: int) -> tuple[Piece, int]:
    """Parse one piece at ``offset``; returns it (streams are zero-copy views) and the end."""
    if offset + PIECE_HEADER.size > len(buf):
        raise ValueError("truncated piece header")
    tensor, start, stop, enc, nstreams, aux, count = PIECE_HEADER.unpack_from(buf, offset)
    if enc >= len(ENCODINGS) or stop < start:
        raise ValueError(f"bad piece header (encoding {enc}, range {start}..{stop})")
    offset += PIECE_HEADER.size
    if offset + nstreams * STREAM_HEADER.size > len(buf):
        raise ValueError("truncated stream table")
    heads = [
        STREAM_HEADER.unpack_from(buf, offset + i * STREAM_HEADER.size) for i in range(nstreams)
    ]
    offset += nstreams * STREAM_HEADER.size
    streams = []
    for codec, length in heads:
        if codec not in (STORED, ZSTD) or offset + length > len(buf):
            raise ValueError("bad or truncated stream")
        streams.append((codec, buf[offset : offset + length]))
        offset += length
    return Piece(tensor, start, stop, enc, aux, count, tuple(streams)), offset


# --- streams and byte planes ------------------------------------------------------------


def pack_stream(data: np.ndarray, cctx: zstandard.ZstdCompressor) -> Stream:
    """zstd the bytes of a contiguous array, or store them when zstd does not shrink them."""
    raw = as_bytes(np.ascontiguousarray(data))
    if not raw.nbytes:
        return (STORED, b"")
    packed = cctx.compress(raw)
    return (ZSTD, packed) if len(packed) < raw.nbytes else (STORED, raw.tobytes())


def unpack_stream(
    stream: Stream, dctx: zstandard.ZstdDecompressor, expected: int | None, limit: int = 0
) -> np.ndarray:
    """The stream's bytes as a uint8 array; checks the length (``expected``, or at most
    ``limit`` when the length is data-dependent) before decompressing anything: a frame that
    does not declare its size, or declares another, is refused, and decompression is capped
    at that size."""
    codec, data = stream
    if expected is None and not limit:
        raise ValueError("a stream is decoded with a size bound only")
    if codec == ZSTD:
        cap = expected if expected is not None else limit
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd: {exc}") from exc
        if size < 0 or (expected is not None and size != expected) or (limit and size > limit):
            raise ValueError(f"zstd frame of unexpected size {size}")
        try:
            data = dctx.decompress(data, max_output_size=cap)
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd: {exc}") from exc
    out = np.frombuffer(data, dtype=np.uint8)
    if (expected is not None and out.size != expected) or (limit and out.size > limit):
        raise ValueError(f"stream of {out.size} bytes, expected {expected or limit}")
    return out


def split_planes(x: np.ndarray) -> list[np.ndarray]:
    """Byte planes of unsigned integers: plane j holds byte j (little-endian) of every element.
    Same-significance bytes together give zstd one statistic per plane."""
    width = x.dtype.itemsize
    if width == 1:
        return [x]
    u8 = x.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(u8[:, j]) for j in range(width)]


def join_planes(planes: list[np.ndarray], width: int, n: int) -> np.ndarray:
    """Inverse of ``split_planes``."""
    out = np.empty(n, dtype=UINT_BY_WIDTH[width])
    u8 = out.view(np.uint8).reshape(n, width)
    for j, plane in enumerate(planes):
        u8[:, j] = plane
    return out


def zigzag(d: np.ndarray) -> np.ndarray:
    """Map wrapped differences to small unsigned ints: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    bits = d.dtype.itemsize * 8
    s = d.view(d.dtype.str.replace("u", "i"))
    return ((s << 1) ^ (s >> (bits - 1))).view(d.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of ``zigzag`` (result is the wrapped difference as unsigned)."""
    signed = z.dtype.str.replace("u", "i")
    return ((z >> 1).view(signed) ^ -((z & 1).view(signed))).view(z.dtype)


# --- finding changes --------------------------------------------------------------------


@dataclass(frozen=True)
class Changes:
    """Changed positions (ascending; int32, int64 only for huge ranges) of a range with the
    wrapped differences ``new - old`` of their bit patterns (never 0), all encoders need."""

    pos: np.ndarray
    diff: np.ndarray

    def window(self, lo: int, hi: int) -> Changes:
        """The changes inside ``[lo, hi)``, positions made relative to ``lo``."""
        a, b = np.searchsorted(self.pos, (lo, hi))
        return Changes(self.pos[a:b] - lo, self.diff[a:b])


def _true_positions(mask: np.ndarray) -> np.ndarray:
    """``flatnonzero`` of a bool mask. When few flags are set (RL steps: ~7% of 8-byte words
    change at 1.7% changed bf16), first find the groups of 8 flags with any set, then the
    flags inside them: about 20% faster there, but slower on dense masks, hence the switch
    (taken on the share of groups with a flag, which costs no extra pass over the mask)."""
    if mask.size % 8:
        return np.flatnonzero(mask)
    groups = mask.view(np.uint64)
    g = np.flatnonzero(groups != 0)
    if g.size > 0.5 * groups.size:
        return np.flatnonzero(mask)
    inner = np.flatnonzero(groups.take(g).view(np.bool_))
    out = g.take(inner >> 3)
    out <<= 3
    out |= inner & 7
    return out


def find_changes(
    old: np.ndarray, new: np.ndarray, old_hasher: Hasher | None, new_hasher: Hasher | None
) -> Changes:
    """Elements whose bit patterns differ, found block by block while the block is in cache
    (comparing a whole range first was 10-25% slower): the element mask is scanned in groups
    of 8 flags (``_true_positions``) and the differences are gathered at the positions found.
    Hashers, when given, are fed each block while it is in cache too, so hashing costs no
    second pass over memory."""
    step = BLOCK_WORDS * 8 // old.itemsize
    mask = np.empty(min(step, old.size), dtype=bool)
    # int32 positions (ranges are far below 2**31 elements) halve the later passes.
    index = np.int32 if old.size < 2**31 else np.int64
    pos_parts, diff_parts = [np.empty(0, dtype=index)], [new[:0]]
    for s in range(0, old.size, step):
        a, b = old[s : s + step], new[s : s + step]
        pos = _true_positions(np.not_equal(a, b, out=mask[: a.size]))
        if old_hasher is not None:
            old_hasher.update(as_bytes(a))
        if new_hasher is not None:
            new_hasher.update(as_bytes(b))
        if pos.size:
            # take: no negative-index handling, measurably faster than b[pos] here.
            diff = b.take(pos)
            np.subtract(diff, a.take(pos), out=diff)
            at = pos.astype(index)
            np.add(at, s, out=at)
            pos_parts.append(at)
            diff_parts.append(diff)
    return Changes(np.concatenate(pos_parts), np.concatenate(diff_parts))


# --- encoders ---------------------------------------------------------------------------


def encode_positions(pos: np.ndarray) -> np.ndarray:
    """Gap code of ascending positions: gap g (unchanged elements before a change) becomes
    g // 255 bytes of 255, then one byte g % 255."""
    gaps = np.empty_like(pos)
    gaps[:1] = pos[:1]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    big = np.flatnonzero(gaps >= 255)
    code = gaps.astype(np.uint8)
    if not big.size:
        return code
    code[big] = gaps[big] % 255
    return np.insert(code, np.repeat(big, gaps[big] // 255), 255)


def decode_positions(code: np.ndarray, count: int) -> np.ndarray:
    """Inverse of ``encode_positions``: ``count`` ascending int64 positions. A terminating
    byte r advances by r + 1 elements, an escape byte by 255."""
    esc = np.flatnonzero(code == 255)
    if code.size - esc.size != count or (count and code[-1] == 255):
        raise ValueError("gap code does not hold the stated number of changes")
    # Widen first: cumsum casting uint8 -> int64 on the fly is three times slower.
    pos = code.astype(np.int64)
    pos += 1
    pos[esc] = 255
    np.cumsum(pos, out=pos)
    pos -= 1
    return np.delete(pos, esc) if esc.size else pos


def pack_values(z: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, list[Stream]]:
    """Value streams of a sparse piece and their packing (``aux``). Zigzag values are >= 1;
    symbols ``z - 1`` go in 2 (or 4) bits when at least ``PACK_MIN_SHARE`` of them fit below
    the escape symbol ``2**b - 1``; escaped ones keep their residual in byte planes."""
    k = z.size
    bits = 0
    for b in (2, 4):
        if k and np.count_nonzero(z < (1 << b)) >= PACK_MIN_SHARE * k:
            bits = b
            break
    if not bits:
        return 0, [pack_stream(p, cctx) for p in split_planes(z)]
    esc = (1 << bits) - 1
    per = 8 // bits
    # min(z - 1, esc) == min(z, esc + 1) - 1 as z >= 1: computed straight into uint8, in a
    # buffer already padded to whole bytes of symbols (no temporaries of the value width).
    main = np.zeros(-(-k // per) * per, dtype=np.uint8)
    np.minimum(z, esc + 1, out=main[:k], casting="unsafe")
    main[:k] -= 1
    residual = z[np.flatnonzero(main[:k] == esc)] - z.dtype.type(esc + 1)
    return bits, [pack_stream(pack_symbols(main, bits), cctx)] + [
        pack_stream(p, cctx) for p in split_planes(residual)
    ]


def pack_symbols(sym: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 symbols below ``2**bits`` (2 or 4), the first in the low bits of a byte.
    Four bytes read as one little-endian uint32 times 0x01041040 put symbol i at bits
    24 + 2i with no carries (the other partial products land below bit 24 or beyond 31):
    the packed byte is the top byte of each product."""
    per = 8 // bits
    if sym.size % per:
        sym = np.concatenate([sym, np.zeros(-sym.size % per, dtype=np.uint8)])
    if bits == 2:
        prod = np.multiply(sym.view("<u4"), np.uint32(0x01041040), dtype="<u4")
        return np.ascontiguousarray(prod.view(np.uint8)[3::4])  # top byte, little-endian
    pairs = sym.view("<u2")
    return (pairs | (pairs >> 4)).astype(np.uint8)


@functools.cache
def _delta_table(bits: int, dtype_str: str) -> np.ndarray:
    """For every packed byte, the wrapped differences of its ``8 // bits`` symbols (0 for
    the escape symbol: a real difference is never 0). Rows of up to 8 bytes are viewed as one
    unsigned int so that decoding is a single 1-D gather."""
    dtype, per, esc = np.dtype(dtype_str), 8 // bits, (1 << bits) - 1
    sym = (np.arange(256, dtype=np.uint16)[:, None] >> np.arange(0, 8, bits)) & esc
    table = unzigzag((sym + 1).astype(dtype))
    table[sym == esc] = 0
    row = per * dtype.itemsize
    if row in UINT_BY_WIDTH:
        table = np.ascontiguousarray(table).view(UINT_BY_WIDTH[row]).reshape(256)
    table.flags.writeable = False
    return table


def unpack_deltas(piece: Piece, dtype: np.dtype, dctx: zstandard.ZstdDecompressor) -> np.ndarray:
    """Inverse of ``pack_values`` followed by ``unzigzag``: the wrapped differences of a
    sparse piece (from its streams after the gap stream)."""
    k, bits, width = piece.count, piece.aux, dtype.itemsize
    streams = piece.streams[1:]
    if bits == 0:
        if len(streams) != width:
            raise ValueError("wrong number of value planes")
        return unzigzag(join_planes([unpack_stream(s, dctx, k) for s in streams], width, k))
    if bits not in (2, 4) or len(streams) != 1 + width:
        raise ValueError(f"bad value packing {bits}")
    packed = unpack_stream(streams[0], dctx, -(-k // (8 // bits)))
    deltas = _delta_table(bits, dtype.str)[packed].view(dtype).reshape(-1)[:k]
    at = np.flatnonzero(deltas == 0)
    residual = join_planes([unpack_stream(s, dctx, at.size) for s in streams[1:]], width, at.size)
    deltas[at] = unzigzag(residual + dtype.type(1 << bits))
    return deltas


def encode_sparse(
    tensor: int, start: int, stop: int, ch: Changes, cctx: zstandard.ZstdCompressor
) -> Piece:
    """Sparse piece from the changes of ``[start, stop)`` (positions relative to start)."""
    aux, values = pack_values(zigzag(ch.diff), cctx)
    streams = (pack_stream(encode_positions(ch.pos), cctx), *values)
    return Piece(tensor, start, stop, SPARSE, aux, int(ch.pos.size), streams)


def encode_dense(
    tensor: int,
    start: int,
    old: np.ndarray | None,
    new: np.ndarray,
    encoding: int,
    cctx: zstandard.ZstdCompressor,
) -> Piece:
    """A whole-range piece: ``xor``/``diff`` against ``old``, ``planes`` or ``raw`` of ``new``."""
    stop = start + new.size
    if encoding == RAW:
        return Piece(tensor, start, stop, RAW, 0, new.size, ((STORED, new.tobytes()),))
    if encoding == XOR:
        assert old is not None
        x = old ^ new
    elif encoding == DIFF:
        assert old is not None
        x = zigzag(new - old)
    else:
        x = new
    streams = tuple(pack_stream(p, cctx) for p in split_planes(x))
    return Piece(tensor, start, stop, encoding, 0, new.size, streams)


# --- applying ---------------------------------------------------------------------------

# Bytes applied per step: the base and output blocks stay in L2 while the block is copied,
# patched and hashed (256 KiB measured fastest; 1 MiB is 20% slower).
APPLY_BLOCK_BYTES: Final = 256 << 10


#: What restores an array written in place: ``(array, positions or None, old values)``.
Undo = list[tuple[np.ndarray, np.ndarray | None, np.ndarray]]


def undo_all(undo: Undo) -> None:
    """Put back every element recorded in ``undo`` (latest first)."""
    for array, pos, values in reversed(undo):
        if pos is None:
            np.copyto(array, values)
        else:
            array[pos] = values
    undo.clear()


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are the same memory (an in-place apply)."""
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def blocks(
    base: np.ndarray,
    out: np.ndarray,
    old_hasher: Hasher | None,
    new_hasher: Hasher | None,
    patch: Callable[[np.ndarray, np.ndarray, int, int], None],
) -> None:
    """Block by block, while the block is in cache: hash the base, copy it to ``out`` (unless
    in place), ``patch(base, out, lo, hi)``, hash the output."""
    inplace = same_memory(base, out)
    step = APPLY_BLOCK_BYTES // out.itemsize
    for s in range(0, out.size, step):
        o, b = out[s : s + step], base[s : s + step]
        if old_hasher is not None:
            old_hasher.update(as_bytes(b))
        if not inplace:
            np.copyto(o, b)
        patch(base, out, s, s + o.size)
        if new_hasher is not None:
            new_hasher.update(as_bytes(o))


def sparse_changes(
    piece: Piece, n: int, dtype: np.dtype, dctx: zstandard.ZstdDecompressor
) -> tuple[np.ndarray, np.ndarray]:
    """Positions and wrapped differences of a sparse (or unchanged) piece."""
    k = piece.count
    if piece.encoding == UNCHANGED:
        if k or piece.streams:
            raise ValueError("unchanged piece with data")
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=dtype)
    if k > n or not piece.streams:
        raise ValueError("sparse piece claims more changes than elements")
    # A gap code holds one byte per change plus one per 255 skipped elements.
    code = unpack_stream(piece.streams[0], dctx, None, limit=k + n // 255 + 1)
    pos = decode_positions(code, k)
    if k and pos[-1] >= n:
        raise ValueError("sparse position outside the piece")
    return pos, unpack_deltas(piece, dtype, dctx)


def apply_changes(
    base: np.ndarray,
    out: np.ndarray,
    pos: np.ndarray,
    deltas: np.ndarray,
    old_hasher: Hasher | None,
    new_hasher: Hasher | None,
) -> None:
    """out = base with ``deltas`` added at ``pos``, block by block, hashing each block of
    base and output while it is still in cache."""
    n = out.size
    step = APPLY_BLOCK_BYTES // out.itemsize  # a power of two, so pos & (step - 1) is in-block
    rel = pos & (step - 1)
    bounds = [0, *np.searchsorted(pos, np.arange(step, n, step)).tolist(), pos.size]

    def patch(b: np.ndarray, o: np.ndarray, lo: int, hi: int) -> None:
        j0, j1 = bounds[lo // step], bounds[lo // step + 1]
        if j1 > j0:
            p = rel[j0:j1]
            ob, bb = o[lo:hi], b[lo:hi]
            ob[p] = bb[p] + deltas[j0:j1]

    blocks(base, out, old_hasher, new_hasher, patch)

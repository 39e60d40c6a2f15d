"""The ``exponent`` piece encoding: changes coded conditioned on the base's exponents.

The decoder already holds the base. Under an optimizer step, whether a float weight changes
depends strongly on its exponent (a step of a given size crosses a rounding boundary more
often where representable values are closer): on bf16 Adam steps the changed fraction runs
from ~0.1% in the largest octave to ~100% in the smallest. So changes are coded per
*bucket*, the base element's exponent field ``(bits >> shift) & mask``, which the decoder
computes from its own copy of the base. Within a bucket, in position order:

- a bucket at most ``BITMAP_FROM`` changed codes its changed elements as gaps (bucket
  elements skipped before each), with the byte code of ``deltacodec_pieces``; one at least
  ``BITMAP_TO`` changed codes its unchanged elements that way; one in between is a bitmap
  (one bit per element of the bucket, little-endian bit order), where a Huffman code of
  whole bytes gets closer to the entropy than a gap code;
- buckets of one mode and a similar density share a *class*: one event stream (gap code or
  bitmap) each, so that each zstd stream sees one homogeneous distribution;
- values are the zigzag wrapped differences ``new - old`` of the bit patterns, in *value
  groups* (``_groups``: their spread grows with the bucket's changed fraction), each packed
  as ``deltacodec_pieces.pack_values`` does.

Layout: piece ``aux`` = number of classes, ``count`` = changed elements; stream 0 the header,
little-endian uint32 ``[shift, mask, classes, groups, packing of each group, then per class:
bucket count, then per bucket: bucket | mode << 28, changes, events (gaps; bits of a
bitmap), value group]``; then one event stream per class, then each group's value streams
(``width`` byte planes, or one packed stream plus ``width`` residual planes). A group's
differences follow header order. Decoding is exact for every bit pattern (NaN, inf,
subnormals: the key is just bits of the pattern); any inconsistency raises ValueError, and
applying checks that every event and every difference was used exactly.

The per-element scans (bucket ranks when encoding, bucket countdowns when applying) are
compiled with numba: numpy has no vector form of "the r-th element of bucket b" short of a
stable sort of the whole range, ten times slower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
import zstandard

from .deltacodec_pieces import (
    SPARSE,
    Piece,
    Stream,
    decode_positions,
    encode_gaps,
    pack_stream,
    pack_values,
    unpack_deltas,
    unpack_stream,
    zigzag,
)

#: Exponent field (shift, mask) of each float dtype tag the encoding is used for.
EXPONENT_FIELDS: Final[dict[str, tuple[int, int]]] = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float64": (52, 0x7FF),
}
#: Most buckets a piece may declare (a float64 exponent has 2048).
MAX_BUCKETS: Final = 1 << 11
#: Classes are -log2(changed fraction) rounded down, at most this.
MAX_CLASS: Final = 15
_FAR: Final = 1 << 62  # "no further event in this bucket": never counted down to 0
#: Bucket modes: gaps between changed elements, gaps between unchanged ones, a bitmap.
CHANGED, UNCHANGED, BITMAP = 0, 1, 2
#: Changed fractions between these are coded as bitmaps (a byte-wise Huffman code of 8
#: flags gets within a few percent of their entropy there, a gap code does not).
BITMAP_FROM: Final = 0.25
BITMAP_TO: Final = 0.75
#: A dense bucket with this many changes has a value group of its own.
OWN_GROUP_FROM: Final = 512

_kernels: dict[str, Callable[..., Any]] = {}


def _compiled() -> dict[str, Callable[..., Any]]:
    """The numba kernels, compiled (or loaded from numba's cache) on first use only, so that
    importing the codec stays cheap."""
    if _kernels:
        return _kernels
    import numba

    jit = numba.njit(cache=True, nogil=True, boundscheck=False)

    @jit
    def ranks(old: Any, pos: Any, shift: int, mask: int, cnt: Any, gaps: Any, bkt: Any) -> None:
        """Per change (``pos`` ascending): its bucket and the bucket-b elements skipped since
        the previous change of bucket b. ``cnt`` ends as the elements of each bucket."""
        last = np.zeros(cnt.size, np.int64)
        j, k = 0, pos.size
        nxt = pos[0] if k else -1
        stop = pos[k - 1] + 1 if k else 0
        for i in range(stop):
            b = (np.int64(old[i]) >> shift) & mask
            c = cnt[b]
            if i == nxt:
                gaps[j] = c - last[b]
                last[b] = c + 1
                bkt[j] = b
                j += 1
                nxt = pos[j] if j < k else -1
            cnt[b] = c + 1
        for i in range(stop, old.size):
            cnt[(np.int64(old[i]) >> shift) & mask] += 1

    @jit
    def apply(
        base: Any,
        out: Any,
        lo: int,
        hi: int,
        shift: int,
        mask: int,
        mode: Any,
        rem: Any,
        gp: Any,
        ge: Any,
        gaps: Any,
        bitmap: Any,
        dp: Any,
        de: Any,
        deltas: Any,
        done: Any,
        old: Any,
        state: Any,
    ) -> None:
        """For i in [lo, hi), with b the bucket of base[i]: whether element i changed is
        the next bit of b's bitmap (mode BITMAP), or whether it is an *event*, where b's
        countdown ``rem`` reaches 0 and the next gap of b is loaded: events are the changed
        elements (CHANGED) or the unchanged ones (UNCHANGED). A changed element gets
        out[i] = base[i] + the next difference of b; ``out`` may be ``base`` (in place) and
        is written at changes only. Positions written and their base bits go to ``done``
        and ``old``; ``state`` holds [count written, elements beyond what b declares]."""
        n = state[0]
        for i in range(lo, hi):
            x = base[i]
            b = (np.int64(x) >> shift) & mask
            md = mode[b]
            if md == 2:
                q = gp[b]
                if q >= ge[b]:
                    state[1] += 1
                    continue
                changed = (bitmap[q >> 3] >> (q & 7)) & 1 == 1
                gp[b] = q + 1
            else:
                r = rem[b]
                if r == 0:
                    g = gp[b] + 1
                    gp[b] = g
                    rem[b] = gaps[g] if g < ge[b] else _FAR
                    changed = md == 0
                else:
                    rem[b] = r - 1
                    changed = md == 1
            if changed:
                d = dp[b]
                if d >= de[b]:
                    state[1] += 1
                    continue
                out[i] = x + deltas[d]
                dp[b] = d + 1
                done[n] = i
                old[n] = x
                n += 1
        state[0] = n

    _kernels.update(ranks=ranks, apply=apply)
    return _kernels


# --- encoder ---------------------------------------------------------------------------


def _modes(changes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per bucket with changes: its mode and its class. Fractions changed up to
    ``BITMAP_FROM`` code the changed elements as gaps, from ``BITMAP_TO`` the unchanged ones,
    in between a bitmap; a class gathers buckets of one mode whose event density (gaps) or
    changed fraction (bitmaps) is alike, ``-log2`` rounded down, or eighths."""
    p = changes / counts
    mode = np.where(p <= BITMAP_FROM, CHANGED, np.where(p >= BITMAP_TO, UNCHANGED, BITMAP))
    events = np.where(mode == UNCHANGED, counts - changes, changes)
    level = np.clip(np.floor(-np.log2(np.maximum(events, 1) / counts)), 0, MAX_CLASS)
    cls = np.where(
        mode == BITMAP, 2 * (MAX_CLASS + 1) + np.floor(8 * p), level + (MAX_CLASS + 1) * mode
    )
    return mode, cls.astype(np.int64)


def _groups(changes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The value group of each bucket with changes. The differences (in units of the
    bucket's spacing) grow with the changed fraction: buckets up to 1/8 changed (mostly
    +-1) share one group, up to 1/2 another; denser buckets, whose differences span more
    units with every smaller exponent, have one group each when they have
    ``OWN_GROUP_FROM`` changes, else share one."""
    p = changes / counts
    own = 3 + np.arange(changes.size)
    dense = np.where(changes >= OWN_GROUP_FROM, own, 2)
    return np.where(p <= 1 / 8, 0, np.where(p <= 1 / 2, 1, dense))


def encode_exponent(
    old: np.ndarray,
    pos: np.ndarray,
    diff: np.ndarray,
    field: tuple[int, int],
    cctx: zstandard.ZstdCompressor,
) -> tuple[int, list[Stream]]:
    """Streams of the changes ``(pos, diff)`` of a range whose base is ``old``; returns the
    class count (``aux``) and the streams (module docstring)."""
    shift, mask = field
    k = pos.size
    cnt = np.zeros(mask + 1, np.int64)
    gaps = np.empty(k, np.int64)
    bkt = np.empty(k, np.uint16)  # a 16-bit key: numpy sorts it by radix
    _compiled()["ranks"](old, pos, shift, mask, cnt, gaps, bkt)
    by_bucket = np.argsort(bkt, kind="stable")
    changes = np.bincount(bkt, minlength=mask + 1)
    present = np.flatnonzero(changes)
    kb, nb = changes[present], cnt[present]
    mode, cls = _modes(kb, nb)
    group = np.unique(_groups(kb, nb), return_inverse=True)[1]
    cuts = np.concatenate([[0], np.cumsum(kb)])
    rows: list[list[int]] = []
    streams: list[Stream] = []
    members: list[int] = []  # buckets (indices into present) in header order
    for c in np.unique(cls).tolist():
        parts = []
        rows.append([])
        for m in np.flatnonzero(cls == c).tolist():
            g = gaps.take(by_bucket[cuts[m] : cuts[m + 1]])
            events = _events(g, int(nb[m]), int(mode[m]))
            parts.append(events)
            size = int(nb[m]) if mode[m] == BITMAP else events.size
            rows[-1] += [int(present[m]) | int(mode[m]) << 28, int(kb[m]), size, int(group[m])]
            members.append(m)
        joined = np.concatenate(parts)
        code = (
            np.packbits(joined, bitorder="little") if joined.dtype == bool else encode_gaps(joined)
        )
        streams.append(pack_stream(code, cctx))
    z = zigzag(diff)
    packings: list[int] = []
    for v in range(int(group.max()) + 1):
        idx = [by_bucket[cuts[m] : cuts[m + 1]] for m in members if group[m] == v]
        bits, values = pack_values(z.take(np.concatenate(idx)), cctx)
        packings.append(bits)
        streams += values
    header = [shift, mask, len(rows), len(packings), *packings]
    for r in rows:
        header += [len(r) // 4, *r]
    head = pack_stream(np.array(header, dtype="<u4"), cctx)
    return len(rows), [head, *streams]


def _events(gaps: np.ndarray, count: int, mode: int) -> np.ndarray:
    """What a bucket of ``count`` elements whose changed elements have ``gaps`` codes in
    ``mode``: those gaps, the gaps between its unchanged elements, or its bitmap (bool)."""
    if mode == CHANGED:
        return gaps
    changed = np.zeros(count, dtype=bool)
    changed[np.cumsum(gaps + 1) - 1] = True
    return changed if mode == BITMAP else gaps_of(np.flatnonzero(~changed))


# --- decoder ---------------------------------------------------------------------------


class Plan:
    """A decoded exponent piece, ready to apply: per bucket its mode, its events (gaps, or
    bits of the bitmap) and its differences, as ranges of the concatenated arrays."""

    def __init__(self, shift: int, mask: int, deltas: np.ndarray) -> None:
        self.shift, self.mask = shift, mask
        self.mode = np.zeros(mask + 1, np.uint8)
        self.gp, self.ge = np.zeros(mask + 1, np.int64), np.zeros(mask + 1, np.int64)
        self.dp, self.de = np.zeros(mask + 1, np.int64), np.zeros(mask + 1, np.int64)
        self.rem = np.full(mask + 1, _FAR, np.int64)
        self.gaps = np.empty(0, np.int64)
        self.bitmap = np.empty(0, np.uint8)
        self.deltas = deltas
        self.done = np.empty(deltas.size, np.int64)
        self.old = np.empty(deltas.size, deltas.dtype)
        self.state = np.zeros(2, np.int64)

    def run(self, base: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
        """Apply the changes of elements ``[lo, hi)`` (called block by block, in order)."""
        _compiled()["apply"](
            base,
            out,
            lo,
            hi,
            self.shift,
            self.mask,
            self.mode,
            self.rem,
            self.gp,
            self.ge,
            self.gaps,
            self.bitmap,
            self.dp,
            self.de,
            self.deltas,
            self.done,
            self.old,
            self.state,
        )

    @property
    def ndone(self) -> int:
        return int(self.state[0])

    def finish(self) -> None:
        """Raise unless every event and every difference was used, exactly."""
        if (
            self.state[1]
            or not np.array_equal(self.gp, self.ge)
            or not np.array_equal(self.dp, self.de)
        ):
            raise ValueError("exponent piece does not match its range")


Row = tuple[int, int, int, int, int]  # bucket, mode, changes, events (bits), value group


def read_header(
    head: np.ndarray, count: int, classes: int
) -> tuple[int, int, list[int], list[list[Row]]]:
    """``(shift, mask, value packings, classes as lists of rows)`` of a header stream,
    checked against the piece (``count`` changes, ``classes`` classes)."""
    if head.size % 4:
        raise ValueError("exponent header is not uint32s")
    h = head.view("<u4").astype(np.int64).tolist()
    if len(h) < 4 or h[2] != classes or len(h) < 4 + h[3]:
        raise ValueError("exponent header does not match the piece")
    shift, mask, ngroups = h[0], h[1], h[3]
    if shift >= 64 or mask >= MAX_BUCKETS or mask & (mask + 1):
        raise ValueError(f"bad exponent field ({shift}, {mask:#x})")
    packings, at = h[4 : 4 + ngroups], 4 + ngroups
    out: list[list[Row]] = []
    seen: set[int] = set()
    for _ in range(classes):
        nb = h[at] if at < len(h) else 0
        flat = h[at + 1 : at + 1 + 4 * nb]
        at += 1 + 4 * nb
        if len(flat) != 4 * nb or not nb:
            raise ValueError("truncated exponent header")
        rows = [
            (w & 0xFFF_FFFF, w >> 28, kb, m, g)
            for w, kb, m, g in zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True)
        ]
        if len({r[1] == BITMAP for r in rows}) != 1:
            raise ValueError("exponent class mixes bitmaps and gaps")
        for b, md, kb, m, g in rows:
            bad = b > mask or b in seen or kb < 1 or md > BITMAP or g >= ngroups
            if bad or (md == CHANGED and m != kb) or (md == BITMAP and m < kb):
                raise ValueError("bad bucket in exponent header")
            seen.add(b)
        out.append(rows)
    if at != len(h) or sum(r[2] for rows in out for r in rows) != count:
        raise ValueError("exponent header does not add up to the piece's changes")
    return shift, mask, packings, out


def decode_exponent(
    piece: Piece, n: int, dtype: np.dtype, dctx: zstandard.ZstdDecompressor
) -> Plan:
    """The plan of an exponent piece over ``n`` elements of ``dtype`` (checks every stream's
    size before decompressing it)."""
    k = piece.count
    if not 0 < k <= n or not piece.streams:
        raise ValueError("exponent piece must hold 1 to its element count changes")
    head = unpack_stream(piece.streams[0], dctx, None, limit=4 * (4 + 5 * k + piece.aux))
    shift, mask, packings, table = read_header(head, k, piece.aux)
    if shift >= 8 * dtype.itemsize:
        raise ValueError("exponent field outside the element")
    gaps, bitmaps, ngaps, nbytes = [], [], 0, 0
    rows = [r for cls in table for r in cls]
    event_at: list[int] = []
    for cls, stream in zip(table, piece.streams[1 : 1 + len(table)], strict=True):
        total = sum(r[3] for r in cls)
        if total > n:
            raise ValueError("exponent class with more events than elements")
        if cls[0][1] == BITMAP:
            bitmaps.append(unpack_stream(stream, dctx, -(-total // 8)))
            event_at += (8 * nbytes + np.cumsum([0] + [r[3] for r in cls[:-1]])).tolist()
            nbytes += -(-total // 8)
        else:
            gaps.append(
                gaps_of(
                    decode_positions(
                        unpack_stream(stream, dctx, None, limit=total + n // 255 + 1), total
                    )
                )
            )
            event_at += (ngaps + np.cumsum([0] + [r[3] for r in cls[:-1]])).tolist()
            ngaps += total
    if len(piece.streams) < 1 + len(table):
        raise ValueError("exponent piece lacks streams")
    deltas, value_at = _values(piece, 1 + len(table), packings, rows, n, dtype, dctx)
    plan = Plan(shift, mask, deltas)
    plan.gaps = np.concatenate(gaps) if gaps else plan.gaps
    plan.bitmap = np.concatenate(bitmaps) if bitmaps else plan.bitmap
    for (b, md, kb, m, _), e, d in zip(rows, event_at, value_at, strict=True):
        plan.mode[b] = md
        plan.gp[b], plan.ge[b], plan.dp[b], plan.de[b] = e, e + m, d, d + kb
        if md != BITMAP and m:
            plan.rem[b] = plan.gaps[e]
    return plan


def _values(
    piece: Piece,
    at: int,
    packings: list[int],
    rows: list[Row],
    n: int,
    dtype: np.dtype,
    dctx: zstandard.ZstdDecompressor,
) -> tuple[np.ndarray, list[int]]:
    """The differences of every value group, concatenated, and where each row's start."""
    width, parts, starts, total = dtype.itemsize, [], {}, 0
    for g, bits in enumerate(packings):
        kg = 0
        for i, r in enumerate(rows):
            if r[4] == g:
                starts[i] = total + kg
                kg += r[2]
        nstreams = width if bits == 0 else 1 + width
        sub = tuple(piece.streams[at : at + nstreams])
        if len(sub) != nstreams:
            raise ValueError("exponent piece lacks value streams")
        at += nstreams
        fake = Piece(0, 0, n, SPARSE, bits, kg, ((0, b""), *sub))
        parts.append(unpack_deltas(fake, dtype, dctx))
        total += kg
    if at != len(piece.streams):
        raise ValueError("exponent piece has extra streams")
    deltas = np.concatenate(parts) if parts else np.empty(0, dtype)
    return deltas, [starts[i] for i in range(len(rows))]


def gaps_of(pos: np.ndarray) -> np.ndarray:
    """The gaps of ascending positions (inverse of ``cumsum(gaps + 1) - 1``)."""
    out = np.empty(pos.size, np.int64)
    out[:1] = pos[:1]
    np.subtract(pos[1:], pos[:-1], out=out[1:])
    out[1:] -= 1
    return out

"""The base-conditioned piece encodings ``exponent2`` and ``exponent3``: changes coded per
bucket of the base's exponent.

The decoder holds the base, and whether a float weight changes under an optimizer step depends
strongly on its exponent; so changes are coded per bucket (the base element's exponent field):
each changed element's gap within its bucket and its zigzag difference of bit patterns.
``exponent2`` (encoding 7) uses the adaptive range coder, ``exponent3`` (encoding 8) the faster
static rANS coder, and the encoder keeps the smaller; ``exponent`` (encoding 6) is only decoded
(``deltacodec.legacy``).

Rules a maintainer must keep: decoding is exact for every bit pattern; any inconsistency raises
``ValueError``, and applying checks that every gap and difference was used exactly.

Details: docs/delta-codec.md (Base-conditioned pieces).
"""

from __future__ import annotations

from typing import Final

import numpy as np

from . import kernels, rangecoder, rans
from .pieces import STORED, Piece, Stream, unzigzag, zigzag

#: Exponent field (shift, mask) of each float dtype tag the encoding is used for.
EXPONENT_FIELDS: Final[dict[str, tuple[int, int]]] = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float64": (52, 0x7FF),
}
#: Most buckets a piece may declare (a float64 exponent has 2048).
MAX_BUCKETS: Final = 1 << 11
#: ``aux`` of an ``exponent2`` piece: its exponent field, and the element width it goes with.
FIELD_IDS: Final[dict[int, tuple[tuple[int, int], int]]] = {
    1: (EXPONENT_FIELDS["bfloat16"], 2),
    2: (EXPONENT_FIELDS["float16"], 2),
    3: (EXPONENT_FIELDS["float32"], 4),
    4: (EXPONENT_FIELDS["float64"], 8),
}
ID_OF_FIELD: Final = {field: i for i, (field, _) in FIELD_IDS.items()}

# --- encoder ---------------------------------------------------------------------------


def _table(
    old: np.ndarray, pos: np.ndarray, diff: np.ndarray, field: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Present buckets, their per-bucket gaps and zigzag differences (bucket-major) and
    their starts: what both coders code."""
    shift, mask = field
    k = pos.size
    cnt = np.zeros(mask + 1, np.int64)
    gaps = np.empty(k, np.int64)
    bkt = np.empty(k, np.uint16)  # a 16-bit key: numpy sorts it by radix
    kernels.load("exponent").ranks(old, pos, shift, mask, cnt, gaps, bkt)
    order = np.argsort(bkt, kind="stable")
    changes = np.bincount(bkt, minlength=mask + 1)
    present = np.flatnonzero(changes)
    starts = np.concatenate([[0], np.cumsum(changes[present])])
    return present, gaps.take(order), zigzag(diff).take(order), starts


def encode_exponent2(
    old: np.ndarray, pos: np.ndarray, diff: np.ndarray, field: tuple[int, int]
) -> tuple[int, list[Stream]]:
    """``aux`` and the one stream of an ``exponent2`` piece of the changes ``(pos, diff)``
    (at least one) of a range whose base is ``old``."""
    present, gaps, z, starts = _table(old, pos, diff, field)
    coded = rangecoder.encode(present, gaps, z, starts, old.size)
    return ID_OF_FIELD[field], [(STORED, coded)]


def encode_exponent3(
    old: np.ndarray, pos: np.ndarray, diff: np.ndarray, field: tuple[int, int]
) -> tuple[int, list[Stream]]:
    """``aux`` and the one stream of an ``exponent3`` piece (``exponent2``'s layout, the
    static rANS coder's stream)."""
    present, gaps, z, starts = _table(old, pos, diff, field)
    return ID_OF_FIELD[field], [(STORED, rans.encode(present, gaps, z, starts))]


# --- decoder ---------------------------------------------------------------------------


class ExponentPlan:
    """A decoded exponent piece, ready to apply: per bucket its countdown and its range of
    the concatenated gaps and differences."""

    def __init__(self, shift: int, mask: int, gaps: np.ndarray, deltas: np.ndarray) -> None:
        self.shift, self.mask = shift, mask
        self.gaps, self.deltas = gaps, deltas
        self.ptr = np.zeros(mask + 1, np.int64)
        self.end = np.zeros(mask + 1, np.int64)
        self.rem = np.full(mask + 1, kernels.FAR, np.int64)
        self.done = np.empty(deltas.size, np.int64)
        self.old = np.empty(deltas.size, deltas.dtype)
        self.state = np.zeros(2, np.int64)  # changes written, refused (1) or not

    def run(self, base: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
        """Apply the changes of elements ``[lo, hi)`` (called block by block, in order)."""
        kernels.load("exponent").apply(
            base,
            out,
            lo,
            hi,
            self.shift,
            self.mask,
            self.rem,
            self.ptr,
            self.end,
            self.gaps,
            self.deltas,
            self.done,
            self.old,
            self.state,
        )

    @property
    def ndone(self) -> int:
        return int(self.state[0])

    def finish(self) -> None:
        """Raise unless every gap and every difference was used, exactly."""
        if (
            self.state[1]
            or self.ndone != self.deltas.size
            or not np.array_equal(self.ptr, self.end)
        ):
            raise ValueError("exponent piece does not match its range")


def decode_exponent2(
    piece: Piece, n: int, dtype: np.dtype, name: str = "exponent2"
) -> ExponentPlan:
    """The plan of an ``exponent2`` piece (or, ``name`` "exponent3", of an ``exponent3``
    piece: same layout, other coder) over ``n`` elements of ``dtype``."""
    k = piece.count
    if not 0 < k <= n or len(piece.streams) != 1 or piece.streams[0][0] != STORED:
        raise ValueError(f"{name} piece: 1 to its element count changes, one stored stream")
    field = FIELD_IDS.get(piece.aux)
    if field is None or field[1] != dtype.itemsize:
        raise ValueError(f"{name} piece: field {piece.aux} for {dtype.itemsize}-byte elements")
    (shift, mask), width = field[0], 8 * dtype.itemsize
    coded = np.frombuffer(piece.streams[0][1], np.uint8)
    decoder = rans.decode if name == "exponent3" else rangecoder.decode
    buckets, starts, gaps, z = decoder(coded, k, mask, width, n)
    return plan_of(shift, mask, dtype, buckets, starts, gaps, z)


def plan_of(
    shift: int,
    mask: int,
    dtype: np.dtype,
    buckets: np.ndarray,
    starts: np.ndarray,
    gaps: np.ndarray,
    z: np.ndarray,
) -> ExponentPlan:
    """The plan of a decoded table (``buckets``, ``starts``) and numbers."""
    plan = ExponentPlan(shift, mask, gaps, unzigzag(z.astype(dtype)))
    plan.ptr[buckets], plan.end[buckets] = starts[:-1], starts[1:]
    plan.rem[buckets] = gaps[starts[:-1]]
    return plan

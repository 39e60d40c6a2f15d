"""Generic codings of one version's change that ``rlstream bench deltas`` measures the codec
against: each a few lines a reviewer could write, lossless given the base (which a reader of a
delta holds, as the codec's decoder does), all zstd level 19 on one thread.

- ``xor_byteplanes``: old XOR new, split into byte planes;
- ``sparse``: the gaps between changed positions (u4) and the changed values (XOR or new, the
  smaller), as they are;
- ``sparse_shuffled``: the same streams split into byte planes first (byte shuffle);
- ``bucket_bitmap``: positions in order of the base's bf16 exponent (the decoder computes the
  order from the base), a packed bitmap of which changed in that order, and the changed values'
  XOR in byte planes: the side information the codec itself conditions on;
- ``xor_byteplanes_long``: ``xor_byteplanes`` with zstd's long-distance matching and a 128 MiB
  window.

Each coding's byte count is what it writes, with 8 bytes per tensor for its counts;
``decode_bucket_bitmap`` and ``decode_sparse_shuffled`` invert the two new ones (the tests
round-trip them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

LEVEL = 19
NAMES = (
    "xor_byteplanes",
    "sparse",
    "sparse_shuffled",
    "bucket_bitmap",
    "xor_byteplanes_long",
)


def _zstd(long: bool = False) -> Callable[[bytes], bytes]:
    import zstandard

    if long:
        params = zstandard.ZstdCompressionParameters.from_level(
            LEVEL, window_log=27, enable_ldm=True
        )
        return zstandard.ZstdCompressor(compression_params=params).compress
    return zstandard.ZstdCompressor(level=LEVEL, threads=0).compress


def planes(values: np.ndarray) -> list[bytes]:
    """``values`` split into byte planes (byte 0 of every value, then byte 1, ...)."""
    as_bytes = np.ascontiguousarray(values).view(np.uint8).reshape(-1, values.itemsize)
    return [as_bytes[:, i].tobytes() for i in range(values.itemsize)]


def _unplanes(parts: list[bytes], dtype: np.dtype) -> np.ndarray:
    stacked = np.stack([np.frombuffer(p, np.uint8) for p in parts], axis=1)
    return np.ascontiguousarray(stacked).view(dtype).reshape(-1)


def exponent_order(base: np.ndarray) -> np.ndarray:
    """Positions of a bf16 tensor (its bit patterns) in order of the exponent, stable."""
    return np.argsort((base >> 7) & 0xFF, kind="stable")


def encode_bucket_bitmap(old: np.ndarray, new: np.ndarray) -> list[bytes]:
    """``bucket_bitmap``'s streams (module docstring): the bitmap, then the XOR's planes."""
    order = exponent_order(old)
    xor = (old ^ new)[order]
    changed = xor != 0
    return [np.packbits(changed).tobytes(), *planes(xor[changed])]


def decode_bucket_bitmap(old: np.ndarray, streams: list[bytes]) -> np.ndarray:
    order = exponent_order(old)
    changed = np.unpackbits(np.frombuffer(streams[0], np.uint8), count=old.size).astype(bool)
    xor = np.zeros(old.size, old.dtype)
    xor[changed] = _unplanes(streams[1:], old.dtype)
    out = old.copy()
    out[order] ^= xor
    return out


def _positions(xor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The changed positions of ``xor`` and the gaps between them (u4)."""
    changed = np.flatnonzero(xor)
    return changed, (np.diff(changed, prepend=-1) - 1).astype("<u4")


def _shuffled(xor: np.ndarray, changed: np.ndarray, gaps: np.ndarray) -> list[bytes]:
    return [*planes(gaps), *planes(xor[changed])]


def encode_sparse_shuffled(old: np.ndarray, new: np.ndarray) -> list[bytes]:
    """``sparse_shuffled``'s streams: the gaps' four planes, then the XOR's planes."""
    xor = old ^ new
    return _shuffled(xor, *_positions(xor))


def decode_sparse_shuffled(old: np.ndarray, streams: list[bytes]) -> np.ndarray:
    gaps = _unplanes(streams[:4], np.dtype("<u4")).astype(np.int64)
    changed = np.cumsum(gaps + 1) - 1
    out = old.copy()
    out[changed] ^= _unplanes(streams[4:], old.dtype)
    return out


def coded_bytes(old: np.ndarray, new: np.ndarray) -> dict[str, int]:
    """Bytes each coding writes for one tensor's change (``NAMES``)."""
    z, z_long = _zstd(), _zstd(long=True)

    def size(parts: list[bytes], compress: Callable[[bytes], bytes] = z) -> int:
        return sum(len(compress(p)) for p in parts) + 8

    xor = old ^ new
    xor_planes = planes(xor)
    changed, gaps = _positions(xor)
    values = min(len(z(xor[changed].tobytes())), len(z(new[changed].tobytes())))
    return {
        "xor_byteplanes": size(xor_planes),
        "sparse": len(z(gaps.tobytes())) + values + 8,
        "sparse_shuffled": size(_shuffled(xor, changed, gaps)),
        "bucket_bitmap": size(encode_bucket_bitmap(old, new)),
        "xor_byteplanes_long": size(xor_planes, z_long),
    }


def generic_ratios(pairs: list[Any]) -> dict[str, float]:
    """Raw bytes over each coding's bytes, summed over every tensor of every (old, new) pair."""
    raw, total = 0, dict.fromkeys(NAMES, 0)
    for old, new in pairs:
        for name, (_, b) in new.items():
            raw += b.nbytes
            for coding, n in coded_bytes(old[name][1], b).items():
                total[coding] += n
    return {coding: raw / n for coding, n in total.items()}

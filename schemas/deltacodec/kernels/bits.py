"""Raw bit and byte I/O shared by the codec's coders (``rans``, ``direct``): plain bits into
zeroed 64-bit words and back, Elias-gamma numbers, a gap's remainder bits, and LEB128 varints.
Inlined into the kernels that call them (see the package's note on numba's cache)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

inline = numba.njit(inline="always", boundscheck=False)
u64 = np.uint64


@inline
def put_bits(raw: Any, at: Any, value: Any, nbits: Any) -> Any:
    """Write the ``nbits`` (at most 32) low bits of ``value`` at bit ``at`` of ``raw`` (zeroed
    64-bit words: bit k of the stream is bit k % 64 of word k // 64) and return the next bit.
    No branch: a byte-at-a-time writer mispredicts how many bytes each write fills."""
    v = u64(value) & ((u64(1) << u64(nbits)) - u64(1))
    i, off = at >> 6, u64(at & 63)
    raw[i] |= v << off
    raw[i + 1] |= (v >> u64(1)) >> (u64(63) - off)
    return at + nbits


@inline
def put_gamma(raw: Any, at: Any, v: Any) -> Any:
    """v >= 1 (uint64): its bit length n - 1 as zeros, then a one, then its n - 1 low bits."""
    n = 1
    while n < 64 and (v >> u64(n)) != u64(0):
        n += 1
    zeros = n - 1
    while zeros > 0:
        z = min(32, zeros)
        at = put_bits(raw, at, 0, z)
        zeros -= z
    at = put_bits(raw, at, 1, 1)
    low = n - 1
    while low > 0:
        b = min(32, low)
        low -= b
        at = put_bits(raw, at, (v >> u64(low)) & u64((1 << b) - 1), b)
    return at


@inline
def get_bits(raw: Any, state: Any, nbits: Any) -> Any:
    """Read ``nbits`` (at most 32); past the end reads zeros and counts them in ``over``.
    ``state`` is (accumulator, bits in it, next byte, bytes read past the end)."""
    acc, have, pos, over = state
    while have < nbits:
        if pos < raw.size:
            acc |= u64(raw[pos]) << u64(have)
        else:
            over += 1
        pos += 1
        have += 8
    v = acc & ((u64(1) << u64(nbits)) - u64(1))
    return v, (acc >> u64(nbits), have - nbits, pos, over)


@inline
def get_gamma(raw: Any, state: Any) -> Any:
    """Inverse of ``put_gamma``; 0 when the code is longer than 64 bits (damaged)."""
    n = 1
    while True:
        bit, state = get_bits(raw, state, 1)
        if bit != u64(0):
            break
        n += 1
        if n > 64 or state[3] > 0:
            return u64(0), state
    v = u64(1)
    low = n - 1
    while low > 0:
        b = min(32, low)
        low -= b
        chunk, state = get_bits(raw, state, b)
        v = (v << u64(b)) | chunk
    return v, state


@inline
def put_remainder(raw: Any, at: Any, g: Any, m: Any) -> Any:
    """The ``m`` low bits of ``g``, in chunks of 32 from the low end."""
    if m > 32:
        at = put_bits(raw, at, g & 0xFFFF_FFFF, 32)
        return put_bits(raw, at, (g >> 32) & ((1 << (m - 32)) - 1), m - 32)
    return put_bits(raw, at, g & ((1 << m) - 1), m)


@inline
def get_remainder(raw: Any, state: Any, m: Any) -> Any:
    if m > 32:
        lo, state = get_bits(raw, state, 32)
        hi, state = get_bits(raw, state, m - 32)
        return np.int64(lo | (hi << u64(32))), state
    v, state = get_bits(raw, state, m)
    return np.int64(v), state


@inline
def put_varint(out: Any, pos: Any, v: Any) -> Any:
    while v >= 0x80:
        out[pos] = (v & 0x7F) | 0x80
        pos += 1
        v >>= 7
    out[pos] = v
    return pos + 1


@inline
def get_varint(buf: Any, pos: Any, end: Any) -> Any:
    """A LEB128 number of at most 5 bytes from ``buf[pos:end]``; -1 when it does not fit."""
    v, shift = np.int64(0), 0
    while pos < end and shift < 35:
        byte = np.int64(buf[pos])
        pos += 1
        v |= (byte & 0x7F) << shift
        if byte < 0x80:
            return v, pos
        shift += 7
    return np.int64(-1), pos

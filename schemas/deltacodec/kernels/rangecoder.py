"""The range coder's numba kernels (``deltacodec.rangecoder``), at module level so that numba's
on-disk cache serves every process after the first; imported on first use only."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ..rangecoder import FAST, MANTISSA_CONTEXT_BITS, SLOW, TOP

jit = numba.njit(cache=True, nogil=True, boundscheck=False)
inline = numba.njit(inline="always", boundscheck=False)
u64 = np.uint64


@inline
def adapt(probs: Any, i: Any, bit: Any) -> None:
    fast, slow = np.int64(probs[i, 0]), np.int64(probs[i, 1])
    if bit == 0:
        probs[i, 0] = fast + ((65536 - fast) >> FAST)
        probs[i, 1] = slow + ((65536 - slow) >> SLOW)
    else:
        probs[i, 0] = fast - (fast >> FAST)
        probs[i, 1] = slow - (slow >> SLOW)


@inline
def shift_low(low: Any, cache: Any, csize: Any, pos: Any, out: Any) -> Any:
    if low < 0xFF00_0000 or (low >> 32) != 0:
        carry = low >> 32
        temp = cache
        while True:
            if pos < out.size:  # past the end: counted only (the caller retries)
                out[pos] = (temp + carry) & 0xFF
            pos += 1
            temp = 0xFF
            csize -= 1
            if csize == 0:
                break
        cache = (low >> 24) & 0xFF
    return (low & 0x00FF_FFFF) << 8, cache, csize + 1, pos


@inline
def enc_bit(s: Any, out: Any, probs: Any, i: Any, bit: Any) -> Any:
    low, rng, cache, csize, pos = s
    p = (np.int64(probs[i, 0]) + np.int64(probs[i, 1])) >> 1
    bound = (rng >> 16) * p
    adapt(probs, i, bit)
    if bit == 0:
        rng = bound
    else:
        low += bound
        rng -= bound
    while rng < TOP:
        rng <<= 8
        low, cache, csize, pos = shift_low(low, cache, csize, pos, out)
    return low, rng, cache, csize, pos


@inline
def enc_direct(s: Any, out: Any, value: Any, nbits: Any) -> Any:
    """``nbits`` (at most 8) plain bits of ``value``."""
    low, rng, cache, csize, pos = s
    rng >>= nbits
    low += value * rng
    while rng < TOP:
        rng <<= 8
        low, cache, csize, pos = shift_low(low, cache, csize, pos, out)
    return low, rng, cache, csize, pos


@inline
def enc_number(s: Any, out: Any, head: Any, man: Any, v: Any, tree: Any) -> Any:
    """v >= 1 (uint64): its bit length n by a 6-level binary tree (``tree``) or in unary
    (``head``: 64 contexts), then its bits below the top one (``man``: (65, 8))."""
    n = 1
    while n < 64 and (v >> u64(n)) != u64(0):
        n += 1
    if tree:
        t = 1
        for level in range(5, -1, -1):
            bit: Any = ((n - 1) >> level) & 1
            s = enc_bit(s, out, head, t, bit)
            t = 2 * t + bit
    else:
        for i in range(n - 1):
            s = enc_bit(s, out, head, i, 1)
        if n < 64:
            s = enc_bit(s, out, head, n - 1, 0)
    t = 1
    pos = n - 2
    while pos >= 0 and n - 2 - pos < MANTISSA_CONTEXT_BITS:
        bit = np.int64((v >> u64(pos)) & u64(1))
        s = enc_bit(s, out, man[n], t, bit)
        t = 2 * t + bit
        pos -= 1
    while pos >= 0:
        m = min(8, pos + 1)
        chunk = np.int64((v >> u64(pos + 1 - m)) & u64((1 << m) - 1))
        s = enc_direct(s, out, chunk, m)
        pos -= m
    return s


@jit
def encode(buckets: Any, gaps: Any, values: Any, starts: Any, out: Any) -> Any:
    """The bucket table, then gaps (int64, >= 0) and zigzag differences (uint64, >= 1)
    of the changes in bucket-major order; bucket j (``buckets[j]``) owns
    [starts[j], starts[j + 1]). Returns the bytes used (written while they fit)."""
    nb = starts.size - 1
    s = (np.int64(0), np.int64(0xFFFF_FFFF), np.int64(0), np.int64(1), np.int64(0))
    thead = np.full((64, 2), 32768, np.uint16)
    tman = np.full((65, 8, 2), 32768, np.uint16)
    s = enc_number(s, out, thead, tman, u64(nb + 1), False)
    for j in range(nb):
        step = buckets[j] - (buckets[j - 1] if j else -1)
        s = enc_number(s, out, thead, tman, u64(step), False)
        s = enc_number(s, out, thead, tman, u64(starts[j + 1] - starts[j]), False)
    ghead = np.full((64, 2), 32768, np.uint16)
    gman = np.full((65, 8, 2), 32768, np.uint16)
    vhead = np.full((64, 2), 32768, np.uint16)
    vman = np.full((65, 8, 2), 32768, np.uint16)
    for j in range(nb):
        for i in range(starts[j], starts[j + 1]):
            s = enc_number(s, out, ghead, gman, u64(gaps[i] + 1), True)
        for i in range(starts[j], starts[j + 1]):
            s = enc_number(s, out, vhead, vman, values[i], False)
    low, _, cache, csize, pos = s
    for _ in range(5):
        low, cache, csize, pos = shift_low(low, cache, csize, pos, out)
    return pos


@inline
def refill(code: Any, pos: Any, over: Any, buf: Any) -> Any:
    nxt: Any = 0
    if pos < buf.size:
        nxt = np.int64(buf[pos])
    else:
        over += 1
    return ((code << 8) | nxt) & 0xFFFF_FFFF, pos + 1, over


@inline
def dec_bit(s: Any, buf: Any, probs: Any, i: Any) -> Any:
    code, rng, pos, over = s
    p = (np.int64(probs[i, 0]) + np.int64(probs[i, 1])) >> 1
    bound = (rng >> 16) * p
    if code < bound:
        rng = bound
        bit = 0
    else:
        code -= bound
        rng -= bound
        bit = 1
    adapt(probs, i, bit)
    while rng < TOP:
        rng <<= 8
        code, pos, over = refill(code, pos, over, buf)
    return bit, (code, rng, pos, over)


@inline
def dec_direct(s: Any, buf: Any, nbits: Any) -> Any:
    code, rng, pos, over = s
    rng >>= nbits
    value = min(code // rng, (1 << nbits) - 1)  # more only in a damaged stream
    code -= value * rng
    while rng < TOP:
        rng <<= 8
        code, pos, over = refill(code, pos, over, buf)
    return value, (code, rng, pos, over)


@inline
def dec_number(s: Any, buf: Any, head: Any, man: Any, tree: Any) -> Any:
    n = 1
    if tree:
        t = 1
        for _ in range(6):
            bit, s = dec_bit(s, buf, head, t)
            t = 2 * t + bit
        n = t - 64 + 1
    else:
        while n < 64:
            bit, s = dec_bit(s, buf, head, n - 1)
            if bit == 0:
                break
            n += 1
    v = u64(1)
    t = 1
    pos = n - 2
    while pos >= 0 and n - 2 - pos < MANTISSA_CONTEXT_BITS:
        bit, s = dec_bit(s, buf, man[n], t)
        t = 2 * t + bit
        v = (v << u64(1)) | u64(bit)
        pos -= 1
    while pos >= 0:
        m = min(8, pos + 1)
        chunk, s = dec_direct(s, buf, m)
        v = (v << u64(m)) | u64(chunk)
        pos -= m
    return v, s


@jit
def decode(
    buf: Any, mask: Any, width_bits: Any, buckets: Any, starts: Any, gaps: Any, values: Any
) -> Any:
    """Inverse of ``encode`` for ``gaps.size`` changes: fills the table (``buckets``,
    ``starts``; room for ``mask + 1`` buckets) and the numbers; returns the bucket
    count, or -1 when the stream ran out, the table is not ascending within ``mask``
    or does not add up to the changes, or a number does not fit (a gap past 2**62, a
    difference past the element width)."""
    code, pos, over = np.int64(0), np.int64(0), np.int64(0)
    for _ in range(5):
        code, pos, over = refill(code, pos, over, buf)
    s = (code, np.int64(0xFFFF_FFFF), pos, over)
    limit = u64(0xFFFF_FFFF_FFFF_FFFF)
    if width_bits < 64:
        limit = (u64(1) << u64(width_bits)) - u64(1)
    thead = np.full((64, 2), 32768, np.uint16)
    tman = np.full((65, 8, 2), 32768, np.uint16)
    v, s = dec_number(s, buf, thead, tman, False)
    nb = np.int64(v) - 1
    if v > u64(mask + 2):
        return -1
    prev: Any = -1
    total: Any = 0
    for j in range(nb):
        step, s = dec_number(s, buf, thead, tman, False)
        count, s = dec_number(s, buf, thead, tman, False)
        if step > u64(mask + 1) or count > u64(gaps.size) or s[3] > 4:
            return -1
        prev += np.int64(step)
        starts[j] = total
        total += np.int64(count)
        buckets[j] = prev
        if prev > mask or total > gaps.size:
            return -1
    starts[nb] = total
    if total != gaps.size:
        return -1
    ghead = np.full((64, 2), 32768, np.uint16)
    gman = np.full((65, 8, 2), 32768, np.uint16)
    vhead = np.full((64, 2), 32768, np.uint16)
    vman = np.full((65, 8, 2), 32768, np.uint16)
    for j in range(nb):
        for i in range(starts[j], starts[j + 1]):
            v, s = dec_number(s, buf, ghead, gman, True)
            if v > u64(1 << 62):
                return -1
            gaps[i] = np.int64(v) - 1
        for i in range(starts[j], starts[j + 1]):
            v, s = dec_number(s, buf, vhead, vman, False)
            if v > limit:
                return -1
            values[i] = v
        if s[3] > 4:
            return -1
    return -1 if s[3] > 4 else nb

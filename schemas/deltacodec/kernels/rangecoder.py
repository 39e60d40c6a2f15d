"""The adaptive binary range coder's numba kernels (rules in ``deltacodec.rangecoder``): the
byte-level coder (the LZMA range coder: 32-bit range, carry through a cached byte, plain bits),
the encoder and decoder of the model ``exponent2`` pieces use, and the decoder of the first
model (``exponent`` pieces, no longer written; kept so that old versions still decode). Both
decoders read the bucket table and the differences with the same code (``read_table``,
``read_values``); the models differ in how a context adapts (``FIRST``: the mean of two
estimates moved 1/16 and 1/128 of the way; ``SECOND``: one estimate moved by the count of what
it coded) and in how a gap is coded (a tree of contexts for its bit length, or a geometric
law). The model is a constant at every call, so numba compiles each decoder for its own."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

# The models' constants live here, beside the kernels that compile them in: numba's cache is
# keyed on this file, so changing one recompiles.
FIRST, SECOND = 1, 2  # the model: ``exponent`` pieces, ``exponent2`` pieces
TOP = 1 << 24  # the range is renormalised (a byte out) whenever it falls below this
FAST, SLOW = 4, 7  # FIRST: adaptation shifts of the two estimates a context averages
MANTISSA_CONTEXT_BITS = 3  # FIRST: a number's bits below the top one coded under contexts
#: SECOND: a context's adaptation shift after n bits (index min(n, 31)): 1/2, 1/4, 1/4, ... 1/64.
RATE_SHIFTS = tuple(min(6, (n + 1).bit_length()) for n in range(32))
RESET_COUNT = 3  # value contexts' counts at a bucket's start (they adapt by 1/8 again)
TABLE_CONTEXT_BITS = 3
VALUE_CONTEXT_BITS = 3
GAP_ESCAPE = 16  # unary steps of a gap before its escape
GAP_EXACT_BITS = 2  # a gap's low bits coded with their probabilities (the rest plain)
PRIOR_UNITS = 16  # the gap model counts in 1/16 elements (its prior is fractional)

jit = numba.njit(cache=True, nogil=True, boundscheck=False)
inline = numba.njit(inline="always", boundscheck=False)
u64 = np.uint64
ONE = 1 << 30  # probabilities of the gap model are Q30
HALF = 1 << 29


# --- the byte-level coder -----------------------------------------------------------------


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
def refill(code: Any, pos: Any, over: Any, buf: Any) -> Any:
    nxt: Any = 0
    if pos < buf.size:
        nxt = np.int64(buf[pos])
    else:
        over += 1
    return ((code << 8) | nxt) & 0xFFFF_FFFF, pos + 1, over


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
def start(buf: Any, nbytes: Any) -> Any:
    """The decoder's state after its first ``nbytes`` bytes."""
    code, pos, over = np.int64(0), np.int64(0), np.int64(0)
    for _ in range(nbytes):
        code, pos, over = refill(code, pos, over, buf)
    return code, np.int64(0xFFFF_FFFF), pos, over


# --- contexts -----------------------------------------------------------------------------


@inline
def prob(probs: Any, i: Any, model: Any) -> Any:
    """Q16 probability of a 0 in context ``i``."""
    if model == FIRST:
        return (np.int64(probs[i, 0]) + np.int64(probs[i, 1])) >> 1
    return probs[i, 0]


@inline
def adapt(probs: Any, i: Any, bit: Any, model: Any, rates: Any) -> None:
    if model == FIRST:
        fast, slow = np.int64(probs[i, 0]), np.int64(probs[i, 1])
        if bit == 0:
            probs[i, 0] = fast + ((65536 - fast) >> FAST)
            probs[i, 1] = slow + ((65536 - slow) >> SLOW)
        else:
            probs[i, 0] = fast - (fast >> FAST)
            probs[i, 1] = slow - (slow >> SLOW)
        return
    n = probs[i, 1]
    s = rates[min(n, rates.size - 1)]
    p = probs[i, 0]
    if bit == 0:
        probs[i, 0] = p + ((65536 - p) >> s)
    else:
        probs[i, 0] = p - (p >> s)
    probs[i, 1] = n + 1


@inline
def code_bit(s: Any, out: Any, p: Any, bit: Any) -> Any:
    """One bit whose 0 has probability ``p`` / 65536 (0 < p < 65536)."""
    low, rng, cache, csize, pos = s
    bound = (rng >> 16) * p
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
def enc_bit(s: Any, out: Any, probs: Any, i: Any, bit: Any, rates: Any) -> Any:
    p = probs[i, 0]
    adapt(probs, i, bit, SECOND, rates)
    return code_bit(s, out, p, bit)


@inline
def enc_number(s: Any, out: Any, head: Any, man: Any, v: Any, mcb: Any, rates: Any) -> Any:
    """v >= 1: its bit length n in unary (``head``), its ``mcb`` bits below the top one under
    the contexts of (n, the bits so far) (``man``), the rest plain."""
    n = 1
    while n < 64 and (v >> u64(n)) != u64(0):
        n += 1
    for i in range(n - 1):
        s = enc_bit(s, out, head, i, 1, rates)
    if n < 64:
        s = enc_bit(s, out, head, n - 1, 0, rates)
    t: Any = 1
    pos = n - 2
    while pos >= 0 and n - 2 - pos < mcb:
        bit = np.int64((v >> u64(pos)) & u64(1))
        s = enc_bit(s, out, man[n], t, bit, rates)
        t = 2 * t + bit
        pos -= 1
    while pos >= 0:
        m = min(8, pos + 1)
        chunk = np.int64((v >> u64(pos + 1 - m)) & u64((1 << m) - 1))
        s = enc_direct(s, out, chunk, m)
        pos -= m
    return s


@inline
def powers(c: Any, s: Any, r: Any) -> Any:
    """r[i] = (1 - c/s) ** (2**i), Q30, for i up to m, the first with r[m] <= 1/2; returns m."""
    p = (c << 30) // s
    r[0] = ONE - min(max(p, 1), ONE - 1)
    m = 0
    while r[m] > HALF and m < 62:
        r[m + 1] = (r[m] * r[m]) >> 30
        m += 1
    return m


@inline
def low_bits_table() -> Any:
    """Q16 probability of a 0 for a bit that is 1 with probability x / (1 + x), x in
    [1/2, 1] by its top 12 bits (Q30 >> 18): the gap's low bits."""
    t = np.empty(4097, np.int64)
    for j in range(4097):
        t[j] = 65536 - (j << 16) // (4096 + j)
    return t


@inline
def run_p0(x: Any) -> Any:
    return min(max(65536 - (x >> 14), 16), 65520)


@inline
def enc_gap(
    s: Any, out: Any, g: Any, m: Any, r: Any, lut: Any, eh: Any, em: Any, rates: Any
) -> Any:
    """Gap g under the geometric law of ``powers`` (``r``, ``m``): g >> m in unary (escape
    after ``GAP_ESCAPE``), then its m low bits, independent under that law: the top
    ``GAP_EXACT_BITS`` with their probabilities, the rest plain (each within 0.04 of 1/2)."""
    q = g >> m
    p0 = run_p0(r[m])
    for _ in range(min(q, GAP_ESCAPE)):
        s = code_bit(s, out, p0, 1)
    if q < GAP_ESCAPE:
        s = code_bit(s, out, p0, 0)
    else:
        s = enc_number(s, out, eh, em, u64(q - GAP_ESCAPE + 1), 3, rates)
    plain = max(0, m - GAP_EXACT_BITS)
    for i in range(m - 1, plain - 1, -1):
        s = code_bit(s, out, lut[r[i] >> 18], (g >> i) & 1)
    while plain > 0:
        k = min(8, plain)
        plain -= k
        s = enc_direct(s, out, (g >> plain) & ((1 << k) - 1), k)
    return s


@inline
def bucket_prior(c: Any, sz: Any, kb: Any, n: Any) -> Any:
    """The gap model's state at a bucket's start: one change's weight, at the previous
    bucket's rate (the piece's rate for the first), at least kb / n."""
    w = PRIOR_UNITS
    prior = (w * sz) // c
    return min(max(prior, w + 1), (w * n) // kb)


@inline
def fresh(rows: Any, cols: Any) -> Any:
    """Contexts at probability 1/2 with nothing counted: ``rows`` x ``cols``."""
    a = np.zeros((rows, cols, 2), np.int64)
    a[:, :, 0] = 32768
    return a


@inline
def fresh_row(cols: Any) -> Any:
    a = np.zeros((cols, 2), np.int64)
    a[:, 0] = 32768
    return a


@inline
def relearn(head: Any, man: Any) -> None:
    for i in range(head.shape[0]):
        head[i, 1] = min(head[i, 1], RESET_COUNT)
    for i in range(man.shape[0]):
        for j in range(man.shape[1]):
            man[i, j, 1] = min(man[i, j, 1], RESET_COUNT)


@inline
def gap_state(n: Any, count: Any) -> Any:
    """The second model's state after the table: escape and value contexts, the gap law's
    powers and low-bit table, and the gap model's counts (one change over the piece's rate)."""
    eh, em = fresh_row(64), fresh(65, 8)
    vh, vm = fresh_row(64), fresh(65, 1 << VALUE_CONTEXT_BITS)
    c, sz = np.int64(PRIOR_UNITS), np.int64(PRIOR_UNITS) * n // max(1, count)
    return eh, em, vh, vm, np.zeros(64, np.int64), low_bits_table(), c, sz


@inline
def bucket_start(starts: Any, j: Any, c: Any, sz: Any, n: Any) -> Any:
    """Bucket j's changes ``a..b`` and the gap model at its start: its counts (``c``, ``sz``:
    ``bucket_prior``), the law's shift (measured at the first change) and when to measure it."""
    a, b = starts[j], starts[j + 1]
    return a, b, np.int64(PRIOR_UNITS), bucket_prior(c, sz, b - a, n), 0, a


@inline
def gap_law(i: Any, first: Any, c: Any, sz: Any, r: Any, m: Any, due: Any) -> Any:
    """The gap law's shift ``m`` at change ``i`` of the bucket starting at ``first``: measured
    again at change ``due``, then after a run of changes growing with the bucket (to 256)."""
    if i == due:
        return powers(c, sz, r), i + 1 + min((i - first) >> 3, 255)
    return m, due


@jit
def encode(buckets: Any, gaps: Any, values: Any, starts: Any, n: Any, out: Any) -> Any:
    """The bucket table, then per bucket its gaps and its zigzag differences (bucket j owns
    [starts[j], starts[j + 1]) of ``gaps`` and ``values``); ``n`` elements in the range.
    Returns the bytes used (written while they fit)."""
    rates = np.array(RATE_SHIFTS, np.int64)
    nb = starts.size - 1
    s = (np.int64(0), np.int64(0xFFFF_FFFF), np.int64(0), np.int64(1), np.int64(0))
    th, tm = fresh_row(64), fresh(65, 1 << TABLE_CONTEXT_BITS)
    s = enc_number(s, out, th, tm, u64(nb + 1), TABLE_CONTEXT_BITS, rates)
    for j in range(nb):
        step = buckets[j] - (buckets[j - 1] if j else -1)
        s = enc_number(s, out, th, tm, u64(step), TABLE_CONTEXT_BITS, rates)
        count = starts[j + 1] - starts[j]
        s = enc_number(s, out, th, tm, u64(count), TABLE_CONTEXT_BITS, rates)
    eh, em, vh, vm, r, lut, c, sz = gap_state(n, gaps.size)
    for j in range(nb):
        a, b, c, sz, m, due = bucket_start(starts, j, c, sz, n)
        for i in range(a, b):
            m, due = gap_law(i, a, c, sz, r, m, due)
            s = enc_gap(s, out, gaps[i], m, r, lut, eh, em, rates)
            c, sz = c + PRIOR_UNITS, sz + PRIOR_UNITS * (gaps[i] + 1)
        relearn(vh, vm)
        for i in range(a, b):
            s = enc_number(s, out, vh, vm, values[i], VALUE_CONTEXT_BITS, rates)
    return finish(s, out)


@inline
def finish(s: Any, out: Any) -> Any:
    """Flush with the value of [low, low + range) that ends in the most zero bits (the
    caller drops trailing zero bytes, which the decoder reads back as padding)."""
    low, rng, cache, csize, pos = s
    for k in range(32, -1, -1):
        v = (low + (1 << k) - 1) & ~((1 << k) - 1)
        if v <= low + rng - 1:
            low = v
            break
    for _ in range(5):
        low, cache, csize, pos = shift_low(low, cache, csize, pos, out)
    return pos


@inline
def dec_bit_p(s: Any, buf: Any, p: Any) -> Any:
    code, rng, pos, over = s
    bound = (rng >> 16) * p
    if code < bound:
        rng = bound
        bit = 0
    else:
        code -= bound
        rng -= bound
        bit = 1
    while rng < TOP:
        rng <<= 8
        code, pos, over = refill(code, pos, over, buf)
    return bit, (code, rng, pos, over)


@inline
def dec_bit(s: Any, buf: Any, probs: Any, i: Any, model: Any, rates: Any) -> Any:
    bit, s = dec_bit_p(s, buf, prob(probs, i, model))
    adapt(probs, i, bit, model, rates)
    return bit, s


@inline
def dec_number(
    s: Any, buf: Any, head: Any, man: Any, mcb: Any, tree: Any, model: Any, rates: Any
) -> Any:
    """Inverse of ``enc_number`` (``tree``: the bit length by the 6-level binary tree of
    contexts of the first model's gaps)."""
    n = 1
    if tree:
        t = 1
        for _ in range(6):
            bit, s = dec_bit(s, buf, head, t, model, rates)
            t = 2 * t + bit
        n = t - 64 + 1
    else:
        while n < 64:
            bit, s = dec_bit(s, buf, head, n - 1, model, rates)
            if bit == 0:
                break
            n += 1
    v = u64(1)
    t = 1
    pos = n - 2
    while pos >= 0 and n - 2 - pos < mcb:
        bit, s = dec_bit(s, buf, man[n], t, model, rates)
        t = 2 * t + bit
        v = (v << u64(1)) | u64(bit)
        pos -= 1
    while pos >= 0:
        m = min(8, pos + 1)
        chunk, s = dec_direct(s, buf, m)
        v = (v << u64(m)) | u64(chunk)
        pos -= m
    return v, s


@inline
def dec_gap(
    s: Any, buf: Any, n: Any, m: Any, r: Any, lut: Any, eh: Any, em: Any, rates: Any
) -> Any:
    """Inverse of ``enc_gap``; a gap that cannot be below ``n`` comes back as -1."""
    p0 = run_p0(r[m])
    q = np.int64(0)
    while q < GAP_ESCAPE:
        bit, s = dec_bit_p(s, buf, p0)
        if bit == 0:
            break
        q += 1
    if q == GAP_ESCAPE:
        v, s = dec_number(s, buf, eh, em, 3, False, SECOND, rates)
        if v > u64(1 << 40):
            return np.int64(-1), s
        q += np.int64(v) - 1
    if q > (n >> m):  # a gap of n or more: refused before it can overflow
        return np.int64(-1), s
    g = q
    plain = max(0, m - GAP_EXACT_BITS)
    for i in range(m - 1, plain - 1, -1):
        bit, s = dec_bit_p(s, buf, lut[r[i] >> 18])
        g = (g << 1) | bit
    while plain > 0:
        k = min(8, plain)
        plain -= k
        chunk, s = dec_direct(s, buf, k)
        g = (g << k) | chunk
    return g, s


@inline
def width_limit(width_bits: Any) -> Any:
    """The largest zigzag difference of an element of ``width_bits`` bits."""
    if width_bits < 64:
        return (u64(1) << u64(width_bits)) - u64(1)
    return u64(0xFFFF_FFFF_FFFF_FFFF)


@inline
def read_table(
    s: Any,
    buf: Any,
    th: Any,
    tm: Any,
    model: Any,
    rates: Any,
    mask: Any,
    buckets: Any,
    starts: Any,
    count: Any,
) -> Any:
    """The bucket table (its size + 1, then per bucket its distance from the previous one and
    its changes) into ``buckets`` and ``starts``: (bucket count, state), the count -1 when the
    stream ran out, the table is not ascending within ``mask``, does not add up to ``count``
    changes, or (second model) names a bucket without changes."""
    mcb = MANTISSA_CONTEXT_BITS if model == FIRST else TABLE_CONTEXT_BITS
    v, s = dec_number(s, buf, th, tm, mcb, False, model, rates)
    if v > u64(mask + 2):
        return np.int64(-1), s
    nb = np.int64(v) - 1
    prev: Any = -1
    total: Any = 0
    for j in range(nb):
        step, s = dec_number(s, buf, th, tm, mcb, False, model, rates)
        k, s = dec_number(s, buf, th, tm, mcb, False, model, rates)
        empty = model == SECOND and k == u64(0)
        if step > u64(mask + 1) or k > u64(count) or empty or s[3] > 4:
            return np.int64(-1), s
        prev += np.int64(step)
        starts[j] = total
        total += np.int64(k)
        buckets[j] = prev
        if prev > mask or total > count:
            return np.int64(-1), s
    starts[nb] = total
    return (nb if total == count else np.int64(-1)), s


@inline
def read_values(
    s: Any,
    buf: Any,
    head: Any,
    man: Any,
    mcb: Any,
    model: Any,
    rates: Any,
    values: Any,
    a: Any,
    b: Any,
    limit: Any,
) -> Any:
    """The zigzag differences ``a..b`` of a bucket: (False when one exceeds ``limit``, state)."""
    for i in range(a, b):
        v, s = dec_number(s, buf, head, man, mcb, False, model, rates)
        if v > limit:
            return False, s
        values[i] = v
    return True, s


@jit
def decode(
    buf: Any,
    mask: Any,
    width_bits: Any,
    n: Any,
    buckets: Any,
    starts: Any,
    gaps: Any,
    values: Any,
) -> Any:
    """Inverse of ``encode`` for ``gaps.size`` changes in a range of ``n`` elements: fills
    the table (``buckets``, ``starts``; room for ``mask + 1`` buckets) and the numbers;
    returns the bucket count, or -1 when the stream ran out, the table is not ascending
    within ``mask`` or does not add up to the changes, a gap is not below ``n``, or a
    difference does not fit ``width_bits``."""
    s = start(buf, 4)  # the encoder's first byte, always 0, is not sent
    rates = np.array(RATE_SHIFTS, np.int64)
    th, tm = fresh_row(64), fresh(65, 1 << TABLE_CONTEXT_BITS)
    nb, s = read_table(s, buf, th, tm, SECOND, rates, mask, buckets, starts, gaps.size)
    if nb < 0:
        return -1
    limit = width_limit(width_bits)
    eh, em, vh, vm, r, lut, c, sz = gap_state(n, gaps.size)
    for j in range(nb):
        a, b, c, sz, m, due = bucket_start(starts, j, c, sz, n)
        for i in range(a, b):
            m, due = gap_law(i, a, c, sz, r, m, due)
            g, s = dec_gap(s, buf, n, m, r, lut, eh, em, rates)
            if g < 0 or g >= n:
                return -1
            gaps[i] = g
            c, sz = c + PRIOR_UNITS, sz + PRIOR_UNITS * (g + 1)
        relearn(vh, vm)
        ok, s = read_values(s, buf, vh, vm, VALUE_CONTEXT_BITS, SECOND, rates, values, a, b, limit)
        if not ok or s[3] > 4:
            return -1
    return -1 if s[3] > 4 else nb


@jit
def decode_first(
    buf: Any, mask: Any, width_bits: Any, buckets: Any, starts: Any, gaps: Any, values: Any
) -> Any:
    """The first model's decoder (``exponent`` pieces): the same table, then per bucket its
    gaps (+ 1, the bit length by a tree of contexts) and its zigzag differences, every context
    the mean of two estimates (``FIRST``). Returns the bucket count, or -1 when the stream ran
    out, the table is not ascending within ``mask`` or does not add up to ``gaps.size``
    changes, or a number does not fit (a gap past 2**62, a difference past the element
    width)."""
    s = start(buf, 5)
    rates = np.array(RATE_SHIFTS, np.int64)  # not read by FIRST's contexts
    th, tm = np.full((64, 2), 32768, np.uint16), np.full((65, 8, 2), 32768, np.uint16)
    nb, s = read_table(s, buf, th, tm, FIRST, rates, mask, buckets, starts, gaps.size)
    if nb < 0:
        return -1
    limit = width_limit(width_bits)
    gh, gm = np.full((64, 2), 32768, np.uint16), np.full((65, 8, 2), 32768, np.uint16)
    vh, vm = np.full((64, 2), 32768, np.uint16), np.full((65, 8, 2), 32768, np.uint16)
    for j in range(nb):
        a, b = starts[j], starts[j + 1]
        for i in range(a, b):
            v, s = dec_number(s, buf, gh, gm, MANTISSA_CONTEXT_BITS, True, FIRST, rates)
            if v > u64(1 << 62):
                return -1
            gaps[i] = np.int64(v) - 1
        mcb = MANTISSA_CONTEXT_BITS
        ok, s = read_values(s, buf, vh, vm, mcb, FIRST, rates, values, a, b, limit)
        if not ok or s[3] > 4:
            return -1
    return -1 if s[3] > 4 else nb

"""The numba kernels of the static rANS coder (``exponent3`` pieces; rules in
``deltacodec.rans``), at module level so that numba's on-disk cache serves every process after
the first; imported on first use only.

Every read of the coded stream is bounds-checked: a kernel fed damaged bytes returns -1, and it
never writes outside the arrays it is given."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .bits import (
    get_bits,
    get_gamma,
    get_remainder,
    get_varint,
    put_bits,
    put_gamma,
    put_remainder,
    put_varint,
)

# The model's constants live here, beside the kernels that compile them in: numba's cache is
# keyed on this file, so changing one recompiles.
SCALE = 12  # probabilities are counts out of 2**SCALE
TOTAL = 1 << SCALE
RANS_L = 1 << 16  # the state stays in [RANS_L, 2**32); it moves 16 bits at a time
GAP_SYMBOLS = 48  # most quotient symbols of a gap model before its escape
VALUE_DIRECT = 4  # magnitudes (|difference| - 1) below this are their own symbol
VALUE_TOP_BITS = 20  # above, two symbols per bit length up to this one, then the escape
VALUE_SYMBOLS = VALUE_DIRECT + 2 * (VALUE_TOP_BITS - 2)  # the escape's symbol
VALUE_TABLE_MIN = 16  # buckets with fewer changes send no value counts (uniform symbols)
THETA_MAX = 0.84  # a gap model's quotient ratio is at most this (its remainder near uniform)
THETA_MAX_Q30 = int(THETA_MAX * (1 << 30))
MAX_SHIFT = 40  # most remainder bits of a gap (gaps are below 2**40 elements)
SEARCH_BELOW = 64  # buckets with fewer changes decode by search instead of a slot table

jit = numba.njit(cache=True, nogil=True, boundscheck=False)
inline = numba.njit(inline="always", boundscheck=False)
u64 = np.uint64


# --- models ------------------------------------------------------------------------------


@inline
def fix_sum(freq: Any, nsym: Any, total: Any) -> None:
    """Make ``freq[:nsym]`` (each at least 1, nsym <= total) add up to ``total``: the
    largest takes the difference, one count at a time while it must give and stays above 1."""
    have = 0
    for s in range(nsym):
        have += freq[s]
    while have != total:
        big = 0
        for s in range(nsym):
            if freq[s] > freq[big]:
                big = s
        if have < total:
            freq[big] += total - have
            return
        step = min(have - total, freq[big] - 1)
        if step <= 0:  # cannot happen for nsym <= total; never loop on it
            return
        freq[big] -= step
        have -= step


@inline
def gap_model(theta: Any, freq: Any) -> Any:
    """The quotient model of ratio ``theta`` / TOTAL: q with probability (1 - t) t**q while
    that rounds to at least one count (at most GAP_SYMBOLS of them), then the escape with the
    rest of the mass; returns the symbol count (the escape is the last)."""
    w = np.int64(TOTAL - theta) << 20  # Q32
    rest = np.int64(1) << 32
    q = 0
    while q < GAP_SYMBOLS and (w >> 20) > 0:
        freq[q] = w >> 20
        rest -= w
        w = (w * theta) >> SCALE
        q += 1
    freq[q] = max(np.int64(1), rest >> 20)
    fix_sum(freq, q + 1, TOTAL)
    return q + 1


@inline
def starts_of(freq: Any, start: Any, nsym: Any) -> None:
    c = 0
    for s in range(nsym):
        start[s] = c
        c += freq[s]


@inline
def gap_shift(k: Any, total: Any) -> Any:
    """(remainder bits m, quotient ratio Q12) of a bucket whose ``k`` changes span ``total``
    of its elements (gaps plus changes): the rate p = k / total, m the smallest with
    (1 - p)**(2**m) <= THETA_MAX; integer arithmetic (Q30), so the choice is reproducible."""
    p = (np.int64(k) << 30) // total
    r = (np.int64(1) << 30) - p
    m = 0
    while r > THETA_MAX_Q30 and m < MAX_SHIFT:
        r = (r * r) >> 30
        m += 1
    return m, theta_q12(min(np.int64(255), (r + (1 << 21)) >> 22))


@inline
def theta_q12(byte: Any) -> Any:
    """The quotient ratio (Q12) a header byte stands for: the middle of its 1/256."""
    return (byte << 4) | 8


# --- rANS --------------------------------------------------------------------------------


@inline
def rans_put(x: Any, words: Any, w: Any, start: Any, freq: Any) -> Any:
    """Encode one symbol (``start``, ``freq``) into state ``x``; words go out in reverse.

    No branch (whether the state moves out 16 bits is close to a coin flip), so ``words``
    needs room for one word past the last one written; x < 2**32 after that, so a 32-bit
    division serves, several times cheaper than a 64-bit one. Same words as the branching
    form."""
    out = np.int64(x >= (freq << (32 - SCALE)))
    words[w] = x & 0xFFFF
    w += out
    x >>= out << 4
    q = np.int64(np.uint32(x) // np.uint32(freq))
    return (q << SCALE) + (x - q * freq) + start, w


@inline
def rans_get(x: Any, words: Any, w: Any, s: Any, start: Any, freq: Any) -> Any:
    """Advance state ``x`` past symbol ``s`` (its slot already read) and renormalise;
    reading past the words sets the position beyond them (checked at the end)."""
    x = freq[s] * (x >> SCALE) + (x & (TOTAL - 1)) - start[s]
    if x < RANS_L:
        if w < words.size:
            x = (x << 16) | np.int64(words[w])
        else:
            x <<= 16
        w += 1
    return x, w


@inline
def slot_table(freq: Any, nsym: Any, table: Any) -> None:
    """table[slot] = the symbol owning that slot (never written past its TOTAL slots)."""
    c = 0
    for s in range(nsym):
        for _ in range(freq[s]):
            if c >= table.size:
                return
            table[c] = s
            c += 1


@inline
def find_symbol(slot: Any, start: Any, nsym: Any) -> Any:
    """The symbol whose range holds ``slot`` (``start`` ascending), by bisection."""
    lo, hi = 0, nsym - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if start[mid] <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- encoder -----------------------------------------------------------------------------


@inline
def value_symbol(z: Any) -> Any:
    """(symbol, plain bits, their count) of a zigzag difference z >= 1 (uint64): z - 1 is
    twice the magnitude (|difference| - 1) plus the sign, the sign the first plain bit; a
    magnitude below VALUE_DIRECT is its own symbol, a larger one of bit length n is coded by
    n and the bit below its top one, its n - 2 lower bits plain; above VALUE_TOP_BITS bits the
    escape (count -1: the magnitude's excess over 2**TOP - 1 follows as a gamma number)."""
    v = z - u64(1)
    sign, mag = v & u64(1), v >> u64(1)
    if mag < u64(VALUE_DIRECT):
        return np.int64(mag), sign, 1
    n = 1
    while n < 64 and (mag >> u64(n)) != u64(0):
        n += 1
    if n > VALUE_TOP_BITS:
        return np.int64(VALUE_SYMBOLS), mag - u64((1 << VALUE_TOP_BITS) - 1), -1
    sym = VALUE_DIRECT + 2 * (n - 3) + np.int64((mag >> u64(n - 2)) & u64(1))
    return sym, sign | ((mag & u64((1 << (n - 2)) - 1)) << u64(1)), n - 1


@inline
def value_bits(k: Any) -> Any:
    """Precision of a value model of ``k`` changes: counts out of 2**bits, at least twice
    ``k`` and 64 (room for every seen symbol), at most 2**SCALE: a table of few changes is
    noisy anyway, and cheaper to send."""
    n = 0
    while (k >> n) > 0:
        n += 1
    return min(SCALE, max(6, n + 1))


@inline
def value_model(values: Any, a: Any, b: Any, freq: Any) -> Any:
    """Counts of the symbols (``value_symbol``) of ``values[a:b]`` normalised to
    2**value_bits (every seen symbol keeps at least one; all alike below VALUE_TABLE_MIN
    changes); returns the symbol count (the highest seen + 1)."""
    counts = np.zeros(VALUE_SYMBOLS + 1, np.int64)
    for i in range(a, b):
        counts[value_symbol(values[i])[0]] += 1
    total = np.int64(1) << value_bits(b - a)
    nsym = 0
    for s in range(VALUE_SYMBOLS + 1):
        freq[s] = 0
        if counts[s]:
            freq[s] = max(np.int64(1), (counts[s] * total) // (b - a))
            nsym = s + 1
    if b - a < VALUE_TABLE_MIN:
        uniform(freq, nsym, total)
    else:
        fix_sum_seen(freq, nsym, total)
    return nsym


@inline
def uniform(freq: Any, nsym: Any, total: Any) -> None:
    """The value model of a bucket of few changes: its ``nsym`` symbols alike."""
    for s in range(nsym):
        freq[s] = total // nsym
    fix_sum(freq, nsym, total)


@inline
def fix_sum_seen(freq: Any, nsym: Any, total: Any) -> None:
    """``fix_sum`` where unseen symbols (0) keep 0: the seen ones are moved to the front,
    fixed, and put back."""
    seen = np.zeros(VALUE_SYMBOLS + 1, np.int64)
    idx = np.zeros(VALUE_SYMBOLS + 1, np.int64)
    m = 0
    for s in range(nsym):
        if freq[s]:
            seen[m], idx[m] = freq[s], s
            m += 1
    fix_sum(seen, m, total)
    for i in range(m):
        freq[idx[i]] = seen[i]


@inline
def put_gap(raw: Any, at: Any, g: Any, m: Any, esc: Any) -> Any:
    """The plain bits of gap ``g`` (quotient symbol ``esc`` is the escape): the quotient's
    excess as a gamma number when it escapes, then the ``m`` remainder bits."""
    q = g >> m
    if q >= esc:
        at = put_gamma(raw, at, u64(q - esc + 1))
    return put_remainder(raw, at, g, m)


@inline
def put_value(raw: Any, at: Any, z: Any) -> Any:
    """The plain bits of zigzag difference ``z`` (``value_symbol``): the sign and low bits, or
    after the escape the sign and a gamma number."""
    _, extra, nbits = value_symbol(z)
    if nbits < 0:
        at = put_bits(raw, at, (z - u64(1)) & u64(1), 1)
        return put_gamma(raw, at, extra)
    return put_bits(raw, at, extra, nbits)


@jit
def encode(buckets: Any, gaps: Any, values: Any, starts: Any) -> Any:
    """``(header, words, raw, nraw)`` of the bucket table and the per-bucket gaps and zigzag
    differences (bucket j owns [starts[j], starts[j + 1]) of ``gaps`` and ``values``): the
    plain bits are the first ``nraw`` bytes of the 64-bit words ``raw`` written
    little-endian."""
    nb = starts.size - 1
    shifts = np.zeros(nb, np.int64)
    gfreq = np.zeros((nb, GAP_SYMBOLS + 1), np.int64)
    gsym = np.zeros(nb, np.int64)
    vfreq = np.zeros((nb, VALUE_SYMBOLS + 1), np.int64)
    vsym = np.zeros(nb, np.int64)
    header = np.zeros(16 + nb * (16 + 3 * (VALUE_SYMBOLS + 1)), np.uint8)
    h = put_varint(header, 0, nb)
    rawbits = 0
    for j in range(nb):
        a, b = starts[j], starts[j + 1]
        span = np.int64(0)
        for i in range(a, b):
            span += gaps[i] + 1
        m, theta = gap_shift(b - a, span)
        shifts[j] = m
        gsym[j] = gap_model(theta, gfreq[j])
        vsym[j] = value_model(values, a, b, vfreq[j])
        h = put_varint(header, h, buckets[j] - (buckets[j - 1] if j else -1))
        h = put_varint(header, h, b - a)
        h = put_varint(header, h, m)
        header[h] = theta >> 4
        h = put_varint(header, h + 1, vsym[j])
        for s in range(vsym[j] - 1 if b - a >= VALUE_TABLE_MIN else 0):
            h = put_varint(header, h, vfreq[j, s])
        for s in range(vsym[j]):
            vfreq[j, s] <<= SCALE - value_bits(b - a)
        esc = gsym[j] - 1
        for i in range(a, b):
            q = gaps[i] >> m
            rawbits += m + (2 * 64 if q >= esc else 0)
            rawbits += 1 + (2 * 64 if values[i] > u64(2 * VALUE_DIRECT) else 0)
    raw = np.zeros(rawbits // 64 + 3, np.uint64)
    at = 0
    for j in range(nb):
        m, esc = shifts[j], gsym[j] - 1
        for i in range(starts[j], starts[j + 1]):
            at = put_gap(raw, at, gaps[i], m, esc)
        for i in range(starts[j], starts[j + 1]):
            at = put_value(raw, at, values[i])
    words = np.zeros(2 * gaps.size + 2, np.uint16)
    x, w = np.int64(RANS_L), 0
    gstart, vstart = np.zeros(GAP_SYMBOLS + 1, np.int64), np.zeros(VALUE_SYMBOLS + 1, np.int64)
    for j in range(nb - 1, -1, -1):
        starts_of(gfreq[j], gstart, gsym[j])
        starts_of(vfreq[j], vstart, vsym[j])
        for i in range(starts[j + 1] - 1, starts[j] - 1, -1):
            s = value_symbol(values[i])[0]
            x, w = rans_put(x, words, w, vstart[s], vfreq[j, s])
        esc = gsym[j] - 1
        for i in range(starts[j + 1] - 1, starts[j] - 1, -1):
            s = min(gaps[i] >> shifts[j], esc)
            x, w = rans_put(x, words, w, gstart[s], gfreq[j, s])
    words[w] = x & 0xFFFF
    words[w + 1] = x >> 16
    return header[:h], words[: w + 2][::-1].copy(), raw, (at + 7) >> 3


# --- decoder -----------------------------------------------------------------------------


@inline
def read_value_law(buf: Any, pos: Any, end: Any, k: Any, nv: Any, freq: Any) -> Any:
    """A bucket's value law of ``nv`` symbols and ``k`` changes into ``freq`` (counts out of
    TOTAL): all alike below VALUE_TABLE_MIN changes, else its first ``nv - 1`` normalised
    counts read from ``buf[pos:end]`` (the last is the rest); returns the position after
    them, -1 when a count is out of range."""
    vbits = value_bits(k)
    if k < VALUE_TABLE_MIN:
        uniform(freq, nv, 1 << vbits)
    else:
        used = np.int64(0)
        for s in range(nv - 1):
            f, pos = get_varint(buf, pos, end)
            if f < 0 or f >= 1 << vbits:
                return np.int64(-1)
            freq[s] = f
            used += f
        if used >= 1 << vbits:
            return np.int64(-1)
        freq[nv - 1] = (1 << vbits) - used
    for s in range(nv):
        freq[s] <<= SCALE - vbits
    return pos


@inline
def read_table(buf: Any, pos: Any, end: Any, mask: Any, count: Any, cols: Any) -> Any:
    """The bucket table: per bucket (its step, changes, remainder bits, quotient ratio and
    value counts) in ``cols``; returns (buckets, position after it), -1 buckets when it is
    inconsistent: not ascending within ``mask``, changes not adding up to ``count``, a model
    out of range."""
    buckets, starts, shifts, thetas, vsym, vfreq = cols
    nb, pos = get_varint(buf, pos, end)
    if nb < 1 or nb > mask + 1 or nb > count:
        return -1, pos
    prev, total = np.int64(-1), np.int64(0)
    for j in range(nb):
        step, pos = get_varint(buf, pos, end)
        k, pos = get_varint(buf, pos, end)
        m, pos = get_varint(buf, pos, end)
        if pos >= end:
            return -1, pos
        theta = theta_q12(np.int64(buf[pos]))
        nv, pos = get_varint(buf, pos + 1, end)
        if step < 1 or k < 1 or total + k > count or not 0 <= m <= MAX_SHIFT:
            return -1, pos
        if not 1 <= nv <= VALUE_SYMBOLS + 1:
            return -1, pos
        prev += step
        if prev > mask:
            return -1, pos
        pos = read_value_law(buf, pos, end, k, nv, vfreq[j])
        if pos < 0:
            return -1, pos
        buckets[j], starts[j], shifts[j] = prev, total, m
        thetas[j], vsym[j] = theta, nv
        total += k
    starts[nb] = total
    return (nb if total == count else -1), pos


@inline
def next_symbol(x: Any, table: Any, start: Any, nsym: Any, search: Any) -> Any:
    slot = x & (TOTAL - 1)
    return find_symbol(slot, start, nsym) if search else np.int64(table[slot])


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
    """Inverse of ``encode`` (its three parts concatenated, the words' count between the
    header and the words) for ``gaps.size`` changes in a range of ``n`` elements: fills the
    table (``buckets``, ``starts``; room for ``mask + 1`` buckets) and the numbers; returns
    the bucket count, or -1 when the stream is inconsistent: a table out of range, a gap not
    below ``n``, a difference that does not fit ``width_bits``, words or bits left over or
    missing, or a final state other than the encoder's first."""
    count = gaps.size
    cap = min(mask + 1, count)
    shifts, thetas, vsym = np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64)
    vfreq = np.zeros((cap, VALUE_SYMBOLS + 1), np.int64)
    cols = (buckets, starts, shifts, thetas, vsym, vfreq)
    nb, pos = read_table(buf, 0, buf.size, mask, count, cols)
    nwords, pos = get_varint(buf, pos, buf.size)
    if nb < 0 or nwords < 2 or pos + 2 * nwords > buf.size:
        return -1
    words = np.empty(nwords, np.int64)
    for i in range(nwords):
        words[i] = np.int64(buf[pos + 2 * i]) | (np.int64(buf[pos + 2 * i + 1]) << 8)
    raw = buf[pos + 2 * nwords :]
    x, w = (words[0] << 16) | words[1], 2
    if x < RANS_L:
        return -1
    limit = u64(0xFFFF_FFFF_FFFF_FFFF)
    if width_bits < 64:
        limit = (u64(1) << u64(width_bits)) - u64(1)
    st = (u64(0), 0, 0, 0)
    freq, start = np.zeros(GAP_SYMBOLS + 1, np.int64), np.zeros(GAP_SYMBOLS + 1, np.int64)
    table = np.zeros(TOTAL, np.uint8)
    for j in range(nb):
        a, b, m = starts[j], starts[j + 1], shifts[j]
        search = b - a < SEARCH_BELOW
        nsym = gap_model(thetas[j], freq)
        starts_of(freq, start, nsym)
        if not search:
            slot_table(freq, nsym, table)
        esc = nsym - 1
        for i in range(a, b):
            s = next_symbol(x, table, start, nsym, search)
            x, w = rans_get(x, words, w, s, start, freq)
            q = s
            if s == esc:
                v, st = get_gamma(raw, st)
                if v == u64(0) or v > u64(n):
                    return -1
                q = esc + np.int64(v) - 1
            if q > (n >> m):
                return -1
            r, st = get_remainder(raw, st, m)
            g = (q << m) | r
            if g >= n:
                return -1
            gaps[i] = g
        nsym = vsym[j]
        for s in range(nsym):
            freq[s] = vfreq[j, s]
        starts_of(freq, start, nsym)
        if not search:
            slot_table(freq, nsym, table)
        for i in range(a, b):
            s = next_symbol(x, table, start, nsym, search)
            x, w = rans_get(x, words, w, s, start, freq)
            if s < VALUE_DIRECT:
                sign, st = get_bits(raw, st, 1)
                mag = u64(s)
            elif s < VALUE_SYMBOLS:
                nb2 = (s - VALUE_DIRECT) // 2 + 1
                extra, st = get_bits(raw, st, nb2 + 1)  # the sign, then the low bits
                sign = extra & u64(1)
                mag = (u64(2 | ((s - VALUE_DIRECT) & 1)) << u64(nb2)) | (extra >> u64(1))
            else:
                sign, st = get_bits(raw, st, 1)
                e, st = get_gamma(raw, st)
                top = u64((1 << VALUE_TOP_BITS) - 1)
                if e == u64(0) or (limit >> u64(1)) < top or e > (limit >> u64(1)) - top:
                    return -1
                mag = e + top
            if mag > (limit - u64(1) - sign) >> u64(1):
                return -1
            v = (mag << u64(1)) | sign
            values[i] = v + u64(1)
        if w > nwords or st[3] > 0:
            return -1
    if x != RANS_L or w != nwords or st[3] > 0 or st[2] != raw.size or st[0] != u64(0):
        return -1
    return nb

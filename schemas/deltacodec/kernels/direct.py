"""The numba kernels of ``direct`` pieces (rules in ``deltacodec.direct``): the encoder, and the
decoder that applies each change as it decodes it, reading only the changed elements.

The model helpers (gap and value laws, rANS steps) are the static rANS coder's
(``kernels.rans``), the plain-bit and varint writers ``kernels.bits``'s; what is new is the
order (changes in element order, two rANS states) and the decoder's packed tables. Every read
of the coded stream is bounds-checked: a kernel fed damaged bytes refuses it, and it never
writes outside the arrays it is given."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .bits import get_varint, put_varint
from .rans import (
    GAP_SYMBOLS,
    MAX_SHIFT,
    RANS_L,
    SCALE,
    TOTAL,
    VALUE_DIRECT,
    VALUE_SYMBOLS,
    VALUE_TABLE_MIN,
    VALUE_TOP_BITS,
    gap_model,
    gap_shift,
    put_gap,
    put_value,
    rans_put,
    read_value_law,
    starts_of,
    theta_q12,
    value_bits,
    value_model,
    value_symbol,
)

jit = numba.njit(cache=True, nogil=True, boundscheck=False)
inline = numba.njit(inline="always", boundscheck=False)
u64 = np.uint64

#: What the decoder returns in ``state[1]``: applied, a damaged stream, changes whose
#: checksum differs (the base's changed elements are not the encoder's).
OK, DAMAGED, MISMATCH = 0, 1, 2
#: A packed decode-table entry: symbol << 25 | frequency << 12 | slot - symbol start.
_FREQ_SHIFT, _SYM_SHIFT = 12, 25
AHEAD = 32


@intrinsic
def prefetch_for_write(typingctx: Any, array: Any, index: Any) -> Any:
    """Ask the memory system for the cache line of ``array[index]`` (to be written soon)
    without waiting for it: LLVM's prefetch hint, which numba does not expose. A plain
    early read would hold up the loop until the line arrives."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        kind = signature.args[0]
        view = context.make_array(kind)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, kind, view, [args[1]], wraparound=False)
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0i8")
        # write, keep in every cache level, data (not instructions)
        builder.call(
            fn, [builder.bitcast(ptr, byte_ptr), *(ir.Constant(i32, v) for v in (1, 3, 1))]
        )
        return context.get_dummy_value()

    return types.void(array, index), codegen


# --- the changes' checksum ---------------------------------------------------------------


@inline
def fmix(h: Any) -> Any:
    """MurmurHash3's 64-bit finaliser: every input bit moves every output bit."""
    h ^= h >> u64(33)
    h *= u64(0xFF51AFD7ED558CCD)
    h ^= h >> u64(33)
    h *= u64(0xC4CEB93FE53B1A85)
    h ^= h >> u64(33)
    return h


@inline
def change_sum(pos: Any, old: Any, new: Any) -> Any:
    """One change's term of the checksum: position, base bits and new bits bound together;
    the checksum is the wrapping sum of the terms, so no change waits on the previous one."""
    h = (u64(pos) * u64(0x9E3779B97F4A7C15)) ^ (u64(old) * u64(0xD6E8FEB86659FD93))
    return fmix(h ^ (u64(new) * u64(0xA0761D6478BD642F)))


@jit
def checksum(old: Any, pos: Any, new: Any) -> Any:
    """The checksum of the changes at ``pos`` (base bits ``old[pos]``, new bits ``new``)."""
    s = u64(0)
    for j in range(pos.size):
        s += change_sum(pos[j], old[pos[j]], new[j])
    return s


# --- encoder -----------------------------------------------------------------------------


@jit
def encode(
    gaps: Any,
    rows: Any,
    values: Any,
    buckets: Any,
    starts: Any,
    sorted_values: Any,
    check: Any,
) -> Any:
    """``(header, gap words of the even and odd changes, gap plain bits, their count, value
    words of the even and odd changes, value plain bits, their count)`` of the changes in
    element order: ``gaps`` (elements skipped before each), ``rows`` (each change's index
    into the present ``buckets``), ``values`` (zigzag differences); ``sorted_values`` are the
    same grouped by bucket (bucket j owns [starts[j], starts[j + 1])), to measure each
    bucket's value law. ``check`` is the changes' checksum."""
    k, nb = gaps.size, buckets.size
    span = np.int64(0)
    for i in range(k):
        span += gaps[i] + 1
    m, theta = gap_shift(k, span)
    gfreq = np.zeros(GAP_SYMBOLS + 1, np.int64)
    gsym = gap_model(theta, gfreq)
    vfreq = np.zeros((nb, VALUE_SYMBOLS + 1), np.int64)
    vsym = np.zeros(nb, np.int64)
    header = np.zeros(32 + nb * (16 + 3 * (VALUE_SYMBOLS + 1)), np.uint8)
    h = put_varint(header, 0, m)
    header[h] = theta >> 4
    h = put_varint(header, h + 1, nb)
    for j in range(nb):
        a, b = starts[j], starts[j + 1]
        vsym[j] = value_model(sorted_values, a, b, vfreq[j])
        h = put_varint(header, h, buckets[j] - (buckets[j - 1] if j else -1))
        h = put_varint(header, h, b - a)
        h = put_varint(header, h, vsym[j])
        for s in range(vsym[j] - 1 if b - a >= VALUE_TABLE_MIN else 0):
            h = put_varint(header, h, vfreq[j, s])
        for s in range(vsym[j]):
            vfreq[j, s] <<= SCALE - value_bits(b - a)
    for i in range(8):
        header[h + i] = (check >> u64(8 * i)) & u64(0xFF)
    h += 8
    esc = gsym - 1
    gbits, vbits = 0, 0
    for i in range(k):
        gbits += m + (2 * 64 if (gaps[i] >> m) >= esc else 0)
        vbits += VALUE_TOP_BITS + (2 * 64 if values[i] > u64(2 * VALUE_DIRECT) else 0)
    raw_g = np.zeros(gbits // 64 + 3, np.uint64)
    raw_v = np.zeros(vbits // 64 + 3, np.uint64)
    at_g, at_v = 0, 0
    for i in range(k):
        at_g = put_gap(raw_g, at_g, gaps[i], m, esc)
        at_v = put_value(raw_v, at_v, values[i])
    gstart = np.zeros(GAP_SYMBOLS + 1, np.int64)
    starts_of(gfreq, gstart, gsym)
    vstart = np.zeros((nb, VALUE_SYMBOLS + 1), np.int64)
    for j in range(nb):
        starts_of(vfreq[j], vstart[j], vsym[j])
    g_at, g_freq = np.empty(k, np.int64), np.empty(k, np.int64)
    v_at, v_freq = np.empty(k, np.int64), np.empty(k, np.int64)
    for i in range(k):
        s = min(gaps[i] >> m, esc)
        g_at[i], g_freq[i] = gstart[s], gfreq[s]
        s = value_symbol(values[i])[0]
        v_at[i], v_freq[i] = vstart[rows[i], s], vfreq[rows[i], s]
    g0, g1 = lane(g_at, g_freq, 0), lane(g_at, g_freq, 1)
    v0, v1 = lane(v_at, v_freq, 0), lane(v_at, v_freq, 1)
    return header[:h], g0, g1, raw_g, at_g, v0, v1, raw_v, at_v


@jit
def lane(at: Any, freq: Any, parity: Any) -> Any:
    """The rANS words of the symbols (``at``, ``freq``) of one lane (the changes of that
    parity), in the decoder's order."""
    words = np.zeros(at.size // 2 + 3, np.uint16)
    x, w = np.int64(RANS_L), 0
    last = at.size - 1
    if (last & 1) != parity:
        last -= 1
    for i in range(last, -1, -2):
        x, w = rans_put(x, words, w, at[i], freq[i])
    words[w], words[w + 1] = x & 0xFFFF, x >> 16
    return words[: w + 2][::-1].copy()


# --- decoder -----------------------------------------------------------------------------


@inline
def pack_table(freq: Any, nsym: Any, table: Any) -> None:
    """The packed decode table of a law (``freq[:nsym]`` adding up to TOTAL)."""
    c = 0
    for s in range(nsym):
        f = freq[s]
        for i in range(f):
            if c + i >= TOTAL:
                return
            table[c + i] = np.uint32((s << _SYM_SHIFT) | (f << _FREQ_SHIFT) | i)
        c += f


@inline
def rans_step(x: Any, e: Any, words: Any, w: Any) -> Any:
    """Advance state ``x`` past the symbol of packed entry ``e`` and renormalise, without a
    branch (whether it renormalises is close to a coin flip); reading past the words moves
    ``w`` beyond them (checked at the end)."""
    x = np.int64((e >> _FREQ_SHIFT) & 0x1FFF) * (x >> SCALE) + np.int64(e & 0xFFF)
    need = np.int64(x < RANS_L)
    x = (x << (need << 4)) | (np.int64(words[min(w, words.size - 1)]) * need)
    return x, w + need


@jit
def read_header(buf: Any, mask: Any, count: Any, rowof: Any, tables: Any, gtable: Any) -> Any:
    """Parse the header into the gap law's table (``gtable``), each present bucket's row of
    value tables and ``rowof`` (bucket -> row, -1 when absent); returns (m, header end,
    checksum) or m = -1 when it is inconsistent."""
    bad = (np.int64(-1), np.int64(0), u64(0))
    end = buf.size
    m, pos = get_varint(buf, 0, end)
    if not 0 <= m <= MAX_SHIFT or pos >= end:
        return bad
    gfreq = np.zeros(GAP_SYMBOLS + 1, np.int64)
    gsym = gap_model(theta_q12(np.int64(buf[pos])), gfreq)
    pack_table(gfreq, gsym, gtable)
    nb, pos = get_varint(buf, pos + 1, end)
    if nb < 1 or nb > mask + 1 or nb > count or nb > tables.shape[0]:
        return bad
    freq = np.zeros(VALUE_SYMBOLS + 1, np.int64)
    prev, total = np.int64(-1), np.int64(0)
    for j in range(nb):
        step, pos = get_varint(buf, pos, end)
        k, pos = get_varint(buf, pos, end)
        nv, pos = get_varint(buf, pos, end)
        if step < 1 or k < 1 or total + k > count or not 1 <= nv <= VALUE_SYMBOLS + 1:
            return bad
        prev += step
        if prev > mask:
            return bad
        pos = read_value_law(buf, pos, end, k, nv, freq)
        if pos < 0:
            return bad
        pack_table(freq, nv, tables[j])
        rowof[prev] = j
        total += k
    if total != count or pos + 8 > end:
        return bad
    check = u64(0)
    for i in range(8):
        check |= u64(buf[pos + i]) << u64(8 * i)
    return m, np.int64(pos + 8), check


@inline
def peek(raw: Any, at: Any) -> Any:
    """The 64 plain bits from bit ``at`` on (``raw``: 64-bit words with a zero word after the
    last; past them, the last words again: a reader checks its final position)."""
    w = min(at >> 6, raw.size - 2)
    off = u64(at & 63)
    return (raw[w] >> off) | ((raw[w + 1] << u64(1)) << (u64(63) - off))


@inline
def low(v: Any, nbits: Any) -> Any:
    """The ``nbits`` (below 64) low bits of ``v``."""
    return v & ((u64(1) << u64(nbits)) - u64(1))


@inline
def take_gamma(raw: Any, at: Any) -> Any:
    """The Elias-gamma number at bit ``at`` (as ``put_gamma`` writes it: the length's zeros,
    a one, then the low bits in chunks of at most 32 from the top) and the bit after it; 0
    when its length runs past 64 bits (damaged)."""
    n = 1
    while (peek(raw, at) & u64(1)) == u64(0):
        at += 1
        n += 1
        if n > 64:
            return u64(0), at
    at += 1
    v, rest = u64(1), n - 1
    while rest > 0:
        b = min(32, rest)
        rest -= b
        v = (v << u64(b)) | low(peek(raw, at), b)
        at += b
    return v, at


@jit
def positions(
    m: Any, gtable: Any, words0: Any, words1: Any, raw: Any, nbits: Any, n: Any, done: Any
) -> Any:
    """Decode the changes' positions (``done.size`` of them, ascending, below ``n``) into
    ``done``; False when the stream is inconsistent: a position out of range, words or plain
    bits missing or left over, a final rANS state other than the encoder's first. The even
    and odd changes' symbols are two rANS lanes, two chains of table reads side by side."""
    esc = np.int64(gtable[TOTAL - 1] >> _SYM_SHIFT)
    x0, w0 = (np.int64(words0[0]) << 16) | np.int64(words0[1]), 2
    x1, w1 = (np.int64(words1[0]) << 16) | np.int64(words1[1]), 2
    if x0 < RANS_L or x1 < RANS_L:
        return False
    at, p = np.int64(0), np.int64(-1)
    for j in range(done.size):
        if j & 1:
            e = gtable[x1 & (TOTAL - 1)]
            x1, w1 = rans_step(x1, e, words1, w1)
        else:
            e = gtable[x0 & (TOTAL - 1)]
            x0, w0 = rans_step(x0, e, words0, w0)
        q = np.int64(e >> _SYM_SHIFT)
        if q == esc:
            v, at = take_gamma(raw, at)
            if v == u64(0) or v > u64(n):
                return False
            q = esc + np.int64(v) - 1
        if q > (n >> m):
            return False
        p += ((q << m) | np.int64(low(peek(raw, at), m))) + 1
        at += m
        if p >= n:
            return False
        done[j] = p
    ends = w0 == words0.size and w1 == words1.size and x0 == RANS_L and x1 == RANS_L
    return ends and at == nbits


@jit
def apply(
    done: Any,
    rowof: Any,
    tables: Any,
    words0: Any,
    words1: Any,
    raw: Any,
    nbits: Any,
    check: Any,
    shift: Any,
    mask: Any,
    width_bits: Any,
    out: Any,
    old: Any,
    state: Any,
) -> None:
    """Decode the differences of the changes at ``done`` (``positions``) and apply each as
    it comes: out[p] += its difference (wrapping), its old bits into ``old``; ``state[0]``
    counts the changes written. A change is written only after its whole code was read and
    checked, so a damaged stream stops before that write with ``state[1]`` = DAMAGED; at
    the end, every word and plain bit must have been used and both rANS states be the
    encoder's first (else DAMAGED), and the changes' checksum match (else MISMATCH)."""
    k = done.size
    limit = u64(0xFFFF_FFFF_FFFF_FFFF)
    if width_bits < 64:
        limit = (u64(1) << u64(width_bits)) - u64(1)
    # per value symbol below the escape: its magnitude's top bits and its low bits' count
    top, extra = np.zeros(VALUE_SYMBOLS, np.uint64), np.zeros(VALUE_SYMBOLS, np.int64)
    for s in range(VALUE_SYMBOLS):
        if s < VALUE_DIRECT:
            top[s] = s
        else:
            extra[s] = (s - VALUE_DIRECT) // 2 + 1
            top[s] = u64(2 | ((s - VALUE_DIRECT) & 1)) << u64(extra[s])
    x0, w0 = (np.int64(words0[0]) << 16) | np.int64(words0[1]), 2
    x1, w1 = (np.int64(words1[0]) << 16) | np.int64(words1[1]), 2
    if x0 < RANS_L or x1 < RANS_L:
        state[1] = DAMAGED
        return
    at, total = np.int64(0), u64(0)
    new = np.empty_like(old)
    for j in range(k):
        # (an intrinsic: mypy takes numba's typing context for an argument)
        prefetch_for_write(out, done[min(j + AHEAD, k - 1)])  # type: ignore[call-arg]
        p = done[j]
        y = out[p]
        row = rowof[(np.int64(y) >> shift) & mask]
        if row < 0:
            state[0], state[1] = j, DAMAGED
            return
        if j & 1:
            e = tables[row, x1 & (TOTAL - 1)]
            x1, w1 = rans_step(x1, e, words1, w1)
        else:
            e = tables[row, x0 & (TOTAL - 1)]
            x0, w0 = rans_step(x0, e, words0, w0)
        s = np.int64(e >> _SYM_SHIFT)
        bits = peek(raw, at)
        sign = bits & u64(1)
        if s < VALUE_SYMBOLS:
            mag = top[s] | low(bits >> u64(1), extra[s])
            at += 1 + extra[s]
        else:
            ev, at = take_gamma(raw, at + 1)
            cap = u64((1 << VALUE_TOP_BITS) - 1)
            if ev == u64(0) or (limit >> u64(1)) < cap or ev > (limit >> u64(1)) - cap:
                state[0], state[1] = j, DAMAGED
                return
            mag = ev + cap
        if mag > (limit - u64(1) - sign) >> u64(1):
            state[0], state[1] = j, DAMAGED
            return
        z = ((mag << u64(1)) | sign) + u64(1)  # the zigzag difference, unzigzagged:
        out[p] = y + ((z >> u64(1)) ^ (u64(0) - (z & u64(1))))  # wraps to the element width
        old[j], new[j] = y, out[p]
    state[0] = k
    for j in range(k):  # apart: a loop over contiguous arrays the compiler vectorises
        total += change_sum(done[j], old[j], new[j])
    ends = w0 == words0.size and w1 == words1.size and x0 == RANS_L and x1 == RANS_L
    if not ends or at != nbits:
        state[1] = DAMAGED
    elif total != check:
        state[1] = MISMATCH

"""The exponent pieces' numba kernels (``deltacodec.exponent``): bucket ranks when encoding,
bucket countdowns when applying."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from . import FAR

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


@jit
def apply(
    base: Any,
    out: Any,
    lo: int,
    hi: int,
    shift: int,
    mask: int,
    rem: Any,
    ptr: Any,
    end: Any,
    gaps: Any,
    deltas: Any,
    done: Any,
    old: Any,
    state: Any,
) -> None:
    """For i in [lo, hi), with b the bucket of base[i]: element i changed where b's
    countdown ``rem`` reaches 0; it gets out[i] = base[i] + the next difference of b,
    and b's next gap is loaded. ``out`` may be ``base`` (in place) and is written at
    changes only. Positions written and their base bits go to ``done`` and ``old``;
    ``state[0]`` counts them. Nothing is written that the plan does not hold: a change
    beyond its bucket's differences, or beyond ``done``, stops the kernel before its write
    with ``state[1]`` set (``ExponentPlan.finish`` refuses the piece)."""
    if state[1]:
        return  # refused in an earlier block: nothing more is written
    n = state[0]
    for i in range(lo, hi):
        x = base[i]
        b = (np.int64(x) >> shift) & mask
        r = rem[b]
        if r == 0:
            p = ptr[b]
            if p >= end[b] or n >= done.size:
                state[0], state[1] = n, 1
                return
            out[i] = x + deltas[p]
            done[n] = i
            old[n] = x
            n += 1
            p += 1
            ptr[b] = p
            rem[b] = gaps[p] if p < end[b] else FAR
        else:
            rem[b] = r - 1
    state[0] = n

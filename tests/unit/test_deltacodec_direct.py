"""Fast applies: ``direct`` pieces (``encode_delta(fast_apply=True)``) and
``apply_in_place(check="changes")``, which verifies them without hashing the tensors.

Properties asserted: a fast-apply delta of every float dtype applies in place and decodes bit
for bit, under either check; a base that differs from the encoder's where the delta writes is
refused by the changes' checksum (``BaseMismatch``) and put back bit for bit; a base that
differs where the delta does not write passes a "changes" check (the stated blind spot) and
is refused by the next "full" check before anything is written; tensors with other pieces are
still hashed under "changes", and only they come back with a known hash; every truncation
and many bit flips of a ``direct`` stream are refused or decode exactly, never written
outside the range (the crafted-chunk suite covers whole chunks).
"""

from __future__ import annotations

import numpy as np
import pytest

from rlstream.schemas import deltacodec as dc
from rlstream.schemas.deltacodec import TensorBits
from rlstream.schemas.deltacodec.direct import apply_direct, encode_direct
from rlstream.schemas.deltacodec.exponent import EXPONENT_FIELDS
from rlstream.schemas.deltacodec.pieces import DIRECT, Piece, find_changes

ALGORITHM = dc.DEFAULT_HASH


def _step(rng: np.random.Generator, n: int, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns of N(0, 0.02^2) weights before and after a small random step."""
    w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    moved = w + np.float32(lr) * rng.standard_normal(n, dtype=np.float32)
    before, after = ((x.view(np.uint32) >> 16).astype(np.uint16) for x in (w, moved))
    return before, after


def _states(
    arrays: dict[str, tuple[np.ndarray, np.ndarray]], tags: dict[str, str]
) -> tuple[dict[str, TensorBits], dict[str, TensorBits]]:
    old = {
        k: TensorBits.from_numpy(a.copy(), tags.get(k, "bfloat16")) for k, (a, _) in arrays.items()
    }
    new = {
        k: TensorBits.from_numpy(b.copy(), tags.get(k, "bfloat16")) for k, (_, b) in arrays.items()
    }
    return old, new


def _held(state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    return {k: TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in state.items()}


def _flip(t: TensorBits, i: int) -> None:
    """Flip the low bit of element ``i`` in the memory under ``t`` (its view is read-only)."""
    memory = t.bits.view()
    memory.flags.writeable = True
    memory[i] ^= 1


def _bits(state: dict[str, TensorBits]) -> dict[str, np.ndarray]:
    return {k: t.bits.copy() for k, t in state.items()}


def _equal(a: dict[str, np.ndarray], b: dict[str, TensorBits]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k].bits) for k in a)


@pytest.mark.parametrize("dtype", sorted(EXPONENT_FIELDS))
@pytest.mark.parametrize("check", ["changes", "full"])
def test_a_fast_apply_delta_applies_and_decodes_bit_for_bit(dtype: str, check: str) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal(30_000) * 0.02
    moved = w + np.where(rng.random(w.size) < 0.03, 1e-4, 0.0) * rng.standard_normal(w.size)
    if dtype == "bfloat16":
        pair = tuple(
            (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for x in (w, moved)
        )
    else:
        pair = tuple(
            x.astype(np.dtype(dtype)).view(f"u{np.dtype(dtype).itemsize}") for x in (w, moved)
        )
    old, new = _states({"w": pair}, {"w": dtype})  # type: ignore[dict-item]
    enc = dc.encode_delta(old, new, version=2, base_version=1, fast_apply=True)
    assert enc.manifest["tensors"][0]["encoding"].split("+") == ["direct"]
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)
    held = _held(old)
    out = dc.apply_in_place(enc.manifest, enc.chunks, held, check=check)
    assert dc.same_state(out, new)
    assert out["w"].knows(ALGORITHM) == (check == "full")


def _fast_delta() -> tuple[dict[str, TensorBits], dict[str, TensorBits], dc.Encoded]:
    rng = np.random.default_rng(5)
    old, new = _states({"a": _step(rng, 50_000, 1e-4), "b": _step(rng, 20_000, 1e-4)}, {})
    return old, new, dc.encode_delta(old, new, version=2, base_version=1, fast_apply=True)


def test_a_base_that_differs_where_the_delta_writes_is_refused_and_put_back() -> None:
    old, _, enc = _fast_delta()
    held = _held(old)
    changed = np.flatnonzero(old["a"].bits != dc.decode(enc.manifest, enc.chunks, old)["a"].bits)
    _flip(held["a"], int(changed[len(changed) // 2]))  # where the delta writes
    before = _bits(held)
    with pytest.raises(dc.BaseMismatch, match="checksum"):
        dc.apply_in_place(enc.manifest, enc.chunks, held, check="changes")
    assert _equal(before, held)  # every written element put back


def test_a_base_that_differs_elsewhere_is_caught_by_the_next_full_check() -> None:
    """The "changes" check's stated blind spot, and what closes it."""
    rng = np.random.default_rng(9)
    old, mid = _states({"a": _step(rng, 50_000, 1e-4)}, {})
    bits = mid["a"].bits.copy()
    bits[rng.random(bits.size) < 0.02] += np.uint16(1)
    later = {"a": TensorBits("bfloat16", (bits.size,), bits)}
    first = dc.encode_delta(old, mid, version=2, base_version=1, fast_apply=True)
    second = dc.encode_delta(mid, later, version=3, base_version=2, fast_apply=True)
    held = _held(old)
    untouched = int(
        np.flatnonzero((old["a"].bits == mid["a"].bits) & (mid["a"].bits == later["a"].bits))[0]
    )
    _flip(held["a"], untouched)  # memory that differs from the encoder's, where no delta writes
    applied = dc.apply_in_place(first.manifest, first.chunks, held, check="changes")
    assert np.count_nonzero(applied["a"].bits != mid["a"].bits) == 1  # passed: not seen
    before = _bits(applied)
    with pytest.raises(dc.BaseMismatch, match="differs from the delta's base"):
        dc.apply_in_place(second.manifest, second.chunks, applied, check="full")
    assert _equal(before, applied)  # refused before any write


def test_the_changes_check_still_hashes_tensors_without_self_checked_pieces() -> None:
    rng = np.random.default_rng(13)
    ints = rng.integers(0, 1000, 20_000, dtype=np.int32).view(np.uint32)
    bumped = ints.copy()
    bumped[::50] += np.uint32(1)
    old, new = _states({"f": _step(rng, 20_000, 1e-4), "i": (ints, bumped)}, {"i": "int32"})
    enc = dc.encode_delta(old, new, version=2, base_version=1, fast_apply=True)
    kinds = {t["name"]: t["encoding"] for t in enc.manifest["tensors"]}
    assert kinds["f"] == "direct" and "direct" not in kinds["i"]
    held = _held(old)
    _flip(held["i"], 1)  # an unchanged element of the hashed tensor
    with pytest.raises(dc.BaseMismatch):
        dc.apply_in_place(enc.manifest, enc.chunks, held, check="changes")
    out = dc.apply_in_place(enc.manifest, enc.chunks, _held(old), check="changes")
    assert dc.same_state(out, new)
    assert out["i"].knows(ALGORITHM) and not out["f"].knows(ALGORITHM)
    with pytest.raises(ValueError, match="check"):
        dc.apply_in_place(enc.manifest, enc.chunks, _held(old), check="quick")


def test_damaged_direct_streams_are_refused_or_exact_and_stay_in_range() -> None:
    rng = np.random.default_rng(17)
    old, new = _step(rng, 20_000, 3e-4)
    ch = find_changes(old, new, None, None)
    aux, streams = encode_direct(old, ch.pos, ch.diff, EXPONENT_FIELDS["bfloat16"])
    stream = bytes(streams[0][1])
    guard = 64
    damaged = [stream[:cut] for cut in range(0, len(stream), max(1, len(stream) // 300))]
    for _ in range(300):
        flipped = bytearray(stream)
        for _ in range(int(rng.integers(1, 4))):
            flipped[int(rng.integers(0, len(flipped)))] ^= int(rng.integers(1, 256))
        damaged.append(bytes(flipped))
    outcomes = {"refused": 0, "exact": 0}
    for data in damaged:
        block = np.full(old.size + 2 * guard, 0xA5A5, np.uint16)
        out = block[guard:-guard]
        out[:] = old
        piece = Piece(0, 0, old.size, DIRECT, aux, int(ch.pos.size), ((0, data),))
        try:
            _, _, error = apply_direct(piece, out)
        except ValueError:
            error = ValueError("refused before writing")
            assert np.array_equal(out, old)
        if error is None:
            assert np.array_equal(out, new)
            outcomes["exact"] += 1
        else:
            outcomes["refused"] += 1
        assert np.all(block[:guard] == 0xA5A5) and np.all(block[-guard:] == 0xA5A5)
    assert outcomes["refused"] >= len(damaged) - 5

"""The base-conditioned delta encodings (``exponent3``, ``exponent2`` and ``direct`` pieces, and the
``exponent`` pieces of the first encoder, no longer written), in-place apply, and the bounds.

Properties asserted: pieces of both encodings written now round-trip bit for bit (decoded into
new memory and applied in place) for every float dtype on random and adversarial changes (all
changed, none, one, NaN/inf bit patterns, subnormals, -0.0, tiny and odd-sized tensors, buckets
from sparse to all changed, differences of every bit length); a damaged exponent piece raises
``ChunkCorrupt`` and an in-place apply that fails after its first write leaves the base bit for
bit; every truncation and many bit flips of an ``exponent3`` stream are refused or decode
exactly, never crash; versions written by earlier encoders (golden bytes) still decode; the
same input gives the same bytes; both bounds follow their definitions on a toy input worked by
hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from rlstream.schemas import deltacodec as dc
from rlstream.schemas.deltacodec import TensorBits
from rlstream.schemas.deltacodec import file as dfile
from rlstream.schemas.deltacodec.bits import UINT_BY_WIDTH
from rlstream.schemas.deltacodec.direct import encode_direct
from rlstream.schemas.deltacodec.encodings import decode_piece
from rlstream.schemas.deltacodec.exponent import (
    EXPONENT_FIELDS,
    FIELD_IDS,
    encode_exponent2,
    encode_exponent3,
)
from rlstream.schemas.deltacodec.pieces import (
    DIRECT,
    EXPONENT2,
    EXPONENT3,
    Piece,
    find_changes,
    undo_all,
)
from rlstream.schemas.deltacodec.wire import parse_chunk

DATA = Path(__file__).parent / "data" / "deltacodec"
FLOATS = sorted(EXPONENT_FIELDS)
SPECIAL = {
    2: [0x7E01, 0x7F81, 0xFFC3, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7C01, 0xFE00, 0x0000],
    4: [0x7FC0_0001, 0x7F80_0001, 0xFFC0_1234, 0x8000_0000, 0x7F80_0000, 0xFF80_0000, 0x1],
    8: [0x7FF8_0000_0000_0001, 0xFFF0_0000_0000_0001, 0x8000_0000_0000_0000, 0x1],
}


def _weights(rng: np.random.Generator, dtype: str, n: int, kind: str) -> np.ndarray:
    """Bit patterns of ``n`` weights: Gaussian-like floats, pure noise, or specials only."""
    width = dc.DTYPE_WIDTHS[dtype]
    uint = UINT_BY_WIDTH[width]
    if kind == "noise":
        return rng.integers(0, 256, n * width, dtype=np.uint8).view(uint)
    if kind == "special":
        return rng.choice(np.array(SPECIAL[width], dtype=uint), n)
    w = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)  # many exponents
    if dtype == "bfloat16":
        return (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return w.astype(np.dtype(dtype)).view(uint)


def _changed(rng: np.random.Generator, old: np.ndarray, pattern: str) -> np.ndarray:
    new = old.copy()
    n = old.size
    if not n or pattern == "none":
        return new
    p = {"all": 1.0, "sparse": 0.02, "mid": 0.5, "dense": 0.9, "one": 0.0}[pattern]
    mask = rng.random(n) < p
    if pattern == "one":
        mask[rng.integers(0, n)] = True
    # small steps mostly (what an optimizer does), sometimes far, sometimes a special value
    step = rng.choice(np.array([1, 1, 1, 2, 3, 40, 1 << 12], dtype=np.uint64), n)
    step = step.astype(old.dtype)
    new[mask] = old[mask] + np.where(rng.random(n) < 0.5, step, -step)[mask]
    if rng.random() < 0.5:
        at = np.flatnonzero(mask)[:4]
        new[at] = rng.choice(np.array(SPECIAL[old.itemsize], dtype=old.dtype), at.size)
    new[mask & (new == old)] += old.dtype.type(1)  # every flagged element really changes
    return new


def _round_trip_piece(dtype: str, old: np.ndarray, new: np.ndarray) -> None:
    """Encode the change as one piece of each base-conditioned encoding written now
    (``exponent2``, ``exponent3``, ``direct``); decode each into new memory and in place, and
    undo."""
    dctx = zstandard.ZstdDecompressor()
    ch = find_changes(old, new, None, None)
    if not ch.pos.size:
        return
    k, field = int(ch.pos.size), EXPONENT_FIELDS[dtype]
    aux2, streams2 = encode_exponent2(old, ch.pos, ch.diff, field)
    aux3, streams3 = encode_exponent3(old, ch.pos, ch.diff, field)
    aux9, streams9 = encode_direct(old, ch.pos, ch.diff, field)
    assert FIELD_IDS[aux2] == FIELD_IDS[aux3] == FIELD_IDS[aux9] == (field, old.itemsize)
    for piece in (
        Piece(0, 0, old.size, EXPONENT2, aux2, k, tuple(streams2)),
        Piece(0, 0, old.size, EXPONENT3, aux3, k, tuple(streams3)),
        Piece(0, 0, old.size, DIRECT, aux9, k, tuple(streams9)),
    ):
        piece = parse_chunk(b"RLDK\x01\x00\x00\x00\x01\x00\x00\x00" + piece.to_bytes())[0]
        out = np.empty_like(old)
        decode_piece(piece, old, out, dctx)
        assert np.array_equal(out, new)
        held = old.copy()
        undo: list[Any] = []
        decode_piece(piece, held, held, dctx, undo=undo)
        assert np.array_equal(held, new)
        undo_all(undo)
        assert np.array_equal(held, old)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(FLOATS),
    st.integers(1, 5000),
    st.sampled_from(["gauss", "noise", "special"]),
    st.sampled_from(["all", "sparse", "mid", "dense", "one", "none"]),
    st.integers(0, 2**32 - 1),
)
def test_exponent_piece_round_trips(dtype: str, n: int, kind: str, pattern: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    old = _weights(rng, dtype, n, kind)
    _round_trip_piece(dtype, old, _changed(rng, old, pattern))


@pytest.mark.parametrize("dtype", FLOATS)
def test_sparse_to_dense_buckets_and_subnormals(dtype: str) -> None:
    """Buckets changed at ~1%, ~50% and ~99%, subnormals (exponent field 0), NaN and inf
    (field all ones) in one tensor."""
    rng = np.random.default_rng(5)
    uint = UINT_BY_WIDTH[dc.DTYPE_WIDTHS[dtype]]
    shift, mask = EXPONENT_FIELDS[dtype]
    mant = rng.integers(1, 1 << min(shift, 20), 30_000).astype(uint)
    exps = rng.choice(np.array([0, 1, 2, mask], dtype=uint), 30_000)
    old = (exps << uint.type(shift)) | mant  # 0: subnormal, mask: NaN/inf
    p = np.array([0.01, 0.5, 0.99, 0.3])[np.searchsorted([0, 1, 2, mask], exps)]
    new = old.copy()
    hit = rng.random(old.size) < p
    new[hit] ^= uint.type(1)
    _round_trip_piece(dtype, old, new)


def _bf16_pair(n: int, lr: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    w2 = w + np.float32(lr * 0.229) * rng.standard_normal(n, dtype=np.float32)
    return (
        (w.view(np.uint32) >> 16).astype(np.uint16),
        (w2.view(np.uint32) >> 16).astype(np.uint16),
    )


def _state(arrays: dict[str, np.ndarray], dtype: str = "bfloat16") -> dict[str, TensorBits]:
    return {k: TensorBits.from_numpy(v.copy(), dtype) for k, v in arrays.items()}


def test_apply_in_place_writes_into_the_held_memory() -> None:
    a, b = _bf16_pair(300_000, 1e-5, seed=1)
    c = np.array([0, 0x8000, 0x7F80, 0x7FC1], np.uint16)
    old, new = _state({"w": a, "s": c}), _state({"w": b, "s": c[::-1]})
    enc = dc.encode_delta(old, new, version=2, base_version=1, max_chunk_bytes=20_000)
    assert "exponent" in enc.manifest["tensors"][1]["encoding"]
    held = _state({"w": a, "s": c})
    addresses = {k: t.bits.__array_interface__["data"][0] for k, t in held.items()}
    out = dc.apply_in_place(json.loads(json.dumps(enc.manifest)), enc.chunks, held)
    assert dc.same_state(out, new)
    assert {k: t.bits.__array_interface__["data"][0] for k, t in out.items()} == addresses
    assert dc.state_hash(out) == enc.manifest["state_hash"]


def test_apply_in_place_failing_after_writes_restores_the_base() -> None:
    a, b = _bf16_pair(200_000, 1e-5, seed=2)
    old, new = _state({"w": a, "v": a[:5000]}), _state({"w": b, "v": b[:5000]})
    enc = dc.encode_delta(old, new, version=2, base_version=1)
    manifest = json.loads(json.dumps(enc.manifest))
    manifest["tensors"][1]["hash"] = "0" * 32  # "w": checked after it was written
    held = _state({"w": a, "v": a[:5000]})
    with pytest.raises(dc.HashMismatch):
        dc.apply_in_place(manifest, enc.chunks, held)
    assert dc.same_state(held, old)
    assert not np.array_equal(a, b)


def test_apply_in_place_refuses_what_it_cannot_do_without_writing() -> None:
    a, b = _bf16_pair(10_000, 1e-5, seed=3)
    old, new = _state({"w": a}), _state({"w": b})
    enc = dc.encode_delta(old, new, version=2, base_version=1)
    key = dc.encode_keyframe(new, version=2)
    with pytest.raises(ValueError, match="only a delta"):
        dc.apply_in_place(key.manifest, key.chunks, _state({"w": a}))
    with pytest.raises(ValueError, match="exactly the state"):
        dc.apply_in_place(enc.manifest, enc.chunks, {**_state({"w": a}), "x": old["w"]})
    frozen = {"w": TensorBits("bfloat16", (a.size,), np.frombuffer(a.tobytes(), np.uint16))}
    with pytest.raises(ValueError, match="cannot be written"):
        dc.apply_in_place(enc.manifest, enc.chunks, frozen)
    wrong = _state({"w": b})
    with pytest.raises(dc.BaseMismatch):
        dc.apply_in_place(enc.manifest, enc.chunks, wrong)
    assert dc.same_state(wrong, new)


def test_a_damaged_exponent_piece_is_corrupt_and_leaves_the_base() -> None:
    a, b = _bf16_pair(50_000, 1e-5, seed=4)
    old, new = _state({"w": a}), _state({"w": b})
    enc = dc.encode_delta(old, new, version=2, base_version=1)
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(60):
        chunk = bytearray(enc.chunks[0])
        for at in rng.integers(40, len(chunk), 3):
            chunk[at] ^= 1 << int(rng.integers(0, 8))
        refused += _refused_or_exact(enc, chunk, a, old, new)
    assert refused >= 50


def _refused_or_exact(enc: dc.Encoded, chunk: bytearray, a: np.ndarray, old, new) -> bool:
    """Apply ``enc`` with its first chunk replaced by ``chunk`` (its checksum made to match)
    onto a copy of base ``a``: True when refused (the base then intact), else the result must
    be exact (damage to padding bits is harmless)."""
    manifest = json.loads(json.dumps(enc.manifest))
    manifest["chunks"][0]["checksum"] = dfile.xxhash.xxh3_128_hexdigest(bytes(chunk))
    held = _state({"w": a})
    try:
        out = dc.apply_in_place(manifest, [bytes(chunk)], held)
    except dc.DeltaError:
        assert dc.same_state(held, old)
        return True
    assert dc.same_state(out, new)
    return False


def test_versions_of_the_previous_encoder_still_decode() -> None:
    """Golden bytes written by the encoder before exponent pieces existed
    (``make_v1_golden.py``): sparse, xor, raw and unchanged pieces in four chunks."""
    enc = dfile.unpack((DATA / "v1-delta.rlwd").read_bytes())
    arrays = np.load(DATA / "v1-delta-states.npz")
    tag = {"f.f32": "float32"}
    old = {
        k[4:]: TensorBits.from_numpy(arrays[k], tag.get(k[4:], "bfloat16"))
        for k in arrays
        if k.startswith("old.")
    }
    new = {
        k[4:]: TensorBits.from_numpy(arrays[k], tag.get(k[4:], "bfloat16"))
        for k in arrays
        if k.startswith("new.")
    }
    assert len(enc.chunks) == 4
    assert "exponent" not in {t["encoding"] for t in enc.manifest["tensors"]}
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)
    held = {k: TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in old.items() if k in new}
    with pytest.raises(ValueError):  # d.new has no base: not appliable in place
        dc.apply_in_place(enc.manifest, enc.chunks, held)


def test_bounds_follow_their_definitions_on_a_toy_input() -> None:
    """bf16 base: 8 elements of exponent field 0x7F (1.0) and 8 of 0x70; new: 4 of the
    first bucket +1, all 8 of the second: 2 of them +1 and 6 of them -2.

    Order 0: N = 16, k = 12: 16 * H(3/4) + 12 * H({z=2: 6, z=3: 6}) = 12.98 + 12 bits.
    Conditioned: bucket 0x7F: 8 * H(1/2) + 4 * 0 = 8; bucket 0x70: 8 * H(1) = 0, plus
    8 * H({2: 2, 3: 6}) = 6.49: 14.49 bits."""
    base = np.array([0x3F80] * 8 + [0x3800] * 8, np.uint16)
    new = base.copy()
    new[:4] += 1
    new[8:10] += 1
    new[10:] -= 2
    old_s, new_s = _state({"x": base}), _state({"x": new})

    def h(*p: float) -> float:
        return float(-sum(x * np.log2(x) for x in p if x))

    order0 = dc.entropy_bound(old_s, new_s)
    assert order0.changed == 12 and order0.raw_bits == 256
    assert order0.bound_bits == pytest.approx(16 * h(0.75, 0.25) + 12 * 1.0)
    cond = dc.conditioned_bound(old_s, new_s)
    assert cond.bound_bits == pytest.approx(8 * 1.0 + 8 * h(0.25, 0.75))
    assert cond.ratio == pytest.approx(256 / (8 + 8 * h(0.25, 0.75)))
    ints = {"x": TensorBits.from_numpy(base)}, {"x": TensorBits.from_numpy(new)}  # uint16
    assert dc.conditioned_bound(*ints).bound_bits == pytest.approx(order0.bound_bits)


def test_changes_window_keeps_the_encoder_consistent() -> None:
    """A range split across chunks re-encodes each part from its own changes."""
    a, b = _bf16_pair(400_000, 1e-5, seed=6)
    old, new = _state({"w": a}), _state({"w": b})
    enc = dc.encode_delta(old, new, version=1, base_version=0, max_chunk_bytes=8_000)
    assert len(enc.chunks) > 3 and "exponent" in enc.manifest["tensors"][0]["encoding"]
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)


def _golden_states(stem: str, tags: dict[str, str]) -> tuple[dict[str, TensorBits], ...]:
    arrays = np.load(DATA / f"{stem}-states.npz")
    return tuple(
        {
            k[len(side) :]: TensorBits.from_numpy(arrays[k], tags.get(k[len(side) :], "bfloat16"))
            for k in arrays
            if k.startswith(side)
        }
        for side in ("old.", "new.")
    )


def test_exponent_pieces_of_the_first_exponent_encoder_still_decode() -> None:
    """Golden bytes with ``exponent`` pieces (encoding 6), written before ``exponent2``
    existed (``make_exponent_golden.py``): decoded and applied in place, bit for bit."""
    enc = dfile.unpack((DATA / "exponent-delta.rlwd").read_bytes())
    tags = {"c.f16": "float16", "d.f32": "float32", "e.f64": "float64"}
    old, new = _golden_states("exponent-delta", tags)
    assert len(enc.chunks) == 4
    pieces = [p for t in enc.manifest["tensors"] for p in t["pieces"]]
    assert sum(p[3] == "exponent" for p in pieces) >= 2
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)
    held = {k: TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in old.items()}
    assert dc.same_state(dc.apply_in_place(enc.manifest, enc.chunks, held), new)


@pytest.mark.parametrize("encoding", [EXPONENT2, EXPONENT3])
def test_an_exponent_piece_refuses_a_field_of_another_width(encoding: int) -> None:
    """``aux`` names the exponent field; one of another element width, or an unknown one, is
    refused before anything is decoded."""
    a, b = _bf16_pair(5000, 1e-4, seed=7)
    ch = find_changes(a, b, None, None)
    encoder = encode_exponent2 if encoding == EXPONENT2 else encode_exponent3
    aux, streams = encoder(a, ch.pos, ch.diff, EXPONENT_FIELDS["bfloat16"])
    dctx = zstandard.ZstdDecompressor()
    for bad in (3, 4, 0, 9):  # float32, float64, none, unknown
        piece = Piece(0, 0, a.size, encoding, bad, int(ch.pos.size), tuple(streams))
        with pytest.raises(ValueError, match="field"):
            decode_piece(piece, a, np.empty_like(a), dctx)
    good = Piece(0, 0, a.size, encoding, aux, int(ch.pos.size), tuple(streams))
    out = np.empty_like(a)
    decode_piece(good, a, out, dctx)
    assert np.array_equal(out, b)


def test_dense_float_changes_are_coded_conditioned_on_the_base() -> None:
    """A step that changes every element (the learner's first Adam steps change 75-100% of
    some tensors): the exponent encodings are tried and are well below the byte-plane
    fallbacks."""
    a, b = _bf16_pair(200_000, 3e-3, seed=8)
    old, new = _state({"w": a}), _state({"w": b})
    enc = dc.encode_delta(old, new, version=1, base_version=0)
    bound = dc.conditioned_bound(old, new)
    assert bound.changed > 0.95 * bound.numel
    assert enc.manifest["tensors"][0]["encoding"] in ("exponent2", "exponent3")
    assert enc.ratio >= 0.9 * bound.ratio, (enc.ratio, bound.ratio)
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)


def _exponent3_piece(a: np.ndarray, b: np.ndarray, dtype: str = "bfloat16") -> Piece:
    ch = find_changes(a, b, None, None)
    aux, streams = encode_exponent3(a, ch.pos, ch.diff, EXPONENT_FIELDS[dtype])
    return Piece(0, 0, a.size, EXPONENT3, aux, int(ch.pos.size), tuple(streams))


def test_a_damaged_exponent3_stream_is_refused_or_exact_and_never_crashes() -> None:
    """Every truncation of the stream is refused by the piece decoder itself (the base put
    back by undo); single and triple bit flips all over it (header, rANS words, plain bits),
    behind a valid chunk checksum, are refused by the codec (``DeltaError``, base intact) or
    decode exactly (a flip the model cannot notice, such as a low gap bit of a bucket's last
    change, is caught by the tensor hash)."""
    a, b = _bf16_pair(60_000, 2e-5, seed=9)  # more changes than exponent2 is tried on
    piece = _exponent3_piece(a, b)
    data = bytes(piece.streams[0][1])
    dctx = zstandard.ZstdDecompressor()
    for cut in range(len(data)):
        p = Piece(0, 0, a.size, EXPONENT3, piece.aux, piece.count, ((0, data[:cut]),))
        held, undo = a.copy(), []
        with pytest.raises(ValueError):
            decode_piece(p, held, held, dctx, undo=undo)
        undo_all(undo)
        assert np.array_equal(held, a)
    old, new = _state({"w": a}), _state({"w": b})
    enc = dc.encode_delta(old, new, version=2, base_version=1)
    assert enc.manifest["tensors"][0]["encoding"] == "exponent3"
    chunk0 = enc.chunks[0]
    at0 = chunk0.index(data[:16])
    rng = np.random.default_rng(1)
    refused = 0
    for flips in (1, 3):
        for _ in range(150):
            chunk = bytearray(chunk0)
            for at in rng.integers(at0, at0 + len(data), flips):
                chunk[at] ^= 1 << int(rng.integers(0, 8))
            refused += _refused_or_exact(enc, chunk, a, old, new)
    assert refused >= 280


@pytest.mark.parametrize("dtype", FLOATS)
def test_exponent3_codes_differences_of_every_bit_length(dtype: str) -> None:
    """Differences from 1 ULP to the element width's full range (the plain-bit symbols and
    the escape), in buckets of a few and of many changes."""
    rng = np.random.default_rng(11)
    width = dc.DTYPE_WIDTHS[dtype]
    uint = UINT_BY_WIDTH[width]
    old = _weights(rng, dtype, 40_000, "gauss")
    new = old.copy()
    at = rng.choice(old.size, 8000, replace=False)
    sizes = rng.integers(0, 8 * width, at.size)
    step = rng.integers(1, 1 << 62, at.size, dtype=np.uint64) >> (63 - sizes).astype(np.uint64)
    new[at] = old[at] + np.maximum(step, 1).astype(uint)
    new[at[:5]] = old[at[:5]] ^ uint.type(1 << (8 * width - 1))  # sign flips: the longest
    same = at[new[at] == old[at]]
    new[same] += uint.type(1)
    assert int(np.count_nonzero(new != old)) == at.size
    _round_trip_piece(dtype, old, new)


def test_exponent3_is_deterministic_and_decodes_golden_bytes() -> None:
    """The same change gives the same bytes; ``exponent2-delta.rlwd`` and
    ``exponent3-delta.rlwd`` (``make_exponent3_golden.py``) still decode and apply in place,
    and the encoder still writes the second byte for byte from its states (a faster encoder
    must keep the format)."""
    a, b = _bf16_pair(100_000, 1e-5, seed=12)
    assert _exponent3_piece(a, b).streams == _exponent3_piece(a.copy(), b.copy()).streams
    tags = {"c.f16": "float16", "d.f32": "float32", "e.f64": "float64"}
    old, new = _golden_states("exponent3-delta", tags)
    # the golden bytes were written with the legacy (xxh3) hashes: encode with those
    again = dc.encode_delta(
        old, new, version=9, base_version=8, max_chunk_bytes=12_000, hash_algorithm="xxh3_128"
    )
    assert dfile.pack(again) == (DATA / "exponent3-delta.rlwd").read_bytes()
    for stem, encoding in (("exponent2-delta", "exponent2"), ("exponent3-delta", "exponent3")):
        enc = dfile.unpack((DATA / f"{stem}.rlwd").read_bytes())  # one input, both encoders
        pieces = [p for t in enc.manifest["tensors"] for p in t["pieces"]]
        assert sum(p[3] == encoding for p in pieces) >= 2
        assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)
        held = {k: TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in old.items()}
        assert dc.same_state(dc.apply_in_place(enc.manifest, enc.chunks, held), new)


def _many_tensors(seed: int) -> tuple[dict[str, TensorBits], dict[str, TensorBits]]:
    arrays = {f"t{i}": _bf16_pair(20_000 + 3_000 * i, 1e-5, seed=seed + i) for i in range(6)}
    return _state({k: a for k, (a, _) in arrays.items()}), _state(
        {k: b for k, (_, b) in arrays.items()}
    )


def test_threads_over_tensors_change_no_byte_of_the_output() -> None:
    old, new = _many_tensors(10)
    one = dc.encode_delta(old, new, version=2, base_version=1, max_chunk_bytes=9_000, workers=1)
    old, new = _many_tensors(10)  # fresh tensors: no hash cached by the first encode
    four = dc.encode_delta(old, new, version=2, base_version=1, max_chunk_bytes=9_000, workers=4)
    assert one.manifest == four.manifest and one.chunks == four.chunks
    assert dc.same_state(dc.decode(four.manifest, four.chunks, old, workers=3), new)
    out = dc.apply_in_place(four.manifest, four.chunks, _many_tensors(10)[0], workers=4)
    assert dc.same_state(out, new)
    with pytest.raises(ValueError, match="workers"):
        dc.encode_delta(old, new, version=2, base_version=1, workers=0)


def test_a_failure_on_one_thread_puts_back_what_every_thread_wrote() -> None:
    old, new = _many_tensors(20)
    enc = dc.encode_delta(old, new, version=2, base_version=1, workers=2)
    manifest = json.loads(json.dumps(enc.manifest))
    manifest["tensors"][-1]["hash"] = "0" * 64  # the last tensor fails after it was written
    held = _many_tensors(20)[0]
    with pytest.raises(dc.HashMismatch):
        dc.apply_in_place(manifest, enc.chunks, held, workers=4)
    assert dc.same_state(held, old)

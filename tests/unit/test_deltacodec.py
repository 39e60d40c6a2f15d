"""The weight-delta codec.

Properties asserted: deltas and keyframes round-trip bit for bit for every dtype, shape
(including 0-size and scalars) and change pattern (none, all, sparse, dense), with NaN
payloads, -0.0, infinities and denormals; every chunk respects the size limit and decodes on
its own; corrupted, missing or extra chunks, a wrong base, a tampered manifest or hash each
raise their own error and leave the base untouched; recycled buffers never alias the base;
encoding is deterministic; on a simulated bf16 RL step the ratio is >= 0.9 of the entropy
bound conditioned on the base exponent (and above the order-0 bound).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlstream.schemas import deltacodec as dc
from rlstream.schemas.deltacodec import TensorBits
from rlstream.schemas.deltacodec import file as dfile
from rlstream.schemas.deltacodec.bits import UINT_BY_WIDTH
from rlstream.schemas.deltacodec.encodings import decode_piece
from rlstream.schemas.deltacodec.pieces import (
    _true_positions,
    decode_positions,
    encode_positions,
)
from rlstream.schemas.deltacodec.wire import parse_chunk

DTYPES = sorted(dc.DTYPE_WIDTHS)
#: Bit patterns that float code tends to mangle: NaN payloads (quiet, signalling, negative),
#: -0.0, +-inf, the smallest denormal.
SPECIAL = {
    2: [0x7E01, 0x7F81, 0xFFC3, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7C01, 0xFE00],
    4: [0x7FC0_0001, 0x7F80_0001, 0xFFC0_1234, 0x8000_0000, 0x7F80_0000, 0xFF80_0000, 0x1],
    8: [0x7FF8_0000_0000_0001, 0xFFF0_0000_0000_0001, 0x8000_0000_0000_0000, 0x1],
    1: [0x7F, 0xFF, 0x80, 0x01],
}


def _random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    width = dc.DTYPE_WIDTHS[dtype]
    bits = rng.integers(0, 256, n * width, dtype=np.uint8).view(UINT_BY_WIDTH[width])
    if n and rng.random() < 0.5:
        specials = np.array(SPECIAL[width], dtype=UINT_BY_WIDTH[width])
        at = rng.integers(0, n, min(n, 8))
        bits[at] = rng.choice(specials, at.size)
    return bits


def _change(rng: np.random.Generator, bits: np.ndarray, pattern: str) -> np.ndarray:
    new = bits.copy()
    n = bits.size
    if pattern == "none" or not n:
        return new
    fraction = {"all": 1.0, "sparse": 0.02, "dense": 0.7, "one": 1.0 / n}[pattern]
    mask = rng.random(n) < fraction if pattern != "all" else np.ones(n, bool)
    if pattern == "one":
        mask[rng.integers(0, n)] = True
    step = rng.choice(np.array([1, 2, 3, 255, 0x8000], dtype=np.uint64), n).astype(bits.dtype)
    new[mask] = bits[mask] + np.where(rng.random(n) < 0.5, step, -step)[mask]
    if pattern != "none" and rng.random() < 0.5:  # sprinkle special values among the changes
        specials = np.array(SPECIAL[bits.itemsize], dtype=bits.dtype)
        at = rng.integers(0, n, min(n, 5))
        new[at] = rng.choice(specials, at.size)
    return new


def _tensor(dtype: str, shape: tuple[int, ...], bits: np.ndarray) -> TensorBits:
    return TensorBits(dtype, shape, bits)


def _copy_state(state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    return {k: TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in state.items()}


shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
    st.integers(0, 3000).map(lambda n: (n,)),
)


@st.composite
def state_pairs(draw: Any) -> tuple[dict[str, TensorBits], dict[str, TensorBits]]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old, new = {}, {}
    for i in range(draw(st.integers(1, 4))):
        dtype, shape = draw(st.sampled_from(DTYPES)), draw(shapes)
        pattern = draw(st.sampled_from(["none", "all", "sparse", "dense", "one"]))
        bits = _random_bits(rng, dtype, int(np.prod(shape, dtype=np.int64)))
        old[f"t{i}"] = _tensor(dtype, shape, bits)
        new[f"t{i}"] = _tensor(dtype, shape, _change(rng, bits, pattern))
    return old, new


@settings(max_examples=120, deadline=None)
@given(state_pairs(), st.sampled_from([300, 2_000, 900_000]))
def test_delta_round_trip_is_bit_exact_and_chunks_fit(
    pair: tuple[dict[str, TensorBits], dict[str, TensorBits]], limit: int
) -> None:
    old, new = pair
    before = _copy_state(old)
    enc = dc.encode_delta(old, new, version=7, base_version=6, max_chunk_bytes=limit)
    assert all(len(c) <= limit for c in enc.chunks)
    assert [c["nbytes"] for c in enc.manifest["chunks"]] == [len(c) for c in enc.chunks]
    manifest = json.loads(json.dumps(enc.manifest))  # as it arrives from Kafka
    out = dc.decode(manifest, enc.chunks, _copy_state(old))
    assert dc.same_state(out, new)
    assert dc.same_state(old, before)
    for entry in manifest["tensors"]:
        changed = int(np.count_nonzero(old[entry["name"]].bits != new[entry["name"]].bits))
        assert entry["changed"] == changed


@settings(max_examples=60, deadline=None)
@given(state_pairs(), st.sampled_from([300, 5_000, 900_000]))
def test_keyframe_round_trip_is_bit_exact(
    pair: tuple[dict[str, TensorBits], dict[str, TensorBits]], limit: int
) -> None:
    _, state = pair
    enc = dc.encode_keyframe(state, version=3, max_chunk_bytes=limit)
    assert enc.manifest["kind"] == "keyframe" and enc.manifest["base_version"] is None
    assert all(len(c) <= limit for c in enc.chunks)
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks), state)
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, {"junk": state["t0"]}), state)


@settings(max_examples=40, deadline=None)
@given(state_pairs())
def test_every_chunk_decodes_on_its_own(
    pair: tuple[dict[str, TensorBits], dict[str, TensorBits]],
) -> None:
    old, new = pair
    enc = dc.encode_delta(old, new, version=1, base_version=0, max_chunk_bytes=400)
    names = [t["name"] for t in enc.manifest["tensors"]]
    import zstandard

    for payload in enc.chunks:
        for piece in parse_chunk(payload):  # nothing from any other chunk is needed
            name = names[piece.tensor]
            target = np.empty(piece.stop - piece.start, dtype=new[name].bits.dtype)
            base = old[name].bits[piece.start : piece.stop]
            decode_piece(piece, base, target, zstandard.ZstdDecompressor())
            assert np.array_equal(target, new[name].bits[piece.start : piece.stop])


def _bf16_step(n: int, lr: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bits before/after one steady-state Adam step on N(0, 0.01²) master weights."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    w2 = w + np.float32(lr * 0.229) * rng.standard_normal(n, dtype=np.float32)

    def bf16(x: np.ndarray) -> np.ndarray:
        u = x.view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)

    return bf16(w), bf16(w2)


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_ratio_reaches_ninety_percent_of_the_conditioned_bound(lr: float) -> None:
    a, b = _bf16_step(2_000_000, lr)
    old = {"w": TensorBits.from_numpy(a, "bfloat16")}
    new = {"w": TensorBits.from_numpy(b, "bfloat16")}
    enc = dc.encode_delta(old, new, version=1, base_version=0)
    bound = dc.conditioned_bound(old, new)
    assert 0.005 < bound.changed / bound.numel < 0.2
    assert enc.ratio >= 0.9 * bound.ratio, (enc.ratio, bound.ratio)
    assert enc.ratio > dc.entropy_bound(old, new).ratio  # beats any order-0 coder
    assert enc.manifest["tensors"][0]["encoding"] == "exponent3"


def test_a_tensor_larger_than_one_encoding_range() -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(0, 2**16, 4_500_001, dtype=np.uint16)  # > MAX_RANGE_BYTES, odd length
    b = a.copy()
    b[rng.integers(0, a.size, 5_000)] += np.uint16(3)
    b[-1] ^= np.uint16(0x8000)
    old, new = {"x": TensorBits.from_numpy(a)}, {"x": TensorBits.from_numpy(b)}
    enc = dc.encode_delta(old, new, version=1, base_version=0)
    assert len(enc.manifest["tensors"][0]["pieces"]) >= 2
    assert enc.manifest["tensors"][0]["hash"] == dc.bits_hash(b)
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)


def test_entropy_bound_follows_its_definition() -> None:
    old = {"x": TensorBits.from_numpy(np.zeros(1000, np.uint16))}
    bits = np.zeros(1000, np.uint16)
    bits[:100] = 1  # 10% changed, value symbols: zigzag(+1) = 2 for all -> 0 bits each
    bound = dc.entropy_bound(old, {"x": TensorBits.from_numpy(bits)})
    h = -(0.1 * np.log2(0.1) + 0.9 * np.log2(0.9))
    assert bound.bound_bits == pytest.approx(1000 * h)
    assert bound.ratio == pytest.approx(16_000 / (1000 * h))


def _sample() -> tuple[dict[str, TensorBits], dict[str, TensorBits], dc.Encoded]:
    a, b = _bf16_step(300_000, 1e-5, seed=1)
    old = {
        "w": TensorBits.from_numpy(a, "bfloat16"),
        "f": TensorBits.from_numpy(np.array([0.0, -0.0, np.inf, np.nan], np.float32)),
    }
    new = {
        "w": TensorBits.from_numpy(b, "bfloat16"),
        "f": TensorBits.from_numpy(np.array([-0.0, 0.0, -np.inf, 1.0], np.float32)),
    }
    enc = dc.encode_delta(old, new, version=2, base_version=1, max_chunk_bytes=5_000)
    assert len(enc.chunks) > 3
    return old, new, enc


def test_corrupted_chunk_is_refused_and_base_untouched() -> None:
    old, _, enc = _sample()
    before = _copy_state(old)
    for i in (0, len(enc.chunks) // 2, len(enc.chunks) - 1):
        bad = list(enc.chunks)
        flipped = bytearray(bad[i])
        flipped[len(flipped) // 2] ^= 0x10
        bad[i] = bytes(flipped)
        with pytest.raises(dc.ChunkCorrupt, match=f"chunk {i}"):
            dc.decode(enc.manifest, bad, old)
    truncated = list(enc.chunks)
    truncated[1] = truncated[1][:-1]
    with pytest.raises(dc.ChunkCorrupt):
        dc.decode(enc.manifest, truncated, old)
    with pytest.raises(dc.ChunkCorrupt):
        dc.decode(enc.manifest, [*enc.chunks, b"extra"], old)
    with pytest.raises(dc.ChunkCorrupt):
        dc.verify_chunk(enc.manifest, 0, enc.chunks[1])
    assert dc.same_state(old, before)


def test_missing_chunk_is_refused() -> None:
    old, _, enc = _sample()
    with pytest.raises(dc.MissingChunk):
        dc.decode(enc.manifest, enc.chunks[:-1], old)
    with pytest.raises(dc.MissingChunk):
        dc.decode(enc.manifest, [None, *enc.chunks[1:]], old)


def test_wrong_base_is_refused_and_untouched() -> None:
    old, new, enc = _sample()
    wrong = _copy_state(old)
    bits = wrong["w"].bits.copy()
    bits[12345] ^= 1
    wrong["w"] = TensorBits("bfloat16", wrong["w"].shape, bits)
    before = _copy_state(wrong)
    with pytest.raises(dc.BaseMismatch, match="'w'"):
        dc.decode(enc.manifest, enc.chunks, wrong)
    assert dc.same_state(wrong, before)
    with pytest.raises(dc.BaseMismatch):  # the new version is not its own base
        dc.decode(enc.manifest, enc.chunks, _copy_state(new))
    with pytest.raises(dc.BaseMismatch):
        dc.decode(enc.manifest, enc.chunks, None)
    with pytest.raises(dc.BaseMismatch):  # an extra tensor changes the base state hash
        dc.decode(enc.manifest, enc.chunks, {**_copy_state(old), "extra": old["f"]})
    shape_changed = {**_copy_state(old), "f": TensorBits.from_numpy(np.zeros(5, np.float32))}
    with pytest.raises(dc.BaseMismatch):
        dc.decode(enc.manifest, enc.chunks, shape_changed)


def test_wrong_base_is_refused_fast_when_its_hashes_are_known() -> None:
    old, _, enc = _sample()
    out = dc.decode(enc.manifest, enc.chunks, old)  # hashes of `out` are known and verified
    with pytest.raises(dc.BaseMismatch):
        dc.decode(enc.manifest, enc.chunks, out)


def test_tampered_manifest_is_refused() -> None:
    old, _, enc = _sample()
    m = json.loads(json.dumps(enc.manifest))
    m["tensors"][0]["hash"] = "0" * 32
    with pytest.raises(dc.HashMismatch):
        dc.decode(m, enc.chunks, old)
    m = json.loads(json.dumps(enc.manifest))
    m["state_hash"] = "0" * 32
    with pytest.raises(dc.HashMismatch):
        dc.decode(m, enc.chunks, old)
    for mutate in (
        lambda m: m.update(format="other"),
        lambda m: m.update(kind="patch"),
        lambda m: m["tensors"][0].update(dtype="complex64"),
        lambda m: m["tensors"][0].update(shape=[-1]),
        lambda m: m["chunks"][0].update(index=5),
        lambda m: m.pop("tensors"),
    ):
        m = json.loads(json.dumps(enc.manifest))
        mutate(m)
        with pytest.raises(dc.ManifestInvalid):
            dc.decode(m, enc.chunks, old)


def test_a_chunk_that_disagrees_with_the_manifest_is_corrupt() -> None:
    old, _, enc = _sample()
    m = json.loads(json.dumps(enc.manifest))
    m["tensors"][1]["pieces"][0][2] += 1  # a piece range the chunk does not hold
    with pytest.raises(dc.ChunkCorrupt):
        dc.decode(m, enc.chunks, old)


def test_recycled_buffers_are_used_but_never_alias_the_base() -> None:
    old, new, enc = _sample()
    spare = _copy_state(old)
    out = dc.decode(enc.manifest, enc.chunks, old, recycle=spare)
    assert dc.same_state(out, new)
    assert np.shares_memory(out["w"].bits, spare["w"].bits)
    before = _copy_state(old)
    out2 = dc.decode(enc.manifest, enc.chunks, old, recycle=old)  # must not overwrite base
    assert dc.same_state(out2, new) and dc.same_state(old, before)
    readonly = {
        k: TensorBits(t.dtype, t.shape, np.frombuffer(t.bits.tobytes(), t.bits.dtype))
        for k, t in old.items()
    }
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old, recycle=readonly), new)


def test_tensors_added_removed_or_reshaped() -> None:
    old = {
        "keep": TensorBits.from_numpy(np.arange(100, dtype=np.int32)),
        "gone": TensorBits.from_numpy(np.ones(3, np.float64)),
        "reshaped": TensorBits.from_numpy(np.zeros((2, 3), np.float16)),
    }
    new = {
        "keep": TensorBits.from_numpy(np.arange(100, dtype=np.int32)),
        "added": TensorBits.from_numpy(np.array([True, False, True])),
        "reshaped": TensorBits.from_numpy(np.zeros((3, 2), np.float16)),
    }
    enc = dc.encode_delta(old, new, version=1, base_version=0)
    entries = {t["name"]: t for t in enc.manifest["tensors"]}
    assert entries["keep"]["encoding"] == "unchanged" and entries["keep"]["changed"] == 0
    assert entries["added"]["base_hash"] is None and entries["reshaped"]["base_hash"] is None
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)


def test_encoding_is_deterministic_and_unchanged_costs_almost_nothing() -> None:
    a, _ = _bf16_step(1_000_000, 1e-6)
    state = {"w": TensorBits.from_numpy(a, "bfloat16")}
    e1 = dc.encode_delta(state, state, version=1, base_version=0)
    e2 = dc.encode_delta(state, state, version=1, base_version=0)
    assert e1.chunks == e2.chunks and e1.manifest == e2.manifest
    assert e1.manifest["encoded_bytes"] < 100


def test_dense_change_uses_a_dense_encoding_and_noise_goes_raw() -> None:
    rng = np.random.default_rng(5)
    a = rng.integers(0, 2**16, 50_000, dtype=np.uint16)
    dense = {"x": TensorBits.from_numpy(a + np.uint16(1))}
    noise = {"x": TensorBits.from_numpy(rng.integers(0, 2**16, 50_000, dtype=np.uint16))}
    base = {"x": TensorBits.from_numpy(a)}
    e = dc.encode_delta(base, dense, version=1, base_version=0)
    assert e.manifest["tensors"][0]["encoding"] in ("xor", "diff")
    assert dc.same_state(dc.decode(e.manifest, e.chunks, base), dense)
    e = dc.encode_delta(base, noise, version=1, base_version=0)
    assert e.manifest["tensors"][0]["encoding"] == "raw"
    assert dc.same_state(dc.decode(e.manifest, e.chunks, base), noise)


@pytest.mark.parametrize(
    ("steps", "packing"),
    [([1, -1] * 6 + [2, 300], 2), ([1, -2, 3, -4, 5, -6, 7, 99], 4), ([999], 0)],
)
@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64"])  # no exponent: sparse pieces
def test_value_packings_round_trip(steps: list[int], packing: int, dtype: str) -> None:
    rng = np.random.default_rng(len(steps))
    width = dc.DTYPE_WIDTHS[dtype]
    a = _random_bits(rng, dtype, 20_001)
    d = rng.choice(np.array(steps, dtype=np.int64), a.size).astype(a.dtype)
    b = np.where(rng.random(a.size) < 0.05, a + d, a)
    old, new = {"x": TensorBits(dtype, (a.size,), a)}, {"x": TensorBits(dtype, (a.size,), b)}
    enc = dc.encode_delta(old, new, version=1, base_version=0)
    pieces = [p for c in enc.chunks for p in parse_chunk(c)]
    assert {p.aux for p in pieces} == {packing}, width
    assert dc.same_state(dc.decode(enc.manifest, enc.chunks, old), new)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 5000), st.floats(0, 1))
def test_true_positions_is_flatnonzero(seed: int, size: int, density: float) -> None:
    mask = np.random.default_rng(seed).random(size) < density
    assert np.array_equal(_true_positions(mask), np.flatnonzero(mask))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2000), max_size=200))
def test_gap_code_round_trips(gaps: list[int]) -> None:
    pos = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    assert np.array_equal(decode_positions(encode_positions(pos), pos.size), pos)


def test_container_round_trip_and_damage() -> None:
    _, _, enc = _sample()
    data = dfile.pack(enc)
    back = dfile.unpack(data)
    assert back.manifest == enc.manifest and back.chunks == enc.chunks
    with pytest.raises(dc.ManifestInvalid):
        dfile.unpack(b"nope" + data[4:])
    damaged = bytearray(data)
    damaged[40] ^= 1  # inside the manifest
    with pytest.raises(dc.ManifestInvalid):
        dfile.unpack(bytes(damaged))
    with pytest.raises(dc.ChunkCorrupt):
        dfile.unpack(data[:-3])


def test_torch_round_trip_keeps_bits() -> None:
    torch = pytest.importorskip("torch")
    nan_payload = torch.tensor([0x7FC1, -0x8000, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    sd = {
        "bf16": nan_payload,
        "f32": torch.tensor([-0.0, float("inf"), 1e-45]),
        "b": torch.tensor([[True, False]]),
        "i8": torch.tensor(-3, dtype=torch.int8),
        "t": torch.arange(6, dtype=torch.float64).reshape(2, 3).t(),  # non-contiguous
    }
    state = dc.from_torch(sd)
    assert state["bf16"].dtype == "bfloat16" and state["i8"].shape == ()
    back = dc.to_torch(state)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert back[k].contiguous().view(torch.uint8).equal(v.contiguous().view(torch.uint8))
    assert dc.same_state(dc.from_torch(back), state)


def test_tensor_bits_is_read_only_and_checks_its_shape() -> None:
    t = TensorBits.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert t.shape == (2, 3) and t.dtype == "float32" and not t.bits.flags.writeable
    with pytest.raises(ValueError):
        TensorBits("float32", (7,), t.bits)
    with pytest.raises(ValueError):
        TensorBits("bfloat16", (6,), t.bits)
    with pytest.raises(ValueError):
        TensorBits.from_numpy(np.zeros(2, np.complex64))
    big_endian = TensorBits.from_numpy(np.array([1.5], dtype=">f4"))
    assert big_endian.same_bits(TensorBits.from_numpy(np.array([1.5], dtype="<f4")))

"""Crafted chunks: the decoders refuse out-of-range input, never write outside a tensor.

Real pieces of every encoding (``sparse``, ``exponent2``, ``exponent3``, ``direct``, ``xor``,
``diff``, ``planes``, ``raw``, ``unchanged`` from this encoder; the retired ``exponent`` from its golden
bytes) are corrupted at random with a fixed seed: bytes flipped, piece and stream header fields
set to edge values (0, the element count, past it, 2**31, 2**63 - 1, 2**64 - 1 ...), streams cut
short or grown, encodings swapped. Each crafted chunk is then *vouched for*: its checksum and
size, and the manifest's piece table, are made to match, as a leaked signing key would let an
attacker do, so that the bytes reach the decoders rather than stop at the checksum.

Properties: ``decode`` and ``apply_in_place`` either refuse with a ``DeltaError`` (a clear
exception) or return exactly the genuine new state (a corruption that changes nothing decoded);
never another exception. Outputs live inside guard bands that must stay untouched (no write
outside a tensor), ``apply_in_place`` leaves the held base bit for bit as it was when it
refuses, and the base given to ``decode`` is never written.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlstream.schemas import deltacodec as dc
from rlstream.schemas.deltacodec import TensorBits
from rlstream.schemas.deltacodec import file as dfile
from rlstream.schemas.deltacodec.bits import digest
from rlstream.schemas.deltacodec.pieces import ENCODINGS, PIECE_HEADER, STREAM_HEADER, Piece
from rlstream.schemas.deltacodec.wire import CHUNK_HEADER, pack_chunk, parse_chunk, piece_entry

DATA = Path(__file__).parent / "data" / "deltacodec"
TRIALS = 150  # crafted chunks per case
GUARD = 64  # elements of guard band on each side of every output tensor
CANARY = 0xA5
EDGES = (0, 1, 2, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)
#: piece header fields: (name, byte offset in ``PIECE_HEADER``, struct format)
FIELDS = (("tensor", 0, "<I"), ("start", 4, "<Q"), ("stop", 12, "<Q"), ("encoding", 20, "<B"),
          ("nstreams", 21, "<B"), ("aux", 22, "<B"), ("count", 24, "<Q"))  # fmt: skip


# --- real pieces of every encoding -------------------------------------------------------


def _bf16(w: np.ndarray) -> np.ndarray:
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def _cases() -> list[tuple[str, dict[str, TensorBits], dc.Encoded]]:
    """(name, base, encoded version) covering every encoding."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal(40_000, dtype=np.float32) * np.float32(0.02)
    f = rng.standard_normal(3_000, dtype=np.float32)
    few = w + np.float32(1e-4) * rng.standard_normal(w.size, dtype=np.float32)
    noise = rng.integers(0, 2**16, 6000, dtype=np.uint16)
    old = {
        "a.w": _bf16(w),
        "b.f32": f,
        "c.same": _bf16(w[:500]),
        "d.xor": noise,
        "e.diff": noise[::-1].copy(),
        "f.raw": noise[:3000].copy(),
    }
    new = {
        "a.w": _bf16(few),  # sparse, exponent2/3
        "b.f32": f + np.float32(1e-6) * rng.standard_normal(f.size, dtype=np.float32),
        "c.same": _bf16(w[:500]),  # unchanged
        "d.xor": noise ^ rng.integers(1, 8, noise.size, dtype=np.uint16),  # xor
        "e.diff": noise[::-1] + np.uint16(1),  # diff
        "f.raw": rng.integers(0, 2**16, 3000, dtype=np.uint16),  # raw
    }
    tags = {"b.f32": "float32", "d.xor": "uint16", "e.diff": "uint16", "f.raw": "uint16"}

    def state(arrays: dict[str, np.ndarray]) -> dict[str, TensorBits]:
        return {
            k: TensorBits.from_numpy(v.copy(), tags.get(k, "bfloat16")) for k, v in arrays.items()
        }

    base, after = state(old), state(new)
    delta = dc.encode_delta(base, after, version=2, base_version=1, max_chunk_bytes=6_000)
    fast = dc.encode_delta(  # direct pieces
        base, after, version=2, base_version=1, max_chunk_bytes=6_000, fast_apply=True
    )
    keyframe = dc.encode_keyframe(after, version=2, max_chunk_bytes=6_000)
    out = [("delta", base, delta), ("fast-apply", base, fast), ("keyframe", base, keyframe)]
    for stem in ("exponent-delta", "exponent3-delta"):  # golden bytes: the retired encoding
        golden = dfile.unpack((DATA / f"{stem}.rlwd").read_bytes())
        arrays = np.load(DATA / f"{stem}-states.npz")
        wide = {"c.f16": "float16", "d.f32": "float32", "e.f64": "float64"}
        golden_base = {
            k[4:]: TensorBits.from_numpy(arrays[k], wide.get(k[4:], "bfloat16"))
            for k in arrays
            if k.startswith("old.")
        }
        out.append((stem, golden_base, golden))
    return out


CASES = _cases()


def test_the_cases_cover_every_encoding() -> None:
    used = {p[3] for _, _, enc in CASES for t in enc.manifest["tensors"] for p in t["pieces"]}
    assert used == set(ENCODINGS), sorted(set(ENCODINGS) - used)


# --- crafting ----------------------------------------------------------------------------


def _pieces_at(payload: bytes) -> Iterator[int]:
    """Byte offset of each piece header in a chunk."""
    at = CHUNK_HEADER.size
    for piece in parse_chunk(payload):
        yield at
        at += piece.nbytes


def _flip(rng: np.random.Generator, payload: bytes) -> bytes:
    buf = bytearray(payload)
    for _ in range(int(rng.integers(1, 9))):
        buf[int(rng.integers(CHUNK_HEADER.size, len(buf)))] ^= int(rng.integers(1, 256))
    return bytes(buf)


def _field(rng: np.random.Generator, payload: bytes) -> bytes:
    """One piece header field, or one stream's length, set to an edge or random value."""
    buf = bytearray(payload)
    at = [*_pieces_at(payload)][int(rng.integers(0, len([*_pieces_at(payload)])))]
    start, stop, nstreams = struct.unpack_from("<QQxB", buf, at + 4)
    edges = (*EDGES, stop - start, stop - start + 1, stop, stop + 1, int(rng.integers(0, 2**62)))
    value = edges[int(rng.integers(0, len(edges)))]
    if nstreams and rng.random() < 0.3:  # a stream's length
        s = at + PIECE_HEADER.size + int(rng.integers(0, nstreams)) * STREAM_HEADER.size
        struct.pack_into("<I", buf, s + 1, value % 2**32)
        return bytes(buf)
    _, offset, fmt = FIELDS[int(rng.integers(0, len(FIELDS)))]
    struct.pack_into(fmt, buf, at + offset, value % 2 ** (8 * struct.calcsize(fmt)))
    return bytes(buf)


def _restream(rng: np.random.Generator, payload: bytes) -> bytes:
    """A piece with a stream cut short, grown with random bytes, or its encoding swapped."""
    pieces = parse_chunk(payload)
    i = int(rng.integers(0, len(pieces)))
    p = pieces[i]
    streams = [(c, bytes(d)) for c, d in p.streams]
    kind = rng.random()
    if kind < 0.4 and streams:
        j = int(rng.integers(0, len(streams)))
        c, d = streams[j]
        streams[j] = (c, d[: int(rng.integers(0, max(1, len(d))))])
    elif kind < 0.7 and streams:
        j = int(rng.integers(0, len(streams)))
        c, d = streams[j]
        streams[j] = (c, d + rng.bytes(int(rng.integers(1, 64))))
    else:
        p = Piece(
            p.tensor, p.start, p.stop, int(rng.integers(0, len(ENCODINGS))), p.aux, p.count, ()
        )
    pieces[i] = Piece(p.tensor, p.start, p.stop, p.encoding, p.aux, p.count, tuple(streams))
    return pack_chunk(pieces)


CRAFTS: tuple[Callable[[np.random.Generator, bytes], bytes], ...] = (_flip, _field, _restream)


def _vouched(manifest: dict[str, Any], chunks: list[bytes]) -> dict[str, Any]:
    """The manifest made to vouch for ``chunks``: sizes and checksums, and each tensor's piece
    table as the chunks describe it (where they still parse)."""
    out = {**manifest, "tensors": [dict(t) for t in manifest["tensors"]]}
    algorithm = dc.hash_algorithm(manifest)
    out["chunks"] = [
        {"index": i, "nbytes": len(c), "checksum": digest(c, algorithm)}
        for i, c in enumerate(chunks)
    ]
    out["encoded_bytes"] = sum(len(c) for c in chunks)
    out["max_chunk_bytes"] = max(manifest["max_chunk_bytes"], *(len(c) for c in chunks))
    rows: dict[int, list[list[Any]]] = {}
    try:
        for index, payload in enumerate(chunks):
            for piece in parse_chunk(payload):
                rows.setdefault(piece.tensor, []).append(piece_entry(index, piece))
    except ValueError:
        return out  # the chunk does not parse: the decoder refuses it whatever the table says
    for t, entry in enumerate(out["tensors"]):
        entry["pieces"] = sorted(rows.get(t, []), key=lambda r: r[1])
    return out


# --- guarded memory ----------------------------------------------------------------------


class Guarded:
    """Tensors whose memory sits between guard bands of a known byte."""

    def __init__(self, state: dict[str, TensorBits]) -> None:
        self.blocks: dict[str, np.ndarray] = {}
        self.state: dict[str, TensorBits] = {}
        for name, t in state.items():
            block = np.full(t.numel + 2 * GUARD, CANARY, t.bits.dtype)
            block[GUARD : GUARD + t.numel] = t.bits
            self.blocks[name] = block
            self.state[name] = TensorBits(t.dtype, t.shape, block[GUARD : GUARD + t.numel])

    def guards_intact(self) -> bool:
        return all(
            np.all(b[:GUARD] == CANARY) and np.all(b[b.size - GUARD :] == CANARY)
            for b in self.blocks.values()
        )

    def bits(self) -> dict[str, np.ndarray]:
        return {n: b[GUARD : b.size - GUARD].copy() for n, b in self.blocks.items()}


def _same(state: dict[str, TensorBits], want: dict[str, np.ndarray]) -> bool:
    return state.keys() == want.keys() and all(np.array_equal(state[k].bits, want[k]) for k in want)


def _try(name: str, base: dict[str, TensorBits], enc: dc.Encoded, rng: np.random.Generator) -> str:
    """Craft one chunk of ``enc``, decode and apply it in place; returns what happened."""
    genuine = dc.decode(enc.manifest, enc.chunks, base)
    want = {k: t.bits.copy() for k, t in genuine.items()}
    chunks = list(enc.chunks)
    i = int(rng.integers(0, len(chunks)))
    chunks[i] = CRAFTS[int(rng.integers(0, len(CRAFTS)))](rng, chunks[i])
    manifest = _vouched(enc.manifest, chunks)
    held_base = {k: t.bits.copy() for k, t in base.items()}
    recycle = Guarded(genuine)  # decoded into guarded buffers
    try:
        out = dc.decode(manifest, chunks, base, recycle=recycle.state)
        assert _same(out, want), f"{name}: a crafted chunk decoded to another state"
        outcome = "decoded the genuine state"
    except dc.DeltaError as exc:
        outcome = type(exc).__name__
    assert recycle.guards_intact(), f"{name}: decode wrote outside a tensor"
    assert _same(base, held_base), f"{name}: decode wrote into its base"
    if manifest["kind"] == "delta" and all(t["base_hash"] for t in manifest["tensors"]):
        held = Guarded(base)
        try:
            out = dc.apply_in_place(manifest, chunks, held.state)
            assert _same(out, want), f"{name}: a crafted chunk applied to another state"
        except dc.DeltaError:
            assert _same(held.state, held_base), f"{name}: a refused apply left the base changed"
        assert held.guards_intact(), f"{name}: apply in place wrote outside a tensor"
    return outcome


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_crafted_chunks_are_refused_never_written_out_of_bounds(case: int) -> None:
    name, base, enc = CASES[case]
    rng = np.random.default_rng(20_251_203 + case)
    outcomes: dict[str, int] = {}
    for trial in range(TRIALS):
        try:
            what = _try(name, base, enc, rng)
        except AssertionError:
            raise
        except Exception as exc:  # anything but a DeltaError is a decoder that was not ready
            raise AssertionError(f"{name} trial {trial}: {type(exc).__name__}: {exc}") from exc
        outcomes[what] = outcomes.get(what, 0) + 1
    refused = sum(v for k, v in outcomes.items() if k != "decoded the genuine state")
    assert refused >= 0.75 * TRIALS, outcomes  # nearly every crafted chunk is refused
    assert "ChunkCorrupt" in outcomes, outcomes

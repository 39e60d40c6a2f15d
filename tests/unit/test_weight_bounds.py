"""Bounds before allocation: a forged manifest or chunk (a huge zstd frame, a wrong shape, an
oversized shape) is refused from what it declares, before any array of its size is allocated or
any stream decompressed; and the rule that tells a follower a version can never be applied."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from rlstream.consumers.weights.routes import Link, refusal
from rlstream.schemas import deltacodec as codec
from rlstream.schemas.deltacodec.bits import digest
from rlstream.schemas.deltacodec.pieces import PLANES, ZSTD, Piece
from rlstream.schemas.deltacodec.wire import (
    MAX_RANGE_BYTES,
    Bounds,
    check_bounds,
    codec_manifest,
    manifest_record,
    pack_chunk,
    parse_chunk,
    tensor_table,
)

SHAPES = {"embed": (64, 32), "norm": (32,)}
GiB = 1 << 30


def _state(seed: int = 0) -> dict[str, codec.TensorBits]:
    rng = np.random.default_rng(seed)
    return {
        n: codec.TensorBits("bfloat16", s, rng.integers(0, 2**16, int(np.prod(s)), np.uint16))
        for n, s in SHAPES.items()
    }


def _record(enc: codec.Encoded) -> dict[str, Any]:
    return manifest_record(
        enc.manifest,
        run="r",
        model="policy",
        chunk_topic="rl.r.weights.chunks",
        keyframe_version=enc.manifest["version"],
        created_ms=1,
    )


def _zstd_header_claiming(size: int) -> bytes:
    """A zstd frame header declaring ``size`` content bytes (single segment, 8-byte size),
    followed by an empty last raw block: what a forger needs to claim a 32 GiB expansion."""
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, size) + b"\x01\x00\x00"


def _forged(seed_state: dict[str, codec.TensorBits], frame: bytes) -> tuple[Any, list[bytes]]:
    """A keyframe whose one chunk holds the norm tensor as a planes piece of ``frame``
    streams; manifest sizes and checksums are made to match (as a forger would)."""
    enc = codec.encode_keyframe(seed_state, version=1)
    n = int(np.prod(SHAPES["norm"]))
    names = sorted(SHAPES)
    piece = Piece(names.index("norm"), 0, n, PLANES, 0, n, ((ZSTD, frame), (ZSTD, frame)))
    pieces = [p for p in _pieces(enc) if p.tensor != piece.tensor] + [piece]
    chunk = pack_chunk(sorted(pieces, key=lambda p: p.tensor))
    manifest = dict(enc.manifest)
    manifest["chunks"] = [_listed(chunk)]
    manifest["encoded_bytes"] = len(chunk)
    manifest["tensors"] = [
        {**t, "pieces": [[0, piece.start, piece.stop, "planes", piece.nbytes]]}
        if t["name"] == "norm"
        else t
        for t in enc.manifest["tensors"]
    ]
    return manifest, [chunk]


def _listed(chunk: bytes) -> dict[str, Any]:
    return {"index": 0, "nbytes": len(chunk), "checksum": digest(chunk)}  # the codec's hash


def _pieces(enc: codec.Encoded) -> list[Piece]:
    return [p for c in enc.chunks for p in parse_chunk(c)]


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    with contextlib.suppress(codec.DeltaError):  # a refusal is what the callers expect
        fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_a_small_chunk_declaring_a_32_gib_frame_is_refused_before_decompression() -> None:
    manifest, chunks = _forged(_state(), _zstd_header_claiming(32 * GiB))
    assert len(chunks[0]) < 1 << 20
    with pytest.raises(codec.ChunkCorrupt, match="declares"):
        codec.decode(manifest, chunks)
    rec = {**_record(codec.encode_keyframe(_state(), version=1)), "chunks": manifest["chunks"]}
    rec["encoded_bytes"] = manifest["encoded_bytes"]
    with pytest.raises(codec.ChunkCorrupt, match="declares"):
        codec_manifest({**rec, "tensors": [{**t, "nbytes": 0} for t in rec["tensors"]]}, chunks)
    assert _peak_bytes(lambda: codec.decode(manifest, chunks)) < 8 << 20


def test_a_frame_that_hides_its_size_is_refused() -> None:
    no_size = _zstd_header_claiming(0)[:4] + b"\x00\x58" + b"\x01\x00\x00"  # FCS flag 0, window
    manifest, chunks = _forged(_state(), no_size)
    with pytest.raises(codec.ChunkCorrupt):
        codec.decode(manifest, chunks)


def test_an_honest_keyframe_and_delta_stay_within_their_bounds() -> None:
    v0, v1 = _state(0), _state(1)
    table = tensor_table(v0)
    for enc, base in (
        (codec.encode_keyframe(v0, version=0, max_chunk_bytes=2_000), None),
        (codec.encode_delta(v0, v1, version=1, base_version=0, max_chunk_bytes=2_000), v0),
    ):
        rec = _record(enc)
        check_bounds(rec, Bounds(table, max_state_bytes=1 << 20, max_chunk_bytes=2_000))
        out = codec.decode(codec_manifest(rec, enc.chunks), enc.chunks, base)
        assert codec.same_state(out, v0 if base is None else v1)


def test_a_wrong_shape_or_dtype_or_an_unknown_tensor_is_refused_against_the_table() -> None:
    table = tensor_table(_state())
    rec = _record(codec.encode_keyframe(_state(), version=1))
    reshaped = [{**t, "shape": [32, 64]} if t["name"] == "embed" else t for t in rec["tensors"]]
    with pytest.raises(codec.ManifestInvalid, match="the model's is"):
        check_bounds({**rec, "tensors": reshaped}, Bounds(table))
    retyped = [{**t, "dtype": "float32"} if t["name"] == "norm" else t for t in rec["tensors"]]
    with pytest.raises(codec.ManifestInvalid, match="the model's is"):
        check_bounds({**rec, "tensors": retyped}, Bounds(table))
    extra = [*rec["tensors"], {**rec["tensors"][0], "name": "extra"}]
    with pytest.raises(codec.ManifestInvalid, match="not one of the model's"):
        check_bounds({**rec, "tensors": extra}, Bounds(table))
    with pytest.raises(codec.ManifestInvalid, match="the model has 2"):
        check_bounds({**rec, "tensors": rec["tensors"][:1]}, Bounds(table))


def test_an_oversized_shape_is_refused_without_a_table_before_anything_is_allocated() -> None:
    rec = _record(codec.encode_keyframe(_state(), version=1))
    huge = [
        {**t, "shape": [1 << 20, 1 << 20]} if t["name"] == "embed" else t for t in rec["tensors"]
    ]
    forged = {**rec, "tensors": huge, "raw_bytes": 2 * (1 << 40) + 64}
    peak = _peak_bytes(lambda: _refuses(forged, Bounds(max_state_bytes=64 * GiB)))
    assert peak < 1 << 20
    with pytest.raises(codec.ManifestInvalid, match="more than"):
        check_bounds(forged, Bounds(max_state_bytes=64 * GiB))
    many_dims = [{**t, "shape": [1] * 9} if t["name"] == "norm" else t for t in rec["tensors"]]
    with pytest.raises(codec.ManifestInvalid, match="dims"):
        check_bounds({**rec, "tensors": many_dims}, Bounds())


def _refuses(rec: dict[str, Any], bounds: Bounds) -> None:
    with pytest.raises(codec.ManifestInvalid):
        check_bounds(rec, bounds)


def test_sizes_must_be_the_true_ones_and_chunks_within_the_topic_limit() -> None:
    rec = _record(codec.encode_keyframe(_state(), version=1))
    with pytest.raises(codec.ManifestInvalid, match="raw_bytes"):
        check_bounds({**rec, "raw_bytes": rec["raw_bytes"] + 2}, Bounds())
    with pytest.raises(codec.ManifestInvalid, match="encoded_bytes"):
        check_bounds({**rec, "encoded_bytes": rec["encoded_bytes"] + 1}, Bounds())
    big = [{**c, "nbytes": 64 << 20} for c in rec["chunks"]]
    with pytest.raises(codec.ManifestInvalid, match="a chunk of more than"):
        check_bounds({**rec, "chunks": big}, Bounds())


def test_a_piece_wider_than_a_range_is_refused() -> None:
    n = MAX_RANGE_BYTES // 2 + 8  # bf16 elements: one range's worth and a bit
    state = {"w": codec.TensorBits("bfloat16", (n,), np.zeros(n, np.uint16))}
    enc = codec.encode_keyframe(state, version=0)
    assert codec.same_state(codec.decode(enc.manifest, enc.chunks), state)  # honest: split
    wide = Piece(0, 0, n, PLANES, 0, n, ())
    chunk = pack_chunk([wide])
    manifest = {
        **enc.manifest,
        "chunks": [_listed(chunk)],
        "tensors": [{**enc.manifest["tensors"][0], "pieces": [[0, 0, n, "planes", wide.nbytes]]}],
        "encoded_bytes": len(chunk),
    }
    with pytest.raises(codec.ChunkCorrupt, match="larger than a range"):
        codec.decode(manifest, [chunk])


# --- which versions can never be applied -----------------------------------------------------


def test_a_version_is_refused_when_all_its_manifests_are_or_a_newer_one_is_known_alone() -> None:
    links = [Link(3, "delta", 2, 10), Link(4, "delta", 3, 10), Link(4, "keyframe", None, 99)]
    links += [Link(6, "delta", 5, 10)]
    bad = {(3, "delta"): "ManifestInvalid: wrong shape", (4, "delta"): "HashMismatch: x"}
    assert refusal(3, links, bad, 6, current=2) == "ManifestInvalid: wrong shape"
    assert refusal(4, links, bad, 6, current=2) is None  # its keyframe may still apply
    assert refusal(5, links, bad, 6, current=2) is not None  # never accepted, a newer one is
    assert refusal(6, links, bad, 6, current=4) is not None  # no 5: nothing leads to 6
    assert refusal(6, [*links, Link(5, "delta", 4, 10)], bad, 6, current=4) is None
    assert refusal(7, links, bad, 6, current=4) is None  # not published yet
    assert refusal(3, links, bad, 6, current=3) is None  # already there


def test_a_version_behind_a_broken_chain_is_refused() -> None:
    links = [Link(0, "keyframe", None, 99), *(Link(v, "delta", v - 1, 10) for v in range(1, 7))]
    bad = {(4, "delta"): "ChunkCorrupt: checksum"}
    assert refusal(3, links, bad, 6, current=2) is None
    why = refusal(6, links, bad, 6, current=2)
    assert why is not None and "no route reaches version 6" in why
    with_keyframe = [*links, Link(6, "keyframe", None, 99)]
    assert refusal(6, with_keyframe, bad, 6, current=2) is None

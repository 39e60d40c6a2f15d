"""Pure rules of sharded weight publishing (``producers.weights.shards``): the size-balanced
split by name, and that N ranks' encodings merged into one version decode bit-exactly through
the Avro mapping, with the same state hashes one publisher of the whole state records."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rlstream.producers.weights.shards import (
    ShardLayout,
    merge_shards,
    shard_names,
    shard_part,
    shard_ranges,
)
from rlstream.schemas import deltacodec as codec
from rlstream.schemas.deltacodec.wire import codec_manifest, manifest_record

CHUNK = 4096


def _state(seed: int, sizes: dict[str, int]) -> dict[str, codec.TensorBits]:
    rng = np.random.default_rng(seed)
    return {
        n: codec.TensorBits("bfloat16", (k,), rng.integers(0, 2**16, k, dtype=np.uint16))
        for n, k in sizes.items()
    }


def _step(state: dict[str, codec.TensorBits], seed: int) -> dict[str, codec.TensorBits]:
    rng = np.random.default_rng(seed)
    out = {}
    for n, t in state.items():
        bits = t.bits.copy()
        where = rng.integers(0, bits.size, max(1, bits.size // 50))
        bits[where] ^= 1
        out[n] = codec.TensorBits(t.dtype, t.shape, bits)
    return out


def test_ranges_are_contiguous_cover_everything_and_balance_bytes() -> None:
    sizes = [10, 10, 10, 10, 40, 10, 10]
    for ranks in (1, 2, 3, 4, 9):
        got = shard_ranges(sizes, ranks)
        assert len(got) == ranks and got[0][0] == 0 and got[-1][1] == len(sizes)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert shard_ranges(sizes, 2) == [(0, 4), (4, 7)]
    assert shard_ranges([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert shard_ranges([5], 3) == [(0, 0), (0, 1), (1, 1)]  # more ranks than tensors
    with pytest.raises(ValueError):
        shard_ranges(sizes, 0)


def _sharded(
    old: dict[str, codec.TensorBits] | None, new: dict[str, codec.TensorBits], ranks: int
) -> tuple[dict, list[bytes]]:
    encoded, firsts = [], []
    for r in range(ranks):
        names, first = shard_names(new, r, ranks)
        part = {n: new[n] for n in names}
        if old is None:
            encoded.append(codec.encode_keyframe(part, version=1, max_chunk_bytes=CHUNK))
        else:
            base = {n: old[n] for n in names}
            encoded.append(
                codec.encode_delta(base, part, version=1, base_version=0, max_chunk_bytes=CHUNK)
            )
        firsts.append(first)
    counts = [len(e.chunks) for e in encoded]
    parts = [
        shard_part(e, f, ShardLayout.of(counts, r))
        for r, (e, f) in enumerate(zip(encoded, firsts, strict=True))
    ]
    base_hash = None if old is None else codec.state_hash(old)
    merged = merge_shards(encoded[0].manifest, parts, base_hash)
    return merged, [c for p in parts for c in p["payloads"]]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_shards_merged_decode_bit_exact_with_the_whole_state_hashes(ranks: int) -> None:
    sizes = {f"layer.{i}.w": 3000 + 700 * i for i in range(6)} | {"emb": 9000, "norm": 64}
    old = _state(1, sizes)
    new = _step(old, 2)
    whole = codec.encode_delta(old, new, version=1, base_version=0, max_chunk_bytes=CHUNK)
    for base in (None, old):
        merged, chunks = _sharded(base, new, ranks)
        assert merged["state_hash"] == whole.manifest["state_hash"] == codec.state_hash(new)
        if base is not None:
            assert merged["base_state_hash"] == whole.manifest["base_state_hash"]
        # through the Avro record and back, as a subscriber sees it
        rec = manifest_record(
            merged, run="r", model="m", chunk_topic="t", keyframe_version=0, created_ms=0
        )
        rebuilt = codec_manifest(rec, chunks)
        decoded = codec.decode(rebuilt, chunks, base)
        assert codec.same_state(decoded, new)


def test_a_shard_chunk_with_its_tensor_index_unshifted_is_refused() -> None:
    """The renumbering matters: rank 1's chunks as its own encoder wrote them do not decode."""
    new = _state(3, {"a": 5000, "b": 5000})
    merged, chunks = _sharded(None, new, 2)
    names, first = shard_names(new, 1, 2)
    raw = codec.encode_keyframe({n: new[n] for n in names}, version=1, max_chunk_bytes=CHUNK)
    assert first == 1 and raw.chunks
    bad = chunks[: len(chunks) - len(raw.chunks)] + raw.chunks
    merged["chunks"][-1]["checksum"] = codec.encode_keyframe(
        {n: new[n] for n in names}, version=1, max_chunk_bytes=CHUNK
    ).manifest["chunks"][-1]["checksum"]
    with pytest.raises(codec.DeltaError):
        codec.decode(merged, bad)

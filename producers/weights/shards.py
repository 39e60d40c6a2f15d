"""Sharded weight publishing: which rank encodes which tensors, and how the ranks' encodings
become one version.

A learner of N ranks publishes a version in parallel: each rank encodes the delta (or keyframe)
of its own *shard* of the published state and writes its chunks with its own producer; rank 0
gathers every rank's chunk refs and writes the one manifest naming them all
(``producers.weights.publisher``). The manifest and the chunks are exactly the wire format a single
publisher writes (``schemas.deltacodec.wire``), so subscribers need not know how many ranks
published. The rules that make that true (pure, unit-tested):

- shards (``shard_ranges``): the tensor names sorted (the codec's order) are cut into N
  contiguous ranges of about equal bytes; rank ``r`` encodes range ``r``. Deterministic from
  the names and sizes alone, so every rank computes the same split without talking. Contiguous
  ranges keep the wire format's rule that the concatenated chunks hold the tensors in name
  order (``deltacodec.wire.tensor_spans``).
- numbering (``ShardLayout``): a version's chunks are numbered rank after rank (rank 0's chunks
  first), per kind; a piece names its tensor by its index among ALL the state's tensors
  (``retensor``: a rank's encoder numbered its shard from 0, so its pieces are shifted by the
  shard's first index, and the chunk checksum recomputed).
- merge (``merge_shards``): the version's codec manifest is the ranks' manifests concatenated
  in rank order (tensors, chunks), with sizes summed and the state hashes recomputed from the
  tensor hashes by the codec's own rule (``deltacodec.bits.state_hash``, of the manifest's hash algorithm): identical to what
  one publisher encoding the whole state would record.

numpy only: importing this module never loads torch or Kafka.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlstream.schemas.deltacodec import Encoded, TensorBits
from rlstream.schemas.deltacodec.bits import digest, rows_hash
from rlstream.schemas.deltacodec.manifest import hash_algorithm
from rlstream.schemas.deltacodec.pieces import PIECE_HEADER
from rlstream.schemas.deltacodec.wire import CHUNK_HEADER, parse_chunk


class PublishingRanks(Protocol):
    """The ranks publishing together (``trainer.distributed`` implements it on
    torch.distributed): this one's rank, their number, and an all-gather of small objects that
    every rank calls in the same order."""

    rank: int
    world: int

    def all_gather(self, obj: Any) -> list[Any]: ...


def shard_ranges(sizes: Sequence[int], ranks: int) -> list[tuple[int, int]]:
    """``ranks`` contiguous ``[lo, hi)`` ranges over tensors of ``sizes`` (in name order).

    Rule: range ``r`` ends at the cut (a position between tensors, not before where range
    ``r - 1`` ended) whose bytes before it are nearest ``r + 1`` N-ths of the total, the earlier
    cut on a tie; the last range ends after the last tensor. A range may be empty (more ranks
    than tensors, or one tensor larger than a share)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    before = [0]  # bytes before each cut
    for size in sizes:
        before.append(before[-1] + int(size))
    bounds, lo = [], 0
    for r in range(ranks):
        if r == ranks - 1:
            hi = len(sizes)
        else:
            target = before[-1] * (r + 1) / ranks
            j = max(lo, min(len(sizes), bisect.bisect_left(before, target)))
            below = max(lo, j - 1)
            hi = below if target - before[below] <= before[j] - target else j
        bounds.append((lo, hi))
        lo = hi
    return bounds


def shard_names(state: Mapping[str, TensorBits], rank: int, ranks: int) -> tuple[list[str], int]:
    """The names rank ``rank`` of ``ranks`` encodes (sorted) and the global index of the first."""
    names = sorted(state)
    lo, hi = shard_ranges([state[n].nbytes for n in names], ranks)[rank]
    return names[lo:hi], lo


def retensor(payload: bytes, shift: int) -> bytes:
    """``payload`` (one chunk) with every piece's tensor index raised by ``shift``."""
    if shift == 0:
        return payload
    out = bytearray(payload)
    at = CHUNK_HEADER.size
    for piece in parse_chunk(payload):
        PIECE_HEADER.pack_into(
            out,
            at,
            piece.tensor + shift,
            piece.start,
            piece.stop,
            piece.encoding,
            len(piece.streams),
            piece.aux,
            piece.count,
        )
        at += piece.nbytes
    return bytes(out)


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's chunks of one kind go among the version's: global index of its first
    chunk, and the version's chunk count of that kind."""

    first: int
    total: int

    @classmethod
    def of(cls, counts: Sequence[int], rank: int) -> ShardLayout:
        """From every rank's chunk count (in rank order)."""
        return cls(sum(counts[:rank]), sum(counts))


def shard_part(encoded: Encoded, first_tensor: int, layout: ShardLayout) -> dict[str, Any]:
    """One rank's encoding, renumbered into the version: ``{"tensors", "chunks", "payloads",
    "raw_bytes", "encoded_bytes"}`` with global tensor (``retensor``) and chunk indices."""
    payloads = [retensor(c, first_tensor) for c in encoded.chunks]
    m = encoded.manifest
    tensors = [
        {**t, "pieces": [[p[0] + layout.first, *p[1:]] for p in t["pieces"]]} for t in m["tensors"]
    ]
    chunks = [
        {
            "index": layout.first + i,
            "nbytes": len(c),
            "checksum": digest(c, hash_algorithm(m))
            if first_tensor
            else m["chunks"][i]["checksum"],
        }
        for i, c in enumerate(payloads)
    ]
    return {
        "tensors": tensors,
        "chunks": chunks,
        "payloads": payloads,
        "raw_bytes": m["raw_bytes"],
        "encoded_bytes": m["encoded_bytes"],
    }


def _hash_of(tensors: Sequence[Mapping[str, Any]], field: str, algorithm: str) -> str:
    """The state hash (``deltacodec.bits.state_hash``'s rule) of the tensors' ``field`` hashes."""
    return rows_hash(
        [[t["name"], t["dtype"], list(t["shape"]), t[field]] for t in tensors], algorithm
    )


def merge_shards(
    head: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], base_state_hash: str | None
) -> dict[str, Any]:
    """The version's codec manifest from the ranks' ``shard_part``s (without payloads), in rank
    order. ``head`` is any rank's manifest (format, version, base_version, kind,
    max_chunk_bytes); ``base_state_hash`` the whole base state's hash (None for a keyframe)."""
    tensors = [t for p in parts for t in p["tensors"]]
    chunks = [c for p in parts for c in p["chunks"]]
    if [c["index"] for c in chunks] != list(range(len(chunks))):
        raise ValueError("the ranks' chunks do not number 0..n-1 in rank order")
    names = [t["name"] for t in tensors]
    if names != sorted(names):
        raise ValueError("the ranks' tensors are not in name order")
    keys = ("format", "version", "base_version", "kind", "max_chunk_bytes", "hash_algorithm")
    return {
        **{k: head[k] for k in keys},
        "tensors": tensors,
        "chunks": chunks,
        "state_hash": _hash_of(tensors, "hash", hash_algorithm(head)),
        "base_state_hash": base_state_hash if head["kind"] == "delta" else None,
        "raw_bytes": sum(p["raw_bytes"] for p in parts),
        "encoded_bytes": sum(p["encoded_bytes"] for p in parts),
    }

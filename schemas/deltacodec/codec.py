"""Lossless, chunked, verified weight deltas and keyframes between policy versions.

After each RL step the learner ships the new weights as a *delta* against the previous version
(only the elements whose bit patterns changed) or as a *keyframe* (a full snapshot). An encoded
version is a JSON-serialisable manifest plus chunk payloads, laid out by ``deltacodec.wire``.

Guarantees a maintainer must keep:
- bit-exact: values are bit patterns (``TensorBits``), never interpreted as numbers;
- bounded chunks (at most ``max_chunk_bytes``) of whole pieces, each decodable alone;
- verified: checksums and hashes for every chunk, tensor and state; ``decode`` raises a
  ``DeltaError`` subclass on the first failure;
- never partial: ``decode`` builds new arrays and never writes its base; ``apply_in_place``
  checks all it can first and puts back every written element on a later failure;
- deterministic: byte-identical output whatever the number of ``workers``.

Details: docs/delta-codec.md (The codec).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import zstandard

from .bits import (
    DEFAULT_HASH,
    LEGACY_HASH,
    TensorBits,
    as_bytes,
    digest,
    hasher,
    state_hash,
)
from .direct import ChangesMismatch
from .encodings import SELF_CHECKED, decode_piece, encode_best
from .exponent import EXPONENT_FIELDS
from .manifest import (
    FORMAT,
    BaseMismatch,
    ChunkCorrupt,
    DeltaError,
    HashMismatch,
    MissingChunk,
    hash_algorithm,
    validate_manifest,
    verify_chunk,
)
from .memory import DEFAULT_WORKERS, PerThread, Spans, each, output_array, writable_views
from .pieces import ENCODINGS, UNCHANGED, ZSTD_LEVEL, Changes, Piece, Undo, find_changes, undo_all
from .wire import (
    CHUNK_HEADER,
    MAX_RANGE_BYTES,
    check_piece,
    pack_chunk,
    parse_chunk,
    piece_entry,
    tensor_entry,
)

DEFAULT_MAX_CHUNK_BYTES: Final = 900_000
#: Smallest chunk limit accepted: one element stored raw must always fit in a chunk.
MIN_CHUNK_BYTES: Final = 256


@dataclass(frozen=True)
class Encoded:
    """One encoded version: the manifest (plain JSON-serialisable dict) and chunk payloads."""

    manifest: dict[str, Any]
    chunks: list[bytes]

    @property
    def ratio(self) -> float:
        """Raw bytes of the new weights per encoded chunk byte."""
        return self.manifest["raw_bytes"] / max(1, self.manifest["encoded_bytes"])


# --- encoding ---------------------------------------------------------------------------


def encode_delta(
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    *,
    version: int,
    base_version: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    hash_algorithm: str = DEFAULT_HASH,
    workers: int = DEFAULT_WORKERS,
    fast_apply: bool = False,
) -> Encoded:
    """Encode ``new`` as a delta against ``old`` (the state of ``base_version``).

    Per tensor of ``new``: a tensor of ``old`` with the same name, dtype and shape is its base
    and only changed bit patterns are encoded; otherwise the tensor is sent whole. Tensors of
    ``old`` absent from ``new`` are absent from the decoded state. Every hash is of
    ``hash_algorithm`` (``deltacodec.bits``; another than the default only to write what older
    code wrote). ``workers``: threads over tensors; the output does not depend on it.
    ``fast_apply``: float tensors' changes coded ``direct`` (``deltacodec.direct``): larger,
    but applied in place at a cost that follows the change and checked without hashing
    (``apply_in_place(check="changes")``)."""
    return _encode(
        old, new, version, int(base_version), max_chunk_bytes, hash_algorithm, workers, fast_apply
    )


def encode_keyframe(
    state: Mapping[str, TensorBits],
    *,
    version: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    hash_algorithm: str = DEFAULT_HASH,
    workers: int = DEFAULT_WORKERS,
) -> Encoded:
    """Encode a full snapshot (no base): byte planes + zstd, same chunking and hashes."""
    return _encode(None, state, version, None, max_chunk_bytes, hash_algorithm, workers, False)


def _encode(
    old: Mapping[str, TensorBits] | None,
    new: Mapping[str, TensorBits],
    version: int,
    base_version: int | None,
    limit: int,
    algorithm: str,
    workers: int,
    fast_apply: bool,
) -> Encoded:
    hasher(algorithm)  # an unknown algorithm fails before anything is encoded
    if limit < MIN_CHUNK_BYTES:
        raise ValueError(f"max_chunk_bytes must be >= {MIN_CHUNK_BYTES}, got {limit}")
    cctx = PerThread(
        lambda: zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False, threads=0)
    )
    budget = limit - CHUNK_HEADER.size
    names = sorted(new)

    def one(i: int) -> tuple[list[Piece], int, TensorBits | None]:
        name = names[i]
        base = old.get(name) if old is not None else None
        if base is not None and (base.dtype, base.shape) != (new[name].dtype, new[name].shape):
            base = None
        pieces, changed = _encode_tensor(
            i, base, new[name], budget, cctx.get(), algorithm, fast_apply
        )
        return pieces, changed, base

    per_tensor = each(one, range(len(names)), workers)
    groups = _group_into_chunks([p for pieces, _, _ in per_tensor for p in pieces], limit)
    chunks = [pack_chunk(g) for g in groups]
    where = {(p.tensor, p.start): c for c, g in enumerate(groups) for p in g}
    entries = [
        _entry_of(name, new[name], base, pieces, changed, where, algorithm)
        for name, (pieces, changed, base) in zip(names, per_tensor, strict=True)
    ]
    head: dict[str, Any] = {
        "version": int(version),
        "base_version": base_version,
        "max_chunk_bytes": limit,
    }
    if algorithm != LEGACY_HASH:  # named; a legacy manifest is byte for byte what old code wrote
        head["hash_algorithm"] = algorithm
    return Encoded(_manifest(head, entries, chunks, old, new), chunks)


def _manifest(
    head: dict[str, Any],
    entries: list[dict[str, Any]],
    chunks: list[bytes],
    old: Mapping[str, TensorBits] | None,
    new: Mapping[str, TensorBits],
) -> dict[str, Any]:
    algorithm = hash_algorithm(head)
    return {
        "format": FORMAT,
        **head,
        "kind": "keyframe" if old is None else "delta",
        "tensors": entries,
        "chunks": [
            {"index": i, "nbytes": len(c), "checksum": digest(c, algorithm)}
            for i, c in enumerate(chunks)
        ],
        "state_hash": state_hash(new, algorithm),
        "base_state_hash": None if old is None else state_hash(old, algorithm),
        "raw_bytes": sum(t.nbytes for t in new.values()),
        "encoded_bytes": sum(len(c) for c in chunks),
    }


def _encode_tensor(
    index: int,
    base: TensorBits | None,
    tensor: TensorBits,
    budget: int,
    cctx: zstandard.ZstdCompressor,
    algorithm: str,
    fast_apply: bool,
) -> tuple[list[Piece], int]:
    """Pieces of one tensor, each at most ``budget`` bytes, and its changed-element count.
    Both hashes are computed on the way (in the same pass as the comparison)."""
    old_h = hasher(algorithm) if base is not None and not base.knows(algorithm) else None
    new_h = None if tensor.knows(algorithm) else hasher(algorithm)
    n, width = tensor.numel, tensor.width
    field = EXPONENT_FIELDS.get(tensor.dtype)
    coding = (field, fast_apply)
    # Range size follows the last ratio seen so that a piece roughly fills a chunk.
    # Ranges of at most MAX_RANGE_BYTES raw bytes bound the encoder's temporary memory (changed
    # positions are int64) and let a decoder refuse a piece claiming more (check_piece).
    ratio = float(MAX_RANGE_BYTES) if base is not None else 1.0
    pieces: list[Piece] = []
    changed, lo = 0, 0
    while lo < n:
        step = max(8, int(0.95 * budget * ratio) // width // 8 * 8)
        hi = min(n, lo + min(step, MAX_RANGE_BYTES // width))
        new_r = tensor.bits[lo:hi]
        old_r = base.bits[lo:hi] if base is not None else None
        if old_r is None:
            if new_h is not None:
                new_h.update(as_bytes(new_r))
            ch, changed = None, changed + (hi - lo)
        else:
            ch = find_changes(old_r, new_r, old_h, new_h)
            changed += int(ch.pos.size)
        made = _fit(index, lo, old_r, new_r, ch, budget, cctx, coding)
        ratio = new_r.nbytes / max(1, sum(p.nbytes for p in made))
        pieces += made
        lo = hi
    if old_h is not None and base is not None:
        base.remember_hash(old_h.hexdigest(), algorithm)
    if new_h is not None:
        tensor.remember_hash(new_h.hexdigest(), algorithm)
    return _merge_unchanged(pieces), changed


def _fit(
    index: int,
    start: int,
    old: np.ndarray | None,
    new: np.ndarray,
    ch: Changes | None,
    budget: int,
    cctx: zstandard.ZstdCompressor,
    coding: tuple[tuple[int, int] | None, bool],
) -> list[Piece]:
    """Encode a range (``coding``: the exponent field and ``fast_apply``); split it and retry
    until every piece fits ``budget`` (terminates: a one-element raw piece always fits, as
    ``budget >= MIN_CHUNK_BYTES - header``)."""
    piece = encode_best(index, start, old, new, ch, cctx, *coding)
    if piece.nbytes <= budget:
        return [piece]
    n = new.size
    parts = min(n, max(2, math.ceil(piece.nbytes / (0.85 * budget))))
    cuts = [n * j // parts for j in range(parts + 1)]
    if n >= 16 * parts:  # keep ranges 8-element aligned so 8-byte word views stay aligned
        cuts = [c // 8 * 8 for c in cuts[:-1]] + [n]
    out: list[Piece] = []
    for a, b in itertools.pairwise(cuts):
        if a < b:
            sub = ch.window(a, b) if ch is not None else None
            old_s = old[a:b] if old is not None else None
            out += _fit(index, start + a, old_s, new[a:b], sub, budget, cctx, coding)
    return out


def _merge_unchanged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent ``unchanged`` pieces of a tensor become one (they carry no data)."""
    out: list[Piece] = []
    for p in pieces:
        if out and p.encoding == UNCHANGED == out[-1].encoding:
            last = out.pop()
            p = Piece(p.tensor, last.start, p.stop, UNCHANGED, 0, 0, ())
        out.append(p)
    return out


def _group_into_chunks(pieces: list[Piece], limit: int) -> list[list[Piece]]:
    """Greedy, order-preserving: start a new chunk when the next piece would overflow."""
    groups: list[list[Piece]] = []
    size = limit + 1
    for p in pieces:
        if size + p.nbytes > limit:
            groups.append([])
            size = CHUNK_HEADER.size
        groups[-1].append(p)
        size += p.nbytes
    return groups


def _entry_of(
    name: str,
    tensor: TensorBits,
    base: TensorBits | None,
    pieces: list[Piece],
    changed: int,
    where: dict[tuple[int, int], int],
    algorithm: str,
) -> dict[str, Any]:
    return tensor_entry(
        name,
        tensor.dtype,
        tensor.shape,
        changed=changed,
        hash=tensor.hash_of(algorithm),
        base_hash=None if base is None else base.hash_of(algorithm),
        pieces=[piece_entry(where[(p.tensor, p.start)], p) for p in pieces],
    )


# --- decoding ---------------------------------------------------------------------------


def decode(
    manifest: Mapping[str, Any],
    chunks: Sequence[bytes | None],
    base: Mapping[str, TensorBits] | None = None,
    *,
    recycle: Mapping[str, TensorBits] | None = None,
    workers: int = DEFAULT_WORKERS,
) -> dict[str, TensorBits]:
    """Decode and verify one version; returns the complete new state or raises.

    Checks, in order: manifest structure (``ManifestInvalid``); chunk count (``MissingChunk``,
    also for a None entry); each chunk's size, checksum and pieces against the manifest, and
    each piece's declared sizes against its range (``ChunkCorrupt``), before any tensor is
    allocated or any stream decompressed; for a delta, the base's tensors, tensor hashes and state hash
    (``BaseMismatch``); every decoded tensor's hash and the state hash (``HashMismatch``).
    A keyframe ignores ``base``. Base hashes already cached on the ``TensorBits`` are reused;
    missing ones are computed while the base is read, and cached.

    ``recycle`` (optional) is a state the caller gives up, typically the version before
    ``base`` in a double-buffered worker: its tensors of matching dtype and shape, when their
    memory is writable and disjoint from ``base``, are overwritten with the new state instead
    of allocating (fresh pages cost more than the decode itself). It is consumed even when
    decoding fails: do not use it afterwards. ``workers``: threads over tensors."""
    pieces = _checked_pieces(manifest, chunks)
    bases = _match_base(manifest, base)
    algorithm = hash_algorithm(manifest)
    dctx = PerThread(zstandard.ZstdDecompressor)
    taken = Spans(base.values() if base is not None else ())
    entries = manifest["tensors"]
    outputs = [output_array(e, recycle.get(e["name"]) if recycle else None, taken) for e in entries]

    def one(i: int) -> TensorBits:
        e = entries[i]
        return _decode_tensor(e, pieces[i], bases.get(e["name"]), outputs[i], dctx.get(), algorithm)

    decoded = each(one, range(len(entries)), workers)
    out = {e["name"]: t for e, t in zip(entries, decoded, strict=True)}
    if (
        base is not None
        and manifest["kind"] == "delta"
        and (state_hash(base, algorithm) != manifest["base_state_hash"])
    ):
        raise BaseMismatch("base state hash differs from the delta's base_state_hash")
    if state_hash(out, algorithm) != manifest["state_hash"]:
        raise HashMismatch("decoded state hash differs from the manifest")
    return out


def apply_in_place(
    manifest: Mapping[str, Any],
    chunks: Sequence[bytes | None],
    state: Mapping[str, TensorBits],
    keep: Mapping[str, TensorBits] | None = None,
    workers: int = DEFAULT_WORKERS,
    check: str = "full",
) -> dict[str, TensorBits]:
    """Apply a delta onto the memory of ``state`` (its base) and return the new state, over
    that same memory: nothing tensor-sized is allocated, and only changed elements are
    written (each tensor is read once more, to hash it, unless ``check`` says otherwise).

    Checked before anything is written, as ``decode`` does: the manifest, the chunks (sizes,
    checksums, pieces), each base tensor's hash and the base state hash (base hashes not yet
    cached are computed, a read pass). Refused with ``ValueError``, nothing written, when
    the delta cannot be applied in place: a keyframe, a tensor without base or of another
    dtype or shape, a tensor of ``state`` the delta drops, tensors sharing memory (with each
    other or with ``keep``, a state the caller still uses), memory that cannot be written.
    After the first write, any failure (``ChunkCorrupt``, ``BaseMismatch``,
    ``HashMismatch``) puts every written element back, so ``state`` holds the base again bit
    for bit, and raises. On success the ``TensorBits`` of ``state`` no longer describe their
    memory (their cached hashes are dropped): use the returned state. ``workers``: threads
    over tensors, each with its own record of what it wrote; all have stopped before
    anything is put back.

    ``check``: "full" (the default) verifies as above: every tensor's hash before and after,
    and both state hashes, so the result is the encoder's state bit for bit. "changes"
    verifies a tensor whose pieces all check themselves (``direct`` pieces, written with
    ``encode_delta(fast_apply=True)``, and ``unchanged`` ones) by those pieces alone, and
    reads nothing else of it: every chunk's checksum (the bytes are the encoder's) and each
    piece's checksum of its changes (every element written had the encoder's base bits and
    now has its new bits; else ``BaseMismatch``, everything put back). What that does not see
    is a base element the delta leaves alone that differs from the encoder's: the next "full"
    check refuses that base (``BaseMismatch``, before any write), so a caller that runs one
    every K versions learns of such a difference at most K versions late. Tensors with other
    pieces are hashed as under "full"; the state hashes are checked only when no tensor was
    spared its hash, and the spared tensors come back without a cached hash."""
    pieces = _checked_pieces(manifest, chunks)
    entries = manifest["tensors"]
    if manifest["kind"] != "delta" or any(e["base_hash"] is None for e in entries):
        raise ValueError("only a delta with a base for every tensor is applied in place")
    if {e["name"] for e in entries} != set(state):
        raise ValueError("the delta does not name exactly the state's tensors")
    if check not in ("full", "changes"):
        raise ValueError(f"check is 'full' or 'changes', not {check!r}")
    bases = _match_base(manifest, state)
    algorithm = hash_algorithm(manifest)
    spared = [check == "changes" and all(p.encoding in SELF_CHECKED for p in ps) for ps in pieces]
    hashed = [e for e, skip in zip(entries, spared, strict=True) if not skip]
    base_hashes = each(lambda e: bases[e["name"]].hash_of(algorithm), hashed, workers)
    for e, h in zip(hashed, base_hashes, strict=True):
        if h != e["base_hash"]:
            raise BaseMismatch(f"base tensor {e['name']!r} differs from the delta's base")
    whole = not any(spared)
    if whole and state_hash(state, algorithm) != manifest["base_state_hash"]:
        raise BaseMismatch("base state hash differs from the delta's base_state_hash")
    views = writable_views(state, keep or {})
    dctx = PerThread(zstandard.ZstdDecompressor)
    undos: list[Undo] = [[] for _ in entries]

    def one(i: int) -> TensorBits:
        e, bits = entries[i], views[entries[i]["name"]]
        return _decode_tensor(
            e, pieces[i], None, bits, dctx.get(), algorithm, undos[i], not spared[i]
        )

    try:
        applied = each(one, range(len(entries)), workers)
        out = {e["name"]: t for e, t in zip(entries, applied, strict=True)}
        if whole and state_hash(out, algorithm) != manifest["state_hash"]:
            raise HashMismatch("decoded state hash differs from the manifest")
    except DeltaError:
        for undo in undos:
            undo_all(undo)
        raise
    for t in state.values():
        t.forget_hash()
    return out


def _checked_pieces(
    manifest: Mapping[str, Any], chunks: Sequence[bytes | None]
) -> list[list[Piece]]:
    """The manifest validated, the chunk count checked, then ``_read_pieces``."""
    validate_manifest(manifest)
    if len(chunks) < len(manifest["chunks"]) or any(c is None for c in chunks):
        raise MissingChunk(f"need {len(manifest['chunks'])} chunks, got {_present(chunks)}")
    if len(chunks) > len(manifest["chunks"]):
        raise ChunkCorrupt(f"{len(chunks)} chunks given, manifest lists {len(manifest['chunks'])}")
    return _read_pieces(manifest, [c for c in chunks if c is not None])


def _present(chunks: Sequence[bytes | None]) -> int:
    return sum(c is not None for c in chunks)


def _read_pieces(manifest: Mapping[str, Any], chunks: Sequence[bytes]) -> list[list[Piece]]:
    """All pieces, per tensor in start order, after checking chunks against the manifest."""
    tensors = manifest["tensors"]
    listed = {
        (t, start): (c, stop, enc)
        for t, entry in enumerate(tensors)
        for c, start, stop, enc, _ in entry["pieces"]
    }
    found: list[list[Piece]] = [[] for _ in tensors]
    for index, payload in enumerate(chunks):
        verify_chunk(manifest, index, payload)
        try:
            for p in parse_chunk(payload):
                want = listed.pop((p.tensor, p.start), None)
                if want != (index, p.stop, ENCODINGS[p.encoding]):
                    raise ValueError(f"piece {p.tensor}:{p.start} is not in the manifest")
                check_piece(p, tensors[p.tensor]["dtype"], tensors[p.tensor]["shape"])
                found[p.tensor].append(p)
        except ValueError as exc:
            raise ChunkCorrupt(f"chunk {index}: {exc}") from exc
    if listed:
        (t, start), (c, _, _) = next(iter(listed.items()))
        raise ChunkCorrupt(f"chunk {c} lacks piece {start} of {tensors[t]['name']!r}")
    return [sorted(ps, key=lambda p: p.start) for ps in found]


def _match_base(
    manifest: Mapping[str, Any], base: Mapping[str, TensorBits] | None
) -> dict[str, TensorBits]:
    """The base tensor of each entry that has one; fails fast on anything already known."""
    if manifest["kind"] == "keyframe":
        return {}
    algorithm = hash_algorithm(manifest)
    if base is None:
        raise BaseMismatch(f"a delta needs the state of version {manifest['base_version']}")
    out: dict[str, TensorBits] = {}
    for entry in manifest["tensors"]:
        if entry["base_hash"] is None:
            continue
        t = base.get(entry["name"])
        if t is None or t.dtype != entry["dtype"] or list(t.shape) != entry["shape"]:
            raise BaseMismatch(f"base lacks {entry['name']!r} as {entry['dtype']}{entry['shape']}")
        if t.knows(algorithm) and t.hash_of(algorithm) != entry["base_hash"]:
            raise BaseMismatch(f"base tensor {entry['name']!r} differs from the delta's base")
        out[entry["name"]] = t
    if all(t.knows(algorithm) for t in base.values()) and (
        state_hash(base, algorithm) != manifest["base_state_hash"]
    ):
        raise BaseMismatch("base state hash differs from the delta's base_state_hash")
    return out


def _decode_tensor(
    entry: Mapping[str, Any],
    pieces: list[Piece],
    base: TensorBits | None,
    bits: np.ndarray,
    dctx: zstandard.ZstdDecompressor,
    algorithm: str,
    undo: Undo | None = None,
    verify: bool = True,
) -> TensorBits:
    """Decode one tensor into ``bits``, hashing base and result piece by piece; with
    ``undo`` (and no ``base``), ``bits`` holds the verified base and is patched in place.
    Without ``verify`` (pieces that check themselves) the result is not hashed."""
    name, shape = entry["name"], tuple(entry["shape"])
    n = bits.size
    old_h = hasher(algorithm) if base is not None and not base.knows(algorithm) else None
    new_h = hasher(algorithm) if verify else None
    covered = 0
    for p in pieces:
        if p.start != covered or p.stop > n:
            raise ChunkCorrupt(f"{name!r}: pieces do not tile 0..{n} (at {p.start})")
        out_r = bits[p.start : p.stop]
        base_r = base.bits[p.start : p.stop] if base is not None else None
        try:
            if undo is None:
                decode_piece(p, base_r, out_r, dctx, old_h, new_h)
            else:
                decode_piece(p, out_r, out_r, dctx, None, new_h, undo)
        except ChangesMismatch as exc:
            raise BaseMismatch(f"{name!r} elements {p.start}..{p.stop}: {exc}") from exc
        except ValueError as exc:
            raise ChunkCorrupt(f"{name!r} elements {p.start}..{p.stop}: {exc}") from exc
        covered = p.stop
    if covered != n:
        raise ChunkCorrupt(f"{name!r}: pieces cover {covered} of {n} elements")
    if base is not None:
        if old_h is not None:
            base.remember_hash(old_h.hexdigest(), algorithm)
        if base.hash_of(algorithm) != entry["base_hash"]:
            raise BaseMismatch(f"base tensor {name!r} differs from the delta's base")
    out = TensorBits(entry["dtype"], shape, bits)
    if new_h is not None:
        if new_h.hexdigest() != entry["hash"]:
            raise HashMismatch(f"decoded {name!r} does not match its hash")
        out.remember_hash(entry["hash"], algorithm)
    return out

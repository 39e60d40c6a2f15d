"""The weight manifest's format rules, its validation, and the codec's errors.

A manifest arrives from Kafka as JSON: before anything indexes into it, ``validate_manifest``
checks its structure, and ``verify_chunk`` checks a chunk payload against it (size and
checksum). Every hash of a manifest (chunk checksums, tensor and state hashes) is of the
algorithm it names in ``hash_algorithm`` (``deltacodec.bits``: ``blake3`` now; a manifest
without the field is of ``xxh3_128``, as every manifest written before it). Every failure is a ``DeltaError`` subclass naming what is wrong, so a
consumer can log it and keep serving the version it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ..errors import RlstreamError
from .bits import DTYPE_WIDTHS, HASH_ALGORITHMS, LEGACY_HASH, digest
from .pieces import ENCODINGS

#: Format tag of manifests written by this codec.
FORMAT: Final = "rlstream.weights/1"


class DeltaError(RlstreamError):
    """A version could not be decoded or verified; nothing was applied."""


class ManifestInvalid(DeltaError):
    """The manifest is malformed or of an unknown format."""


class MissingChunk(DeltaError):
    """Fewer chunks than the manifest lists (or a missing entry)."""


class ChunkCorrupt(DeltaError):
    """A chunk's size, checksum or contents disagree with the manifest."""


class BaseMismatch(DeltaError):
    """The base state is not the one the delta was computed against."""


class HashMismatch(DeltaError):
    """A decoded tensor or the decoded state does not hash to the manifest's value."""


def hash_algorithm(manifest: Mapping[str, Any]) -> str:
    """The hash algorithm a manifest's hashes are of (``LEGACY_HASH`` when it names none)."""
    return str(manifest.get("hash_algorithm") or LEGACY_HASH)


def verify_chunk(manifest: Mapping[str, Any], index: int, payload: bytes) -> None:
    """Raise ``ChunkCorrupt`` unless ``payload`` is chunk ``index`` of ``manifest`` (size and
    checksum of the manifest's hash algorithm). Consumers can call it as chunks arrive."""
    chunks = manifest.get("chunks") or []
    if not 0 <= index < len(chunks):
        raise ChunkCorrupt(f"chunk {index} is not listed in the manifest ({len(chunks)} chunks)")
    want = chunks[index]
    if len(payload) != want["nbytes"]:
        raise ChunkCorrupt(f"chunk {index}: {len(payload)} bytes, manifest says {want['nbytes']}")
    if digest(payload, hash_algorithm(manifest)) != want["checksum"]:
        raise ChunkCorrupt(f"chunk {index}: checksum mismatch")


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ManifestInvalid(what)


def validate_manifest(m: Mapping[str, Any]) -> None:
    """Structure checks so that later code can index the manifest without surprises."""
    _need(isinstance(m, Mapping) and m.get("format") == FORMAT, f"format is not {FORMAT}")
    _need(m.get("kind") in ("delta", "keyframe"), "kind must be delta or keyframe")
    _need(hash_algorithm(m) in HASH_ALGORITHMS, f"unknown hash algorithm {hash_algorithm(m)!r}")
    _need(isinstance(m.get("version"), int), "version must be an int")
    delta = m["kind"] == "delta"
    _need(not delta or isinstance(m.get("base_version"), int), "delta without base_version")
    _need(isinstance(m.get("state_hash"), str), "state_hash missing")
    _need(not delta or isinstance(m.get("base_state_hash"), str), "delta without base hash")
    sizes = [m.get(k) for k in ("raw_bytes", "encoded_bytes", "max_chunk_bytes")]
    _need(all(isinstance(c, int) for c in sizes), "raw_bytes/encoded_bytes/max_chunk_bytes")
    chunks, tensors = m.get("chunks"), m.get("tensors")
    if not isinstance(chunks, list) or not isinstance(tensors, list):
        raise ManifestInvalid("chunks and tensors must be lists")
    for i, c in enumerate(chunks):
        _need(isinstance(c, Mapping) and c.get("index") == i, f"chunk entry {i} malformed")
        _need(isinstance(c.get("nbytes"), int) and isinstance(c.get("checksum"), str), "chunk")
    seen: set[str] = set()
    for t in tensors:
        _need(isinstance(t, Mapping) and isinstance(t.get("name"), str), "tensor entry")
        _need(t["name"] not in seen, f"tensor {t['name']!r} listed twice")
        _check_tensor(t, delta, len(chunks))
        seen.add(t["name"])


def _check_tensor(t: Mapping[str, Any], delta: bool, nchunks: int) -> None:
    what = f"tensor {t['name']!r}"
    _need(t.get("dtype") in DTYPE_WIDTHS, f"{what}: unknown dtype")
    shape = t.get("shape")
    _need(isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape), what)
    _need(isinstance(t.get("hash"), str), f"{what} has no hash")
    _need(t.get("base_hash") is None or isinstance(t["base_hash"], str), f"{what}: base_hash")
    _need(delta or t["base_hash"] is None, f"{what}: base_hash in a keyframe")
    counts = [t.get(k) for k in ("changed", "raw_bytes", "encoded_bytes")]
    _need(all(isinstance(c, int) for c in counts), f"{what}: sizes")
    pieces = t.get("pieces")
    if not isinstance(pieces, list):
        raise ManifestInvalid(f"{what} has no piece list")
    for p in pieces:
        _need(isinstance(p, list) and len(p) == 5 and p[3] in ENCODINGS, f"{what}: piece")
        _need(isinstance(p[0], int) and 0 <= p[0] < nchunks, f"{what}: piece chunk index")

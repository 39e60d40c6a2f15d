"""One encoded weight version (manifest + chunks) as a single file or byte string.

On Kafka the manifest and the chunks travel as separate records; for files (the
``rlstream delta`` tool, archives, tests) they are packed into one container:

    magic b"RLWDELTA" | <I format (1) | <I chunk count | <Q manifest length
    | manifest (compact JSON, UTF-8) | <Q xxh3_64 of the manifest bytes
    | per chunk: <Q length, then the payload

The manifest carries its own checksum here; chunks are checked against the manifest by the
codec (``verify_chunk``/``decode``), so a damaged file is always detected: ``unpack``
raises ``ManifestInvalid`` for a damaged header or manifest and ``ChunkCorrupt`` for a
truncated chunk area, and the codec reports any damaged chunk when decoding.
"""

from __future__ import annotations

import json
import struct
from typing import Final

import xxhash

from .codec import Encoded
from .manifest import ChunkCorrupt, ManifestInvalid

MAGIC: Final = b"RLWDELTA"
_HEAD: Final = struct.Struct("<8sIIQ")
_U64: Final = struct.Struct("<Q")


def pack(encoded: Encoded) -> bytes:
    """The container bytes of one encoded version."""
    manifest = json.dumps(encoded.manifest, separators=(",", ":")).encode()
    parts = [
        _HEAD.pack(MAGIC, 1, len(encoded.chunks), len(manifest)),
        manifest,
        _U64.pack(xxhash.xxh3_64_intdigest(manifest)),
    ]
    for chunk in encoded.chunks:
        parts += [_U64.pack(len(chunk)), chunk]
    return b"".join(parts)


def unpack(data: bytes) -> Encoded:
    """Inverse of ``pack``; chunk payloads are returned unverified (``decode`` verifies)."""
    if len(data) < _HEAD.size:
        raise ManifestInvalid("not a weight-delta file (too short)")
    magic, fmt, count, mlen = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or fmt != 1:
        raise ManifestInvalid("not a weight-delta file (bad magic or format)")
    offset = _HEAD.size
    raw = data[offset : offset + mlen]
    offset += mlen
    if len(raw) != mlen or offset + _U64.size > len(data):
        raise ManifestInvalid("truncated manifest")
    if _U64.unpack_from(data, offset)[0] != xxhash.xxh3_64_intdigest(raw):
        raise ManifestInvalid("manifest checksum mismatch")
    offset += _U64.size
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise ManifestInvalid(f"manifest is not JSON: {exc}") from exc
    chunks = []
    for i in range(count):
        if offset + _U64.size > len(data):
            raise ChunkCorrupt(f"file ends before chunk {i}")
        (length,) = _U64.unpack_from(data, offset)
        offset += _U64.size
        if offset + length > len(data):
            raise ChunkCorrupt(f"chunk {i} is truncated")
        chunks.append(data[offset : offset + length])
        offset += length
    if offset != len(data):
        raise ChunkCorrupt("trailing bytes after the last chunk")
    return Encoded(manifest, chunks)

"""The weight wire format: chunk bytes, the codec manifest's tables, and the Avro records.

One module owns how a policy version looks on the wire; the codec, the publisher and the
subscriber only call it. ``pack_chunk``/``parse_chunk`` are a chunk's one writer and parser;
``piece_entry``/``tensor_entry`` build the manifest's tables on both sides; ``manifest_record``
and ``codec_manifest`` map the codec manifest to and from the ``WeightManifest`` record.

Rules a maintainer must keep:
- bounds before allocation (``check_bounds``, ``check_piece``): a reader checks a manifest and
  every piece's declared sizes before it fetches, allocates or decompresses anything;
- plausible versions (``implausible``, ``replayed``): an older epoch, a jump too far, or a
  repeated version is refused by every reader.

numpy only: importing this module never loads torch or Kafka.
Details: docs/delta-codec.md (The wire format).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import zstandard

from .. import topics
from .bits import DTYPE_WIDTHS
from .manifest import (
    FORMAT,
    ChunkCorrupt,
    ManifestInvalid,
    MissingChunk,
    hash_algorithm,
    verify_chunk,
)
from .pieces import ENCODINGS, UNCHANGED, ZSTD, Piece, read_piece

CHUNK_HEADER: Final = struct.Struct("<4sBxxxI")
CHUNK_MAGIC: Final = b"RLDK"
CHUNK_FORMAT: Final = 1
#: Weights codec format number written to ``WeightManifest.codec_version``.
CODEC_VERSION: Final = int(FORMAT.rsplit("/", 1)[1])

Ref = tuple[str, int, int]  # topic, partition, offset
#: Most raw bytes one piece with data covers (the encoder's range size; only ``unchanged``
#: pieces, which carry no data, may cover more).
MAX_RANGE_BYTES: Final = 8 << 20
#: Most dimensions a tensor's shape may have.
MAX_NDIM: Final = 8
#: A model's architecture as a reader knows it: tensor name -> (dtype tag, shape).
TensorTable = Mapping[str, tuple[str, tuple[int, ...]]]

# --- chunks ----------------------------------------------------------------------------------


def pack_chunk(pieces: Sequence[Piece]) -> bytes:
    """The bytes of one chunk holding ``pieces`` in order."""
    head = CHUNK_HEADER.pack(CHUNK_MAGIC, CHUNK_FORMAT, len(pieces))
    return b"".join([head] + [p.to_bytes() for p in pieces])


def parse_chunk(payload: bytes | memoryview) -> list[Piece]:
    """The pieces of one chunk, in order (streams are zero-copy views of ``payload``).

    Piece ``i`` occupies ``nbytes`` bytes of the payload right after piece ``i - 1`` (the first
    one right after ``CHUNK_HEADER``). Raises ``ValueError`` on any inconsistency; callers turn
    it into the codec's ``ChunkCorrupt``."""
    buf = memoryview(payload)
    if len(buf) < CHUNK_HEADER.size:
        raise ValueError("truncated chunk header")
    magic, fmt, count = CHUNK_HEADER.unpack_from(buf, 0)
    if magic != CHUNK_MAGIC or fmt != CHUNK_FORMAT:
        raise ValueError("not a weight chunk (bad magic or format)")
    offset, pieces = CHUNK_HEADER.size, []
    for _ in range(count):
        piece, offset = read_piece(buf, offset)
        pieces.append(piece)
    if offset != len(buf):
        raise ValueError("trailing bytes after the last piece")
    return pieces


# --- codec manifest tables -------------------------------------------------------------------


def piece_entry(chunk: int, piece: Piece) -> list[Any]:
    """The piece table row of ``piece`` stored in chunk ``chunk``."""
    return [chunk, piece.start, piece.stop, ENCODINGS[piece.encoding], piece.nbytes]


def tensor_entry(
    name: str,
    dtype: str,
    shape: Sequence[int],
    *,
    changed: int,
    hash: str,
    base_hash: str | None,
    pieces: Sequence[list[Any]],
) -> dict[str, Any]:
    """A tensor's entry in the codec manifest (see the module docstring); ``pieces`` are its
    piece table rows, in any order (they are listed by start)."""
    rows = sorted(pieces, key=lambda p: p[1])
    names = list(dict.fromkeys(p[3] for p in rows))
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(shape),
        "encoding": "+".join(names) if names else "empty",
        "changed": changed,
        "hash": hash,
        "base_hash": base_hash,
        "raw_bytes": math.prod(shape) * DTYPE_WIDTHS.get(dtype, 0),
        "encoded_bytes": sum(p[4] for p in rows),
        "pieces": rows,
    }


# --- the Avro records ------------------------------------------------------------------------


def tensor_spans(manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``name -> (offset, nbytes)`` of each tensor's pieces in the concatenated chunk payloads.

    Rule: chunks hold the codec's pieces in manifest order (tensors by name, pieces by start),
    each chunk after its ``CHUNK_HEADER``; a tensor's span runs from its first piece's start
    to its last piece's end (chunk headers in between included). A tensor without pieces gets
    an empty span at the position where its pieces would have started."""
    bases, total = [], 0
    for c in manifest["chunks"]:
        bases.append(total)
        total += c["nbytes"]
    cursor = [CHUNK_HEADER.size] * len(bases)
    spans: dict[str, tuple[int, int]] = {}
    position = CHUNK_HEADER.size if bases else 0
    for entry in manifest["tensors"]:
        first = end = None
        for chunk, _start, _stop, _enc, nbytes in entry["pieces"]:
            at = bases[chunk] + cursor[chunk]
            first = at if first is None else first
            cursor[chunk] += nbytes
            end = at + nbytes
        if first is None or end is None:
            spans[entry["name"]] = (position, 0)
        else:
            spans[entry["name"]] = (first, end - first)
            position = end
    return spans


def manifest_record(
    manifest: Mapping[str, Any],
    *,
    run: str,
    model: str,
    chunk_topic: str,
    keyframe_version: int,
    created_ms: int,
    order: Sequence[str] | None = None,
    refs: Mapping[int, Ref] | None = None,
    step_inputs: Sequence[Mapping[str, Any]] = (),
    stats: Mapping[str, float] | None = None,
    learner_epoch: int = 0,
) -> dict[str, Any]:
    """The Avro ``WeightManifest`` of one encoded version (see the module docstring).

    ``order`` is the state-dict order of the tensor names (the codec's order, sorted by name, if
    None); ``refs`` maps chunk index to where its record was written."""
    by_name = {t["name"]: t for t in manifest["tensors"]}
    spans = tensor_spans(manifest)
    names = list(order) if order is not None else list(by_name)
    if sorted(names) != sorted(by_name):
        raise ValueError("order must name exactly the manifest's tensors")
    refs = refs or {}
    return {
        "run": run,
        "model": model,
        "version": manifest["version"],
        "base_version": manifest["base_version"],
        "keyframe_version": int(keyframe_version),
        "kind": manifest["kind"],
        "created_ms": int(created_ms),
        "tensors": [_avro_tensor(by_name[n], spans[n]) for n in names],
        "chunks": [_chunk_ref(c, refs.get(c["index"])) for c in manifest["chunks"]],
        "chunk_topic": chunk_topic,
        "state_hash": manifest["state_hash"],
        "base_state_hash": manifest["base_state_hash"],
        "raw_bytes": manifest["raw_bytes"],
        "encoded_bytes": manifest["encoded_bytes"],
        "step_inputs": [dict(r) for r in step_inputs],
        "stats": {k: float(v) for k, v in (stats or {}).items()},
        "codec_version": CODEC_VERSION,
        "learner_epoch": int(learner_epoch),
        "hash_algorithm": hash_algorithm(manifest),
    }


_ENTRY_FIELDS = ("name", "dtype", "encoding", "changed", "hash", "base_hash")


def _avro_tensor(entry: Mapping[str, Any], span: tuple[int, int]) -> dict[str, Any]:
    same = {k: entry[k] for k in _ENTRY_FIELDS}
    return {**same, "shape": list(entry["shape"]), "offset": span[0], "nbytes": span[1]}


def _chunk_ref(chunk: Mapping[str, Any], ref: Ref | None) -> dict[str, Any]:
    where = None if ref is None else {"topic": ref[0], "partition": ref[1], "offset": ref[2]}
    return {
        "index": chunk["index"],
        "nbytes": chunk["nbytes"],
        "checksum": chunk["checksum"],
        "ref": where,
    }


# --- bounds before allocation ----------------------------------------------------------------

#: Furthest past the newest accepted version a manifest may be (the learner publishes every
#: version, one step after the other; the margin only spares a reader that started late).
MAX_VERSION_JUMP: Final = 10_000
#: Furthest past the newest accepted learner epoch a manifest may be: a learner's incarnation
#: is one more than the newest among the run's manifests, so a model's epochs go up one at a
#: restart; the margin spares a reader that missed some.
MAX_EPOCH_JUMP: Final = 100


def implausible(
    version: int,
    epoch: int,
    newest: int | None,
    newest_epoch: int,
    max_jump: int = MAX_VERSION_JUMP,
    max_epoch_jump: int = MAX_EPOCH_JUMP,
) -> tuple[str, str] | None:
    """``(kind, reason)`` when a manifest of ``version`` and learner ``epoch`` must be refused,
    given the newest version and epoch accepted so far for its model; None when acceptable.

    Rule: an epoch older than ``newest_epoch`` is refused (``epoch``); so is an epoch more than
    ``max_epoch_jump`` past ``version`` (the k-th incarnation of a learner publishes version
    k - 1 or a later one: the first publishes version 0, each restart at least one version
    after the last) or, once a manifest was accepted, past ``newest_epoch`` (``epoch``): one
    forged epoch would otherwise make every reader refuse every later real version as older;
    a version more than ``max_jump`` past ``newest`` is refused (``version``). The first
    manifest read anchors both."""
    if epoch < newest_epoch:
        return "epoch", f"learner epoch {epoch} is older than epoch {newest_epoch} already seen"
    jump = f"learner epoch {epoch} jumps more than {max_epoch_jump} past"
    if epoch > version + max_epoch_jump:
        return "epoch", f"{jump} version {version}"
    if newest is not None and epoch > newest_epoch + max_epoch_jump:
        return "epoch", f"{jump} epoch {newest_epoch}"
    if newest is not None and version > newest + max_jump:
        return "version", f"version {version} jumps more than {max_jump} past {newest}"
    return None


def replayed(version: int, epoch: int, newest_of_kind: tuple[int, int] | None) -> str | None:
    """Why a manifest of ``version`` and ``epoch`` is a replay, given the (epoch, version) of
    the newest manifest of its model and kind accepted so far; None when it is not.

    Rule: within one learner epoch a learner publishes each version once per kind, in order
    (a publish whose transaction aborted is never read), so a manifest of that epoch whose
    version is not past the newest of its kind is an old manifest written again (or a
    duplicate a mirror delivered twice): refused. A newer epoch may publish any version."""
    if newest_of_kind is None or epoch != newest_of_kind[0] or version > newest_of_kind[1]:
        return None
    return f"version {version} replayed in epoch {epoch} (version {newest_of_kind[1]} seen)"


class VersionTips:
    """Per model, the newest version and learner epoch accepted so far: what ``implausible``
    judges a manifest against, and per model and kind the newest (epoch, version), what
    ``replayed`` judges it against. Every reader of manifests keeps one."""

    def __init__(self) -> None:
        self._tips: dict[str, tuple[int, int]] = {}
        self._kinds: dict[tuple[str, str], tuple[int, int]] = {}

    def admit(
        self, model: str, version: int, epoch: int, kind: str | None = None
    ) -> tuple[str, str] | None:
        """``(kind, reason)`` when the manifest is refused (see ``implausible`` and, given its
        ``kind``, ``replayed``: reason kind ``replayed``); else None, and the tips move to
        it."""
        newest, newest_epoch = self._tips.get(model, (None, 0))
        why = implausible(version, epoch, newest, newest_epoch)
        if why is None and kind is not None:
            again = replayed(version, epoch, self._kinds.get((model, kind)))
            why = None if again is None else ("replayed", again)
        if why is None:
            self._tips[model] = (max(version, newest or 0), epoch)
            if kind is not None:
                self._kinds[(model, kind)] = (epoch, version)
        return why


def default_max_state_bytes() -> int:
    """Half of this machine's physical memory (64 GiB where it cannot be read): the largest
    state a reader without the model's tensor table accepts."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 64 << 30


@dataclass(frozen=True)
class Bounds:
    """What a manifest may ask a reader to fetch and allocate (see the module docstring)."""

    table: TensorTable | None = None  # the model's tensors; None: any names and shapes
    max_state_bytes: int = field(default_factory=default_max_state_bytes)
    # a chunk's payload never exceeds its record, which the topic caps
    max_chunk_bytes: int = topics.STREAMS["weights.chunks"].max_value_bytes


def tensor_table(state: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The ``TensorTable`` of a state (``TensorBits`` by name)."""
    return {name: (t.dtype, tuple(int(d) for d in t.shape)) for name, t in state.items()}


def _shape_of(tensor: Mapping[str, Any]) -> tuple[int, ...]:
    name, shape = tensor.get("name"), tensor.get("shape")
    if tensor.get("dtype") not in DTYPE_WIDTHS:
        raise ManifestInvalid(f"tensor {name!r}: unknown dtype {tensor.get('dtype')!r}")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise ManifestInvalid(f"tensor {name!r}: shape must be at most {MAX_NDIM} dims")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ManifestInvalid(f"tensor {name!r}: shape {shape} is not non-negative ints")
    return tuple(shape)


def check_bounds(record: Mapping[str, Any], bounds: Bounds) -> None:
    """Raise ``ManifestInvalid`` unless the ``WeightManifest`` record stays within ``bounds``
    (the rules are in the module docstring). Reads the record only: nothing is allocated."""
    state_bytes = 0
    for t in record["tensors"]:
        shape = _shape_of(t)
        state_bytes += math.prod(shape) * DTYPE_WIDTHS[t["dtype"]]
        if state_bytes > bounds.max_state_bytes:
            raise ManifestInvalid(f"state of more than {bounds.max_state_bytes} bytes")
        if bounds.table is not None:
            want = bounds.table.get(t["name"])
            if want is None:
                raise ManifestInvalid(f"tensor {t['name']!r} is not one of the model's")
            if (t["dtype"], shape) != (want[0], tuple(want[1])):
                raise ManifestInvalid(
                    f"tensor {t['name']!r} is {t['dtype']}{list(shape)}, "
                    f"the model's is {want[0]}{list(want[1])}"
                )
    if bounds.table is not None and len(record["tensors"]) != len(bounds.table):
        raise ManifestInvalid(
            f"{len(record['tensors'])} tensors, the model has {len(bounds.table)}"
        )
    if record["raw_bytes"] != state_bytes:
        raise ManifestInvalid(f"raw_bytes {record['raw_bytes']}, the tensors hold {state_bytes}")
    sizes = [c["nbytes"] for c in record["chunks"]]
    if any(not 0 <= n <= bounds.max_chunk_bytes for n in sizes):
        raise ManifestInvalid(f"a chunk of more than {bounds.max_chunk_bytes} bytes")
    if record["encoded_bytes"] != sum(sizes):
        raise ManifestInvalid(f"encoded_bytes {record['encoded_bytes']} != chunk sizes")


def check_piece(piece: Piece, dtype: str, shape: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``piece`` of a tensor of ``dtype`` and ``shape`` stays
    within the bounds of the module docstring. Reads stream headers only."""
    n, width = piece.stop - piece.start, DTYPE_WIDTHS[dtype]
    if piece.stop > math.prod(shape):
        raise ValueError(f"piece {piece.start}..{piece.stop} outside a tensor of {list(shape)}")
    if piece.encoding == UNCHANGED:
        return
    if n * width > MAX_RANGE_BYTES or piece.count > n:
        raise ValueError(f"piece {piece.start}..{piece.stop} is larger than a range may be")
    most = n * width + n // 255 + 1  # the largest stream a range needs: its raw bytes, or gaps
    for codec, data in piece.streams:
        try:
            size = zstandard.frame_content_size(data) if codec == ZSTD else len(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"unreadable zstd frame header: {exc}") from exc
        if not 0 <= size <= most:
            raise ValueError(f"a stream declares {size} bytes, its piece needs at most {most}")


def codec_manifest(record: Mapping[str, Any], chunks: Sequence[bytes | None]) -> dict[str, Any]:
    """The codec manifest of an Avro ``WeightManifest``, rebuilt with its verified chunks.

    Rule: every chunk is first checked against the record's size and checksum; the piece table
    is then read from the chunks (each piece names its tensor, element range and encoding), and
    each piece must lie inside its tensor's ``offset``/``nbytes`` span of the concatenated
    payloads and within its bounds (``check_piece``). Raises ``ManifestInvalid``,
    ``MissingChunk`` or ``ChunkCorrupt``."""
    if record["codec_version"] != CODEC_VERSION:
        raise ManifestInvalid(f"unknown weights codec version {record['codec_version']}")
    listed = [
        {"index": c["index"], "nbytes": c["nbytes"], "checksum": c["checksum"]}
        for c in record["chunks"]
    ]
    algorithm = hash_algorithm(record)
    if len(chunks) != len(listed) or any(c is None for c in chunks):
        got = sum(c is not None for c in chunks)
        raise MissingChunk(f"version {record['version']}: {got} of {len(listed)} chunks")
    tensors = sorted(record["tensors"], key=lambda t: t["name"])
    pieces: list[list[list[Any]]] = [[] for _ in tensors]
    base = 0
    for index, payload in enumerate(chunks):
        assert payload is not None
        verify_chunk({"chunks": listed, "hash_algorithm": algorithm}, index, payload)
        _table_rows(index, payload, base, tensors, pieces)
        base += len(payload)
    return {
        "format": FORMAT,
        "version": record["version"],
        "base_version": record["base_version"],
        "kind": record["kind"],
        "tensors": [
            tensor_entry(
                t["name"],
                t["dtype"],
                t["shape"],
                changed=t["changed"],
                hash=t["hash"],
                base_hash=t["base_hash"],
                pieces=rows,
            )
            for t, rows in zip(tensors, pieces, strict=True)
        ],
        "chunks": listed,
        "state_hash": record["state_hash"],
        "base_state_hash": record["base_state_hash"],
        "raw_bytes": record["raw_bytes"],
        "encoded_bytes": record["encoded_bytes"],
        "hash_algorithm": algorithm,
        # not in the Avro record; decoding only needs a bound the chunks respect
        "max_chunk_bytes": max((c["nbytes"] for c in listed), default=0),
    }


def _table_rows(
    index: int,
    payload: bytes,
    base: int,
    tensors: Sequence[Mapping[str, Any]],
    into: list[list[list[Any]]],
) -> None:
    """Add the piece table rows of chunk ``index`` (at ``base`` in the concatenated payloads)
    to their tensors, checking each piece against its tensor's span."""
    try:
        at = base + CHUNK_HEADER.size
        for piece in parse_chunk(payload):
            if piece.tensor >= len(tensors):
                raise ValueError(f"piece of tensor {piece.tensor}, manifest has {len(tensors)}")
            lo, n = tensors[piece.tensor]["offset"], tensors[piece.tensor]["nbytes"]
            end = at + piece.nbytes
            if n and not lo <= at < end <= lo + n:  # nbytes 0: span unknown
                raise ValueError("a piece lies outside its tensor's span")
            check_piece(piece, tensors[piece.tensor]["dtype"], tensors[piece.tensor]["shape"])
            into[piece.tensor].append(piece_entry(index, piece))
            at = end
    except ValueError as exc:
        raise ChunkCorrupt(f"chunk {index}: {exc}") from exc


def chunk_record(
    manifest: Mapping[str, Any], index: int, payload: bytes, *, run: str, model: str
) -> dict[str, Any]:
    """The ``WeightChunk`` record of chunk ``index`` of the codec ``manifest``."""
    return {
        "run": run,
        "model": model,
        "version": manifest["version"],
        "index": index,
        "count": len(manifest["chunks"]),
        "checksum": manifest["chunks"][index]["checksum"],
        "payload": payload,
    }


def chunk_keys(record: Mapping[str, Any]) -> dict[bytes, tuple[int, str]]:
    """``record key -> (index, checksum)`` of every chunk a ``WeightManifest`` names.

    The keyframe and the delta of one version share chunk keys, and so may an orphan chunk
    (written by a publish whose manifest never committed): a chunk record is one of this
    manifest's only if its checksum (and version) match as well."""
    model, version = record["model"], record["version"]
    return {
        topics.record_key("weights.chunks", {"model": model, "version": version, "index": i}): (
            i,
            checksum,
        )
        for i, checksum in ((c["index"], c["checksum"]) for c in record["chunks"])
    }

"""What the backend checks and records of the tensors it is given, without vLLM: a version's
tensors against the model's checkpoint, and the hash of the checkpoint the engine holds.

- ``check``: why tensors cannot be loaded (a name the model lacks, another shape, a value that is
  not finite, a decoder layer given in part: vLLM reloads a fused layer, e.g. ``qkv_proj`` or the
  experts, as a whole, so a layer given in part would keep garbage in the parts it was not given).
- ``file_rows`` / ``folder_rows``: a row ``[name, dtype, shape, hash]`` per tensor of safetensors
  bytes, the hash BLAKE3 of the tensor's bytes as stored; ``rows_hash`` the state hash of rows.
  These are rlstream's state-hash rules (``schemas.deltacodec.bits``), so the hash of the held
  checkpoint equals the learner's state hash of the same tensors under the same names and dtypes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import blake3
import torch

LAYER = re.compile(r"^(.*\.layers\.\d+)\.")
#: safetensors' dtype codes, as rlstream names them (torch's names without ``torch.``).
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
}

Table = dict[str, tuple[tuple[int, ...], str]]
Row = list[Any]


def layer_of(name: str) -> str | None:
    """The decoder layer a checkpoint tensor belongs to (``model.layers.3``), or None."""
    match = LAYER.match(name)
    return match.group(1) if match else None


def header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``data`` (metadata removed) and where its tensor bytes start;
    ``ValueError`` for bytes that are not a whole safetensors file."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    size = int.from_bytes(bytes(data[:8]), "little")
    if size > len(data) - 8:
        raise ValueError("the header runs past the end of the file")
    entries = json.loads(bytes(data[8 : 8 + size]))
    entries.pop("__metadata__", None)
    start = 8 + size
    for name, entry in entries.items():
        _, end = entry["data_offsets"]
        if start + end > len(data):
            raise ValueError(f"{name} runs past the end of the file (truncated?)")
    return entries, start


def checkpoint_table(folder: str | Path) -> Table:
    """Name -> (shape, dtype) of every tensor in the safetensors files of ``folder``."""
    table: Table = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            entries = json.loads(f.read(size))
        for name, entry in entries.items():
            if name != "__metadata__":
                table[name] = (tuple(entry["shape"]), str(entry["dtype"]))
    return table


def check(tensors: Mapping[str, torch.Tensor], table: Table) -> str:
    """Why ``tensors`` cannot be loaded into a model of checkpoint ``table`` ('' if they can)."""
    for name, tensor in tensors.items():
        if name not in table:
            return f"{name} is not a tensor of this model"
        shape, _ = table[name]
        if tuple(tensor.shape) != shape:
            return f"{name} has shape {tuple(tensor.shape)}, the model's is {shape}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{name} holds values that are not finite"
    for layer in {layer_of(n) for n in tensors} - {None}:
        wanted = {n for n in table if layer_of(n) == layer}
        missing = wanted - set(tensors)
        if missing:
            return f"{layer} is given in part ({len(missing)} of {len(wanted)} tensors missing)"
    return ""


def file_rows(data: bytes | memoryview) -> dict[str, Row]:
    """``[name, dtype, shape, hash]`` of every tensor in safetensors ``data``."""
    entries, start = header(data)
    view = memoryview(data)
    rows: dict[str, Row] = {}
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        digest = blake3.blake3(view[start + begin : start + end]).hexdigest()
        rows[name] = [name, DTYPES.get(entry["dtype"], entry["dtype"]), entry["shape"], digest]
    return rows


def folder_rows(folder: str | Path) -> dict[str, Row]:
    """The rows of every tensor in the safetensors files of ``folder``."""
    rows: dict[str, Row] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        rows.update(file_rows(path.read_bytes()))
    return rows


def rows_hash(rows: Iterable[Row]) -> str:
    """The state hash of ``rows`` (BLAKE3 of compact JSON of the rows sorted)."""
    text = json.dumps(sorted(rows), separators=(",", ":"))
    return blake3.blake3(text.encode()).hexdigest()

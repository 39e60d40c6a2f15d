"""A group's rollout stopped part-way, as bytes another worker resumes from.

When serving takes a worker's engine back (``rollout.capacity``), the harness stops between two
sampling steps (the torch engine) or between two turns (remote engines) and raises
``Preempted`` with a ``GroupCheckpoint``: per sample, every token so far with its logprob, loss
mask, routes and the version that processed it, the segments, the tool calls made and the state
of the turn in progress. Resuming keeps every recorded token: the new worker feeds the sample's
context once (prefill) and samples on from where it stopped, so nothing is generated twice.

Rules:
- a checkpoint holds plain data only: JSON for the structure, ``.npz`` (no pickles) for arrays,
  compressed with zstd; ``from_bytes`` refuses anything else with a clear error;
- the tool calls' full inputs are kept in order: a resuming worker runs them again on a fresh
  workspace to rebuild the files they wrote (the shipped families' tools are deterministic;
  the outputs the policy saw are the recorded ones either way);
- a turn cut part-way (``open``) continues within its own token budget;
- the KV cache is not shipped: it is recomputed from the tokens by the resuming engine's weights
  (what vLLM does for a request it preempts by recomputation); the recorded per-token versions
  and routes stay those that produced each token.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import zstandard

from rlstream.schemas.errors import RlstreamError

MAGIC = b"RLCK1"
_ARRAYS = ("tokens", "logprobs", "mask", "routes", "versions")
#: zstd level: checkpoints are written once, on a reclaim, and read once.
_LEVEL = 3


class CheckpointError(RlstreamError, ValueError):
    """Bytes that are not a rollout checkpoint this version can read."""


@dataclass
class RowState:
    """One sample part-way (the fields of the harness's per-sample state)."""

    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    mask: np.ndarray  # uint8 [T]
    routes: np.ndarray  # uint8 or uint16 [T, L, K]
    versions: np.ndarray  # int64 [T]
    segments: list[list[Any]] = field(default_factory=list)  # [start, end, turns, reason]
    seg_start: int = 0
    seg_prompt: int = 0
    turns: int = 0
    outputs: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: int = 0
    transcript: list[str] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)
    replay: list[dict[str, Any]] = field(default_factory=list)  # calls that ran, full inputs
    turn: list[int] = field(default_factory=list)  # the turn in progress (or complete, tools next)
    open: bool = False  # the turn was cut part-way: generation continues it
    done: bool = False  # the sample is finished

    @property
    def generated(self) -> int:
        """Tokens the policy generated so far (the loss mask's ones)."""
        return int(self.mask.sum())


@dataclass
class GroupCheckpoint:
    """Every sample of one group, part-way (see the module rules)."""

    prompt: str
    rows: list[RowState]

    @property
    def generated(self) -> int:
        return sum(r.generated for r in self.rows)

    def to_bytes(self) -> bytes:
        meta: list[dict[str, Any]] = []
        arrays: dict[str, np.ndarray] = {}
        for i, row in enumerate(self.rows):
            meta.append(
                {f.name: getattr(row, f.name) for f in fields(row) if f.name not in _ARRAYS}
            )
            for name in _ARRAYS:
                arrays[f"{i}.{name}"] = np.ascontiguousarray(getattr(row, name))
        head = json.dumps({"prompt": self.prompt, "rows": meta}).encode()
        npz = io.BytesIO()
        np.savez(npz, allow_pickle=False, **arrays)
        body = struct.pack("<I", len(head)) + head + npz.getvalue()
        return MAGIC + zstandard.ZstdCompressor(level=_LEVEL).compress(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupCheckpoint:
        if not data.startswith(MAGIC):
            raise CheckpointError("not a rollout checkpoint (no RLCK1 header)")
        try:
            body = zstandard.ZstdDecompressor().decompress(data[len(MAGIC) :])
            (n,) = struct.unpack_from("<I", body)
            head = json.loads(body[4 : 4 + n])
            with np.load(io.BytesIO(body[4 + n :]), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            rows = []
            for i, meta in enumerate(head["rows"]):
                loaded = {name: arrays[f"{i}.{name}"] for name in _ARRAYS}
                rows.append(RowState(**loaded, **meta))
        except CheckpointError:
            raise
        except Exception as exc:  # truncated, corrupt, or fields this version does not know
            raise CheckpointError(f"unreadable rollout checkpoint: {exc}") from exc
        _check_aligned(rows)
        return cls(str(head["prompt"]), rows)


def _check_aligned(rows: list[RowState]) -> None:
    for i, row in enumerate(rows):
        t = len(row.tokens)
        shapes = [len(row.logprobs), len(row.mask), len(row.versions), row.routes.shape[0]]
        if any(s != t for s in shapes):
            raise CheckpointError(f"row {i}: arrays of {t} tokens and {shapes} are not aligned")
        if len(row.turn) > t:
            raise CheckpointError(f"row {i}: a turn of {len(row.turn)} tokens in a row of {t}")


class Preempted(RlstreamError):
    """Generation stopped because the worker's capacity was reclaimed; ``checkpoint`` resumes
    the group elsewhere."""

    def __init__(self, checkpoint: GroupCheckpoint) -> None:
        super().__init__(f"preempted after {checkpoint.generated} generated tokens")
        self.checkpoint = checkpoint

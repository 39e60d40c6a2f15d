"""Sequence packing: a batch's samples laid end to end in fixed-token rows for the forward pass,
instead of each right-padded to the longest.

Rules:
- rows are filled first-fit by decreasing length (ties by sample order), each ``width`` tokens
  wide, ``width`` = the larger of the configured row size and the longest sample; the layout
  depends only on the lengths, so it is deterministic;
- each sample keeps its own positions ``0..n-1`` (rotary embeddings see what they see padded),
  and attention never crosses samples (the policy's packed-sequence mask, ``HFPolicy.forward``);
  the tail of a row is padding (token ``pad_id``, routes ``0..K-1``) after every real token, so
  under causal attention it influences nothing;
- router replay is unchanged: each token carries its recorded experts to its packed place;
- :func:`unpack` gathers a per-token tensor of the packed rows back into the padded
  ``[B, T]`` layout (0 at each sample's position 0 and past its end), with its gradient, so the
  objectives see exactly the tensors of the padded path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Sample indices of each row: first fit, longest first (ties in sample order)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        if n > width:
            raise ValueError(f"a sample of {n} tokens does not fit a row of {width}")
        slot = next((r for r, f in enumerate(free) if f >= n), None)
        if slot is None:
            rows.append([])
            free.append(width)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= n
    return rows


@dataclass
class Packed:
    """Packed rows ``[R, W]`` (tokens, positions, forced routes ``[R, W, L, K]``) and, per
    padded place ``[B, T]``, the flat index of its packed place and whether it is one."""

    tokens: Tensor
    positions: Tensor
    routes: Tensor
    index: Tensor
    valid: Tensor


def pack(
    tokens: Tensor, routes: Tensor, lengths: Sequence[int], row_tokens: int, pad_id: int = 0
) -> Packed:
    """The packed layout of the right-padded ``tokens`` ``[B, T]`` and ``routes``."""
    b, t = tokens.shape
    width = max(row_tokens, max(lengths))
    rows = pack_rows(lengths, width)
    n_layers, top_k = routes.shape[2], routes.shape[3]
    p_tokens = torch.full((len(rows), width), pad_id, dtype=tokens.dtype)
    p_pos = torch.arange(width).repeat(len(rows), 1)
    p_routes = torch.arange(top_k).expand(len(rows), width, n_layers, top_k).clone()
    index = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            p_tokens[r, at : at + n] = tokens[i, :n]
            p_routes[r, at : at + n] = routes[i, :n]
            p_pos[r, at : at + n] = torch.arange(n)
            index[i, :n] = r * width + at + torch.arange(n)
            valid[i, 1:n] = True
            at += n
        p_pos[r, at:] = torch.arange(width - at)  # the tail: a sequence of its own
    return Packed(p_tokens, p_pos, p_routes, index, valid)


def unpack(values: Tensor, packed: Packed) -> Tensor:
    """``values`` of the packed rows (``[R, W, ...]``) at each padded place (``[B, T, ...]``),
    0 where the place is no packed token's prediction (position 0, padding)."""
    flat = values.reshape(-1, *values.shape[2:])
    out = flat[packed.index.flatten()].reshape(*packed.index.shape, *values.shape[2:])
    keep = packed.valid.reshape(*packed.valid.shape, *([1] * (values.dim() - 2)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype))


def unpack_routes(routes: Tensor, packed: Packed) -> Tensor:
    """Routes of the fed packed tokens (``[R, W - 1, L, K]``) at each padded input place
    (``[B, T - 1, L, K]``); a place whose token was not fed gets -1."""
    r, w1 = routes.shape[:2]
    width = w1 + 1
    index = packed.index[:, :-1]
    fed = (index % width) < w1
    flat_index = (index // width) * w1 + (index % width).clamp(max=w1 - 1)
    out = routes.reshape(r * w1, *routes.shape[2:])[flat_index.flatten()]
    out = out.reshape(*index.shape, *routes.shape[2:])
    return torch.where(fed[..., None, None], out, torch.full((), -1, dtype=out.dtype))

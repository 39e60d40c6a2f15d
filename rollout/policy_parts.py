"""What the policy contract (:mod:`rlstream.rollout.model`) and the policy itself
(:mod:`rlstream.rollout.hf_policy`) share: the KV cache and the MoE load-balance loss. Its own
module so that the two import it and not each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class KVCache:
    """Per-layer keys/values ``[B, H, T, Dh]``; ``length`` positions are filled."""

    keys: list[Tensor | None]
    values: list[Tensor | None]
    length: int = 0

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls([None] * n_layers, [None] * n_layers, 0)

    def select(self, row: int, length: int) -> KVCache:
        """A batch-1 copy of ``row`` truncated to ``length`` positions (its own tokens only)."""
        keys = [k[row : row + 1, :, :length].clone() for k in self.keys if k is not None]
        values = [v[row : row + 1, :, :length].clone() for v in self.values if v is not None]
        return KVCache(list(keys), list(values), length)


def load_balance_loss(router_probs: list[Tensor], top_k: int) -> Tensor:
    """Switch-style auxiliary loss over the MoE layers' router probabilities ``[B, T, E]``:
    E * sum_e(load_e * prob_e), load normalised by ``top_k``, averaged over the layers."""
    total = torch.zeros(())
    for probs in router_probs:
        e = probs.shape[-1]
        top = probs.topk(top_k, dim=-1).indices
        load = F.one_hot(top, e).float().sum(dim=-2).mean(dim=(0, 1)) / top_k
        total = total + e * (load * probs.mean(dim=(0, 1))).sum()
    return total / max(len(router_probs), 1)

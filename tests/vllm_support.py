"""What the vLLM engine tests share: the skip when vLLM is not installed, a policy shape vLLM's
CPU attention runs, reference logprobs from transformers, and versions made by perturbing one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from rlstream.envs import protocol
from rlstream.rollout.config import PolicyConfig, VllmConfig
from rlstream.rollout.engines import VersionGate
from rlstream.rollout.model import build_policy, sequence_logprobs
from rlstream.rollout.vllm_engine import VllmEngine
from rlstream.rollout.vllm_process import vllm_python

requires_vllm = pytest.mark.skipif(
    vllm_python() is None,
    reason="vLLM is not installed (run `make vllm`: it makes .venv-vllm; CI runs it)",
)

# heads of 64 (vLLM's CPU attention runs 32, 64, ...; the default shape's 16 it does not)
POLICY = PolicyConfig(
    vocab_size=protocol.VOCAB_SIZE, d_model=64, n_heads=4, head_dim=64, d_expert=64, n_experts=4
)
#: logprobs of the engine (fp32) and of transformers (fp32) agree this closely (4 decimals)
TOLERANCE = 1e-4


def start_engine(
    tmp: Path, state: Mapping[str, torch.Tensor], gate: VersionGate | None = None, **cfg: object
) -> VllmEngine:
    """A ``VllmEngine`` for ``POLICY`` serving ``state`` as version 0."""
    engine = VllmEngine(
        VllmConfig(work_dir=str(tmp), **cfg),  # type: ignore[arg-type]
        build_policy(POLICY),
        POLICY,
        "policy",
        tmp / "vllm.log",
        gate,
    )
    engine.push(0, state)
    return engine


def reference_logprobs(
    state: Mapping[str, torch.Tensor], tokens: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """transformers' fp32 logprob of each token given its prefix (position 0 gets 0)."""
    model = build_policy(POLICY).eval()
    with torch.no_grad():
        model.load_state_dict(dict(state))
        lp, _ = sequence_logprobs(model, torch.tensor([tokens]), temperature=temperature)
    return lp[0]


def perturbed(
    state: Mapping[str, torch.Tensor], seed: int, only: str = "", scale: float = 0.02
) -> dict[str, torch.Tensor]:
    """A new version: every tensor whose name contains ``only`` moved by noise (others kept)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: t + scale * torch.randn(t.shape, generator=gen) if only in name else t.clone()
        for name, t in state.items()
    }

"""The ``engine_weights_corrupted`` attack: a vLLM engine's weights corrupted in place.

Engines have kept stale or corrupted weights after a sync without a sign; rlstream checks what
the engine holds after every version (``rollout.vllm_engine``: the backend's checkpoint hash and
a canary's logprobs) and repairs a failing engine by a whole reload. This attack proves it on a
real vLLM server (its CPU build; the attack is skipped when ``make vllm`` did not run). The
engine holds a small policy of its own (``ENGINE_POLICY``: the run's demo policy has heads of 16,
which vLLM's CPU attention does not run). Each round corrupts it two ways between two versions:

- ``zeroed``: every weight set to zero in place through vLLM's own ``/weight_checker`` reset
  (what memory corruption after a good load looks like: invisible to any hash of what was sent);
- ``behind_its_back``: one decoder layer overwritten with other bytes through the backend (what
  a load of the wrong file looks like).

The next version then changes the final norm only, so the corruption stays unless something
finds it. An attempt is refused when that version's check failed, the engine was repaired, and
it then serves the worker's own logprobs on that version (a canary within tolerance).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from rlstream.envs import protocol
from rlstream.ops.chaos.attacks import Attempts
from rlstream.rollout.config import PolicyConfig, VllmConfig
from rlstream.rollout.model import build_policy
from rlstream.rollout.vllm_engine import VllmEngine
from rlstream.rollout.vllm_process import vllm_python

ENGINE_POLICY = PolicyConfig(
    vocab_size=protocol.VOCAB_SIZE, d_model=64, n_heads=4, head_dim=64, d_expert=64, n_experts=4
)
Corruption = Callable[[VllmEngine, dict[str, torch.Tensor], torch.Generator], None]


def zeroed(engine: VllmEngine, state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    engine._post("/weight_checker", {"action": "reset"})


def behind_its_back(
    engine: VllmEngine, state: dict[str, torch.Tensor], gen: torch.Generator
) -> None:
    layer = {
        n: t + torch.randn(t.shape, generator=gen) for n, t in state.items() if ".layers.1." in n
    }
    path, digest = engine._write(layer, engine.version)
    try:
        engine._transfer({"path": str(path), "sha256": digest, "version": engine.version})
    finally:
        path.unlink(missing_ok=True)


CORRUPTIONS: tuple[Corruption, ...] = (zeroed, behind_its_back)


def available() -> bool:
    """Whether a vLLM build is installed to attack (``make vllm``)."""
    return vllm_python() is not None


def engine_weights_corrupted(work: Path, rounds: int = 1) -> Attempts:
    """``rounds`` rounds of every corruption against a vLLM engine started in ``work`` (see the
    module docstring); how often each was tried and refused."""
    work.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    state = {k: v.detach().clone() for k, v in build_policy(ENGINE_POLICY).state_dict().items()}
    engine = VllmEngine(
        VllmConfig(work_dir=str(work)),
        build_policy(ENGINE_POLICY),
        ENGINE_POLICY,
        "policy",
        work / "vllm-attack.log",
    )
    attempts = Attempts()
    try:
        engine.push(0, state)
        for _ in range(rounds):
            for corrupt in CORRUPTIONS:
                attempts.tried += 1
                corrupt(engine, state, gen)
                state = {**state, "model.norm.weight": state["model.norm.weight"] * 1.01}
                repairs = engine.stats.repairs
                engine.push(engine.version + 1, state)
                healthy = engine.check(state) <= engine.cfg.tolerance
                attempts.refused += int(engine.stats.repairs == repairs + 1 and healthy)
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    return attempts

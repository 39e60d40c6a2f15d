"""The learner's training step: its config, the model it starts from, one GRPO step over the
admitted groups with router replay, the weights it publishes, and checkpoints by version.

The role around it (Kafka in, weights out, exactly once) is ``trainer.learner``. The published
weights are the ``publish_dtype`` (bf16 by default) cast of the fp32 master: rollout inference
runs on them while the learner trains in fp32, as at scale.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlstream.rollout.model import PolicyModel, build_policy, clone_policy
from rlstream.schemas import arrays
from rlstream.schemas.deltacodec import from_torch
from rlstream.trainer import grpo as rules
from rlstream.trainer import objectives
from rlstream.trainer.config import GrpoConfig, LearnerConfig
from rlstream.trainer.distributed import Ranks, gathered, gathered_optimizer, slice_of
from rlstream.trainer.warmstart import warm_start

log = logging.getLogger(__name__)


@dataclass
class StepInput:
    """One admitted group and where it came from."""

    group: dict[str, Any]
    refs: list[tuple[str, int, int]] = field(default_factory=list)


def group_sequences(
    group: dict[str, Any], cfg: GrpoConfig, loss: objectives.LossConfig | None = None
) -> tuple[list[rules.TrainSequence], list[float]]:
    """The training contexts of one admitted group with each one's group-normalised advantage
    (rewards and advantages of samples cut by the token budget as ``loss.overlong`` says).

    Router replay: a sample whose engine reported no routes (``routes_recorded`` false, e.g.
    vLLM's CPU build) is never replayed: its tokens are routed by the learner's own router
    (``grpo.make_batch`` marks them -1), whatever its routes field holds."""
    samples = group["samples"]
    arrays_of = [arrays.unpack_tokens(s) for s in samples]
    overlong = (loss or objectives.TruncatedIS()).overlong
    cut = [
        objectives.is_cut(np.array(t.token_ids), np.array(t.loss_mask), overlong.end_ids)
        for t in arrays_of
    ]
    lengths = [int(np.count_nonzero(t.loss_mask)) for t in arrays_of]
    rewards, keep = objectives.overlong_rewards(
        [s["reward"] for s in samples], lengths, cut, overlong
    )
    if group.get("source") == "online":
        # feedback-rl already subtracted a per-task-class baseline: normalising within the
        # window's group would cancel it.
        advantages = np.asarray(rewards, dtype=np.float64)
    else:
        advantages = rules.group_advantages(rewards, cfg.adv_eps)
    seqs: list[rules.TrainSequence] = []
    advs: list[float] = []
    for sample, t, adv in zip(samples, arrays_of, advantages * keep, strict=True):
        routes = np.array(t.routed_experts)
        if not sample.get("routes_recorded", True):
            routes = np.zeros((len(t.token_ids), 0, 0), dtype=routes.dtype)
        flat = sample.get("segment_bounds") or []
        bounds = list(zip(flat[::2], flat[1::2], strict=True)) or None
        parts = rules.split_segments(
            np.array(t.token_ids),
            np.array(t.logprobs),
            np.array(t.loss_mask),
            routes,
            bounds,
        )
        seqs += parts
        advs += [float(adv)] * len(parts)
    return seqs, advs


def train_step(
    model: PolicyModel,
    optimizer: torch.optim.Optimizer,
    inputs: list[StepInput],
    cfg: LearnerConfig,
    ranks: Ranks | None = None,
    reference: PolicyModel | None = None,
) -> dict[str, float]:
    """One version's optimizer steps on the groups of ``inputs`` (in order); returns its
    statistics.

    The groups are split into ``cfg.loss.minibatches`` consecutive minibatches (at most one per
    group a rank holds), one optimizer step each (``rules.grpo_version``); ``reference`` is the
    version-0 policy of the objective's KL term (``reference_policy``). With ``ranks`` (every
    rank calls it with the same ``inputs``, on the model and optimizer ``Ranks.adopt`` sharded)
    this rank trains on its slice (``distributed.slice_of``) with its loss weighted by its share
    of the step's loss tokens (``distributed.Ranks.weigh``), and FSDP2 averages the gradients
    across ranks; the group statistics cover every input, the loss statistics this rank's
    slice."""
    mine, weigh, world = inputs, None, 1
    if ranks is not None and ranks.world > 1:
        world = ranks.world
        lo, hi = slice_of(len(inputs), ranks.rank, ranks.world)
        mine, weigh = inputs[lo:hi], ranks.weigh
        if not mine:
            raise ValueError(f"{len(inputs)} groups cannot be split over {ranks.world} ranks")
        if cfg.loss.kl_coef > 0:
            raise ValueError("the KL term's reference policy is held by one rank only")
    # every rank takes as many steps: the fewest groups any rank holds bounds the count
    n_mb = max(1, min(cfg.loss.minibatches, len(inputs) // world))
    batches = []
    for k in range(n_mb):
        lo, hi = slice_of(len(mine), k, n_mb)
        seqs: list[rules.TrainSequence] = []
        advs: list[float] = []
        for item in mine[lo:hi]:
            s, a = group_sequences(item.group, cfg.grpo, cfg.loss)
            seqs += s
            advs += a
        batches.append(rules.make_batch(seqs, advs))
    stats = rules.grpo_version(model, optimizer, batches, cfg.grpo, cfg.loss, weigh, reference)
    samples = [s for item in inputs for s in item.group["samples"]]
    stats.update(
        groups=float(len(inputs)),
        samples=float(len(samples)),
        reward_mean=float(np.mean([s["reward"] for s in samples])),
        success_rate=float(np.mean([s["passed"] for s in samples])),
        staleness_mean=float(np.mean([item.group["staleness"] for item in inputs])),
        behaviour_version_min=float(min(s["policy_version"] for s in samples)),
        routes_absent_samples=float(sum(not s.get("routes_recorded", True) for s in samples)),
    )
    return stats


def reference_policy(cfg: LearnerConfig, model: PolicyModel) -> PolicyModel | None:
    """The frozen reference of the objective's KL term: a copy of ``model`` (call it on the
    version-0 weights, before any checkpoint is loaded); None when the objective has no KL."""
    if cfg.loss.kl_coef == 0:
        return None
    ref = clone_policy(model)
    ref.requires_grad_(False)
    return ref


def published_state(model: PolicyModel, dtype: str) -> dict[str, Any]:
    """The codec's view of the weights to publish (``dtype`` cast of the fp32 master)."""
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    # clone(): from_torch is zero-copy, and the published state must not move with training.
    # A sharded model's tensors are gathered whole: every rank calls this at the same point.
    return from_torch(
        {k: v.detach().to(torch_dtype).clone() for k, v in gathered(model.state_dict()).items()}
    )


def init_model(
    cfg: LearnerConfig, log_fn: Any = print, warm: bool = True
) -> tuple[PolicyModel, torch.optim.Optimizer]:
    """The version-0 policy (warm start, deterministic given the configs; with
    ``policy.lora.rank`` its adapters added after it, only they trained, at ``lr x
    lora.lr_scale``) and its optimizer; with ``warm`` False the policy as built, untrained (a
    rank that receives rank 0's weights)."""
    torch.manual_seed(cfg.seed)
    lora = cfg.policy.lora
    if warm:
        model = warm_start(cfg.policy, cfg.warm_start, cfg.warm_start_cache, log_fn)
        if lora.rank:
            from rlstream.rollout.hf_policy import with_lora  # transformers imports slowly

            model = with_lora(model, lora)
    else:
        model = build_policy(cfg.policy)
    lr = cfg.lr * lora.lr_scale if lora.rank else cfg.lr
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=lr, betas=(0.9, 0.98))
    return model, optimizer


class Checkpoints:
    """fp32 master weights + optimizer state by version, written atomically; the last 3 kept."""

    def __init__(self, directory: str, run: str) -> None:
        self.dir = Path(directory) / run
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        version: int,
        model: PolicyModel,
        optimizer: torch.optim.Optimizer,
        write: bool = True,
    ) -> None:
        """Checkpoint ``version``: whole tensors in an unsharded learner's format. A sharded
        learner's ranks all call it (the tensors are gathered); the one with ``write`` writes."""
        weights, moments = gathered(model.state_dict()), gathered_optimizer(optimizer.state_dict())
        if not write:
            return
        path = self.dir / f"v{version:08d}.pt"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"version": version, "model": weights, "optimizer": moments}, tmp)
        os.replace(tmp, path)
        for old in sorted(self.dir.glob("v*.pt"))[:-3]:
            old.unlink(missing_ok=True)

    def load(self, version: int, model: PolicyModel, optimizer: torch.optim.Optimizer) -> bool:
        path = self.dir / f"v{version:08d}.pt"
        if not path.exists():
            return False
        stored = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(stored["model"])
        optimizer.load_state_dict(stored["optimizer"])
        return True

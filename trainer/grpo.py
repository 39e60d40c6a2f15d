"""GRPO as pure rules plus one optimizer step with router replay.

The rules (each one a function with its rule in the docstring, unit tested):

- advantages are group-normalised: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the
  population std; a group whose rewards are all equal carries no signal and gets all zeros;
- the loss is an objective of ``trainer.objectives`` (``learner.loss``; the default is token-level
  truncated IS, ``-sum(mask * min(r, C) * A * logp_cur) / sum(mask)``) over every policy-generated
  token of the batch (prompt, tool output and padding are masked out);
- ``grpo_step`` recomputes current logprobs with router replay (the batch's recorded experts are
  forced), so the gradient follows exactly the experts that produced each token, and takes one
  optimizer step. It is deterministic on CPU for the same weights, batch and optimizer state;
- ``grpo_version`` takes a version's optimizer steps, one per minibatch; the proximal logprobs of
  every minibatch (the objectives that need them) are those of the weights before the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlstream.rollout.model import PolicyModel, sequence_logprobs, sequence_logprobs_entropy
from rlstream.schemas.errors import RlstreamError
from rlstream.trainer import objectives as obj
from rlstream.trainer import packing
from rlstream.trainer.config import GrpoConfig


def group_advantages(rewards: Sequence[float] | np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Rule: ``(r - mean(r)) / (std(r) + eps)`` (population std); equal rewards give zeros."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return np.zeros(0, dtype=np.float32)
    centred = r - r.mean()
    std = float(r.std())
    if std == 0.0:
        return np.zeros_like(r, dtype=np.float32)
    return (centred / (std + eps)).astype(np.float32)


@dataclass
class GrpoBatch:
    """Right-padded training sequences, aligned position by position.

    ``tokens`` ``[B, T]`` int64; ``behaviour_logprobs`` ``[B, T]`` float32 (0 where not
    generated); ``loss_mask`` ``[B, T]`` float32; ``routes`` ``[B, T, L, K]`` int64;
    ``advantages`` ``[B]`` float32; ``lengths`` each row's tokens; ``proximal_logprobs`` ``[B, T]`` (set by ``grpo_version``
    when the objective needs the weights before the version's first step).
    """

    tokens: Tensor
    behaviour_logprobs: Tensor
    loss_mask: Tensor
    routes: Tensor
    advantages: Tensor
    proximal_logprobs: Tensor | None = None
    lengths: list[int] | None = None


@dataclass
class TrainSequence:
    """One replayable context: the arrays of one segment of one sample."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    routes: np.ndarray


def split_segments(
    token_ids: np.ndarray,
    logprobs: np.ndarray,
    loss_mask: np.ndarray,
    routes: np.ndarray,
    bounds: Sequence[tuple[int, int]] | None = None,
) -> list[TrainSequence]:
    """The replayable contexts of one sample: ``[start, end)`` slices of its flat arrays.

    Rule: no ``bounds`` means the whole sample is one context; a segment without any
    policy-generated token is dropped (it carries no gradient).
    """
    spans = bounds if bounds else [(0, len(token_ids))]
    out = []
    for start, end in spans:
        if loss_mask[start:end].any():
            out.append(
                TrainSequence(
                    token_ids[start:end],
                    logprobs[start:end],
                    loss_mask[start:end],
                    routes[start:end],
                )
            )
    return out


def make_batch(
    sequences: Sequence[TrainSequence], advantages: Sequence[float], pad_id: int = 0
) -> GrpoBatch:
    """Stack ``sequences`` (each with its sample's advantage) into a right-padded batch.

    Rule: padding has token ``pad_id``, mask 0, logprob 0 and routes ``0..K-1`` (any valid
    experts: right padding never influences earlier positions under causal attention). A
    sequence recorded without routes (an inference engine that does not report them) gets routes
    -1: the learner's forward routes those tokens freely; a batch in which no sequence has routes
    has routes of 0 layers and is not replayed.
    """
    if len(sequences) != len(advantages) or not sequences:
        raise ValueError("need one advantage per sequence, and at least one sequence")
    width = max(len(s.token_ids) for s in sequences)
    shapes = {s.routes.shape[1:] for s in sequences if s.routes.size}
    if len(shapes) > 1:
        raise ValueError(f"sequences disagree on routes' (layers, top_k): {sorted(shapes)}")
    n_layers, top_k = shapes.pop() if shapes else (0, 0)
    b = len(sequences)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    logp = torch.zeros(b, width)
    mask = torch.zeros(b, width)
    routes = torch.arange(top_k).expand(b, width, n_layers, top_k).clone()
    for i, s in enumerate(sequences):
        n = len(s.token_ids)
        tokens[i, :n] = torch.from_numpy(s.token_ids.astype(np.int64))
        logp[i, :n] = torch.from_numpy(s.logprobs.astype(np.float32))
        mask[i, :n] = torch.from_numpy(s.loss_mask.astype(np.float32))
        routes[i, :n] = torch.from_numpy(s.routes.astype(np.int64)) if s.routes.size else -1
    advs = torch.tensor(list(advantages), dtype=torch.float32)
    return GrpoBatch(
        tokens, logp, mask, routes, advs, lengths=[len(s.token_ids) for s in sequences]
    )


class NonFiniteStep(RlstreamError, ArithmeticError):
    """A step's loss or gradient is not finite; no update was made."""


def grpo_step(
    model: PolicyModel,
    optimizer: torch.optim.Optimizer,
    batch: GrpoBatch,
    cfg: GrpoConfig,
    weigh: Callable[[float, bool], tuple[float, bool]] | None = None,
    loss_cfg: obj.LossConfig | None = None,
    reference: PolicyModel | None = None,
) -> dict[str, float]:
    """One update on ``batch`` under the objective ``loss_cfg`` (default: truncated IS, cap 2);
    returns statistics of the step.

    Rule: recompute ``logp_cur`` in the model's (training) precision, replaying the batch's
    recorded experts when ``cfg.router_replay`` (the ``reference`` policy's logprobs, for the
    KL term, likewise); take the objective's loss, clip the gradient norm to
    ``cfg.max_grad_norm`` and step the optimizer once, unless the loss or the gradient norm is
    not finite: then raise ``NonFiniteStep`` with the weights and the optimizer untouched.
    Samples whose advantage is 0 contribute no policy gradient but still count their tokens in
    the denominator. With ``weigh`` (data-parallel ranks, ``trainer.distributed.Ranks.weigh``)
    it is called before the backward pass with this batch's loss-token count and whether its
    loss is finite, and returns the factor of this rank's loss and whether every rank's loss is
    finite: the step is refused on every rank together, and the backward pass (whose gradients
    the ranks reduce) takes the weighted loss.
    """
    lc = loss_cfg if loss_cfg is not None else obj.TruncatedIS()
    model.train()
    replay = cfg.router_replay and batch.routes.shape[2] > 0
    forced = batch.routes if replay else None
    logp_cur, entropy, routes = batch_logprobs(model, batch, forced, cfg, lc.entropy_coef > 0)
    terms = obj.TokenTerms(
        logp_cur,
        batch.behaviour_logprobs,
        batch.advantages,
        batch.loss_mask.float(),
        logp_proximal=batch.proximal_logprobs,
        logp_ref=_reference_logprobs(reference, batch, forced, cfg) if lc.kl_coef > 0 else None,
        entropy=entropy,
    )
    loss, stats = obj.objective(lc, terms)
    factor, all_finite = 1.0, True
    if weigh is not None:
        factor, all_finite = weigh(stats["tokens"], bool(torch.isfinite(loss)))
    if not all_finite:
        raise NonFiniteStep(f"a rank's loss is not finite (this rank's: {float(loss.detach())})")
    optimizer.zero_grad(set_to_none=True)
    (loss * factor if factor != 1.0 else loss).backward()
    grad_norm = _whole(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
        # The weights stay as they were: a NaN or inf here would reach every worker.
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteStep(f"loss {float(loss.detach())}, gradient norm {float(grad_norm)}")
    optimizer.step()
    stats.update(
        loss=float(loss.detach()),
        grad_norm=float(grad_norm),
        route_mismatch=_route_mismatch(batch, routes),
    )
    return stats


def _reference_logprobs(
    reference: PolicyModel | None, batch: GrpoBatch, forced: Tensor | None, cfg: GrpoConfig
) -> Tensor:
    if reference is None:
        raise ValueError("the objective's kl_coef needs a reference policy")
    with torch.no_grad():
        return batch_logprobs(reference, batch, forced, cfg)[0]


def batch_logprobs(
    model: PolicyModel,
    batch: GrpoBatch,
    forced: Tensor | None,
    cfg: GrpoConfig,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``model``'s logprobs of ``batch`` ``[B, T]`` (and entropies when asked) and routes
    ``[B, T - 1, L, K]`` in the padded layout, computed on packed rows when
    ``cfg.pack_tokens`` (``trainer.packing``) and on the padded batch otherwise."""
    if not cfg.pack_tokens:
        if with_entropy:
            return sequence_logprobs_entropy(model, batch.tokens, forced, cfg.temperature)
        logp, routes = sequence_logprobs(model, batch.tokens, forced, cfg.temperature)
        return logp, None, routes
    if batch.lengths is None:
        raise ValueError("packing needs the batch's lengths (grpo.make_batch sets them)")
    p = packing.pack(batch.tokens, batch.routes, batch.lengths, cfg.pack_tokens)
    p_forced = p.routes if forced is not None else None
    entropy = None
    if with_entropy:
        logp, ent, routes = sequence_logprobs_entropy(
            model, p.tokens, p_forced, cfg.temperature, p.positions
        )
        entropy = packing.unpack(ent, p)
    else:
        logp, routes = sequence_logprobs(model, p.tokens, p_forced, cfg.temperature, p.positions)
    return packing.unpack(logp, p), entropy, packing.unpack_routes(routes, p)


def _route_mismatch(batch: GrpoBatch, routes: Tensor) -> float:
    """Fraction of the generated tokens' inputs whose recomputed experts differ from the
    recorded ones (where they were recorded)."""
    with torch.no_grad():
        recorded = batch.routes[:, :-1]
        inputs_mask = batch.loss_mask[:, 1:] > 0
        if recorded.shape[2] > 0:
            inputs_mask = inputs_mask & (recorded[..., 0, 0] >= 0)
            differs = (routes != recorded).flatten(2).any(-1)
        else:
            differs = torch.zeros_like(inputs_mask)
        return float(differs[inputs_mask].float().mean()) if inputs_mask.any() else 0.0


def grpo_version(
    model: PolicyModel,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[GrpoBatch],
    cfg: GrpoConfig,
    loss_cfg: obj.LossConfig | None = None,
    weigh: Callable[[float, bool], tuple[float, bool]] | None = None,
    reference: PolicyModel | None = None,
) -> dict[str, float]:
    """One version's optimizer steps, one per batch (minibatch) in order; returns their
    statistics merged (``tokens`` summed, the others averaged weighted by tokens).

    Rule: with several batches and an objective that uses a proximal policy, every batch's
    ``proximal_logprobs`` are computed first, with the weights before the version's first
    step (one batch: the proximal is the current weights, detached, in the objective)."""
    if isinstance(loss_cfg, obj.DecoupledPPO) and len(batches) > 1:
        with torch.no_grad():
            for b in batches:
                forced = b.routes if cfg.router_replay and b.routes.shape[2] > 0 else None
                b.proximal_logprobs = batch_logprobs(model, b, forced, cfg)[0]
    steps = [grpo_step(model, optimizer, b, cfg, weigh, loss_cfg, reference) for b in batches]
    return merge_stats(steps)


def merge_stats(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Token-weighted means of the steps' statistics; ``tokens`` summed, ``minibatches`` counted."""
    total = sum(s["tokens"] for s in steps) or 1.0
    keys = {k for s in steps for k in s} - {"tokens"}
    out = {k: sum(s.get(k, 0.0) * s["tokens"] for s in steps) / total for k in sorted(keys)}
    out.update(tokens=sum(s["tokens"] for s in steps), minibatches=float(len(steps)))
    return out


def _whole(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (the gradient norm of sharded parameters is a ``DTensor``)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t

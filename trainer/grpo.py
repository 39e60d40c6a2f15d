"""GRPO as pure rules plus one optimizer step with router replay.

The rules (each one a function with its rule in the docstring, unit tested):

- advantages are group-normalised: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the
  population std; a group whose rewards are all equal carries no signal and gets all zeros;
- the off-policy gap (staleness, inference precision) is corrected by truncated importance
  weights ``w = min(exp(logp_cur - logp_behaviour), C)``, treated as constants;
- the loss is token-level: ``-sum(mask * w * A * logp_cur) / sum(mask)`` over every policy-
  generated token of the batch (prompt, tool output and padding are masked out), so long and
  short samples weigh by their tokens;
- ``grpo_step`` recomputes current logprobs with router replay (the batch's recorded experts are
  forced), so the gradient follows exactly the experts that produced each token, and takes one
  optimizer step. It is deterministic on CPU for the same weights, batch and optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlstream.rollout.model import PolicyModel, sequence_logprobs
from rlstream.schemas.errors import RlstreamError
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


def truncated_is_weights(logp_cur: Tensor, logp_behaviour: Tensor, cap: float) -> Tensor:
    """Rule: ``min(exp(logp_cur - logp_behaviour), cap)``, detached (a coefficient, not a path)."""
    return torch.exp(logp_cur.detach() - logp_behaviour).clamp(max=cap)


def policy_gradient_loss(
    logp_cur: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cap: float,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level truncated-IS policy-gradient loss.

    Rule: ``-sum(mask * w * A * logp_cur) / max(sum(mask), 1)`` with ``w`` from
    :func:`truncated_is_weights` and ``A`` the sample's advantage broadcast over its tokens.
    Shapes: logprobs and mask ``[B, T]``, advantages ``[B]``.
    """
    mask = loss_mask.float()
    n_tokens = mask.sum().clamp(min=1.0)
    weights = truncated_is_weights(logp_cur, logp_behaviour, cap)
    loss = -(mask * weights * advantages[:, None] * logp_cur).sum() / n_tokens
    with torch.no_grad():
        raw = torch.exp(logp_cur - logp_behaviour)
        stats = {
            "tokens": float(mask.sum()),
            "is_weight_mean": float((mask * weights).sum() / n_tokens),
            "is_truncated_frac": float((mask * (raw > cap).float()).sum() / n_tokens),
            "logprob_mae": float((mask * (logp_cur - logp_behaviour).abs()).sum() / n_tokens),
            "approx_kl": float((mask * (logp_behaviour - logp_cur)).sum() / n_tokens),
        }
    return loss, stats


@dataclass
class GrpoBatch:
    """Right-padded training sequences, aligned position by position.

    ``tokens`` ``[B, T]`` int64; ``behaviour_logprobs`` ``[B, T]`` float32 (0 where not
    generated); ``loss_mask`` ``[B, T]`` float32; ``routes`` ``[B, T, L, K]`` int64;
    ``advantages`` ``[B]`` float32.
    """

    tokens: Tensor
    behaviour_logprobs: Tensor
    loss_mask: Tensor
    routes: Tensor
    advantages: Tensor


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
    return GrpoBatch(
        tokens, logp, mask, routes, torch.tensor(list(advantages), dtype=torch.float32)
    )


class NonFiniteStep(RlstreamError, ArithmeticError):
    """A step's loss or gradient is not finite; no update was made."""


def grpo_step(
    model: PolicyModel,
    optimizer: torch.optim.Optimizer,
    batch: GrpoBatch,
    cfg: GrpoConfig,
    weigh: Callable[[float, bool], tuple[float, bool]] | None = None,
) -> dict[str, float]:
    """One GRPO update on ``batch``; returns statistics of the step.

    Rule: recompute ``logp_cur`` in the model's (training) precision, replaying the batch's
    recorded experts when ``cfg.router_replay``; take the token-level truncated-IS loss, clip the
    gradient norm to ``cfg.max_grad_norm`` and step the optimizer once, unless the loss or the
    gradient norm is not finite: then raise ``NonFiniteStep`` with the weights and the optimizer
    untouched. Samples whose advantage
    is 0 contribute no gradient but still count their tokens in the denominator. With
    ``weigh`` (data-parallel ranks, ``trainer.distributed.Ranks.weigh``) it is called before the
    backward pass with this batch's loss-token count and whether its loss is finite, and
    returns the factor of this rank's loss and whether every rank's loss is finite: the step is
    refused on every rank together, and the backward pass (whose gradients the ranks reduce)
    takes the weighted loss.
    """
    model.train()
    replay = cfg.router_replay and batch.routes.shape[2] > 0
    forced = batch.routes if replay else None
    logp_cur, routes = sequence_logprobs(model, batch.tokens, forced, cfg.temperature)
    loss, stats = policy_gradient_loss(
        logp_cur, batch.behaviour_logprobs, batch.advantages, batch.loss_mask, cfg.is_cap
    )
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
    with torch.no_grad():
        # routes of the inputs that produced the tokens, where they were recorded
        recorded = batch.routes[:, :-1]
        inputs_mask = batch.loss_mask[:, 1:] > 0
        if recorded.shape[2] > 0:
            inputs_mask = inputs_mask & (recorded[..., 0, 0] >= 0)
            differs = (routes != recorded).flatten(2).any(-1)
        else:
            differs = torch.zeros_like(inputs_mask)
        mismatch = float(differs[inputs_mask].float().mean()) if inputs_mask.any() else 0.0
    stats.update(loss=float(loss.detach()), grad_norm=float(grad_norm), route_mismatch=mismatch)
    return stats


def _whole(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (the gradient norm of sharded parameters is a ``DTensor``)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t

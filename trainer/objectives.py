"""The learner's objectives: typed configs (``learner.loss``) and the pure rules they name.

Every rule takes per-token tensors, all ``[B, T]`` and aligned position by position (one row per
replayable context): ``logp_cur`` (the model being trained, with its gradient), ``logp_behaviour``
(what the sampler recorded), ``logp_proximal`` (the weights before this version's first optimizer
step, no gradient), the per-row advantage ``[B]`` and the loss mask (1 on policy-generated
tokens). Nothing here knows where a token came from, so per-token behaviour versions (partial
rollouts) plug in unchanged. Ratios are taken in log space, ``r = exp(logp_a - logp_b)``.

- ``tis`` (the default): ``-sum(mask * min(r_beh, C) * A * logp_cur) / sum(mask)``, weight detached;
- ``decoupled_ppo`` (AReaL): ``r = exp(logp_cur - logp_prox)``, ``w = min(exp(logp_prox -
  logp_beh), C)`` detached, ``-sum(mask * w * min(r A, clip(r, 1-eps_lo, 1+eps_hi) A)) / sum(mask)``;
- ``gspo``: per row ``s = exp(sum(mask (logp_cur - logp_beh)) / sum(mask))``, ``-mean_rows(min(s A,
  clip(s, 1-eps_lo, 1+eps_hi) A))`` over the rows with a generated token;
- ``cispo``: ``w = clip(r_beh, 1-eps_lo, 1+eps_hi)`` detached, ``-sum(mask * w * A * logp_cur) /
  sum(mask)``: every token keeps its gradient, only its weight is bounded;
- ``masked_is`` (MIS / IcePop): ``keep = low <= r_beh <= high``, ``-sum(mask * keep * r_beh * A *
  logp_cur) / sum(mask)`` (``r_beh`` detached): tokens out of the band are dropped, not clipped;
- each objective adds ``kl_coef * sum(mask * k) / sum(mask)`` against a reference policy with
  ``k1 = logp_cur - logp_ref`` or ``k3 = exp(logp_ref - logp_cur) - (logp_ref - logp_cur) - 1``,
  and subtracts ``entropy_coef * sum(mask * H) / sum(mask)``;
- over-long samples (their last generated token is not an end token: the token budget cut them)
  get advantage 0 (``mask``: no policy gradient, their tokens still count in the denominator) or
  a soft length penalty on the reward before the group's advantages (``penalty``, DAPO's): ``0`` up to ``max_len - soft``, then ``(max_len - soft - len) / soft``,
  ``-1`` once cut;
- ``minibatches`` > 1 splits a version's groups into that many optimizer steps, for the objectives
  with a trust region (all but ``tis``); ``decoupled_ppo``'s proximal is then the weights before
  the version's first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlstream.trainer.config import (
    CISPO,
    GSPO,
    OBJECTIVES,
    DecoupledPPO,
    LossConfig,
    MaskedIS,
    Overlong,
    TruncatedIS,
)

__all__ = [
    "CISPO",
    "GSPO",
    "OBJECTIVES",
    "DecoupledPPO",
    "LossConfig",
    "MaskedIS",
    "Overlong",
    "TruncatedIS",
]  # the configs live with the other settings (no torch); the rules here name them


@dataclass
class TokenTerms:
    """The per-token inputs of an objective (see the module docstring for shapes)."""

    logp_cur: Tensor
    logp_behaviour: Tensor
    advantages: Tensor
    mask: Tensor
    logp_proximal: Tensor | None = None
    logp_ref: Tensor | None = None
    entropy: Tensor | None = None


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (mask * values).sum() / mask.sum().clamp(min=1.0)


def truncated_is_weights(logp_cur: Tensor, logp_behaviour: Tensor, cap: float) -> Tensor:
    """Rule: ``min(exp(logp_cur - logp_behaviour), cap)``, detached (a coefficient, not a path)."""
    return torch.exp(logp_cur.detach() - logp_behaviour).clamp(max=cap)


def tis_loss(t: TokenTerms, cap: float) -> tuple[Tensor, Tensor]:
    """``-sum(mask * min(r_beh, C) * A * logp_cur) / sum(mask)``; returns (loss, clipped)."""
    w = truncated_is_weights(t.logp_cur, t.logp_behaviour, cap)
    loss = -_masked_mean(w * t.advantages[:, None] * t.logp_cur, t.mask)
    return loss, (torch.exp(t.logp_cur.detach() - t.logp_behaviour) > cap)


def decoupled_ppo_loss(t: TokenTerms, cfg: DecoupledPPO) -> tuple[Tensor, Tensor]:
    """``-sum(mask * w * min(r A, clip(r, 1-eps_lo, 1+eps_hi) A)) / sum(mask)`` with ``r =
    exp(logp_cur - logp_prox)`` and ``w = min(exp(logp_prox - logp_beh), cap)`` detached.
    Without a proximal (one step per version) the proximal is ``logp_cur`` detached."""
    prox = t.logp_proximal if t.logp_proximal is not None else t.logp_cur.detach()
    w = torch.exp(prox - t.logp_behaviour).clamp(max=cfg.cap)
    ratio = torch.exp(t.logp_cur - prox)
    adv = t.advantages[:, None]
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    active = (ratio.detach() * adv != surrogate.detach()) & (adv != 0)
    return -_masked_mean(w * surrogate, t.mask), active


def gspo_loss(t: TokenTerms, cfg: GSPO) -> tuple[Tensor, Tensor]:
    """``s = exp(sum(mask (logp_cur - logp_beh)) / sum(mask))`` per row; ``-mean(min(s A,
    clip(s) A))`` over rows with a generated token. ``clipped`` marks the tokens of clipped rows."""
    n = t.mask.sum(dim=1)
    rows = n > 0
    log_s = (t.mask * (t.logp_cur - t.logp_behaviour)).sum(dim=1) / n.clamp(min=1.0)
    s = torch.exp(log_s)
    clipped = s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    surrogate = torch.minimum(s * t.advantages, clipped * t.advantages)
    loss = -(surrogate * rows).sum() / rows.sum().clamp(min=1)
    active = (s.detach() * t.advantages != surrogate.detach()) & (t.advantages != 0)
    return loss, active[:, None].expand_as(t.mask)


def cispo_loss(t: TokenTerms, cfg: CISPO) -> tuple[Tensor, Tensor]:
    """``-sum(mask * sg(clip(r_beh, 1-eps_lo, 1+eps_hi)) * A * logp_cur) / sum(mask)``."""
    raw = torch.exp(t.logp_cur.detach() - t.logp_behaviour)
    w = raw.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = -_masked_mean(w * t.advantages[:, None] * t.logp_cur, t.mask)
    return loss, w != raw


def masked_is_loss(t: TokenTerms, cfg: MaskedIS) -> tuple[Tensor, Tensor]:
    """``-sum(mask * keep * sg(r_beh) * A * logp_cur) / sum(mask)``, ``keep = low <= r <= high``
    (the denominator keeps the masked tokens: dropping a token never scales up the others)."""
    raw = torch.exp(t.logp_cur.detach() - t.logp_behaviour)
    keep = (raw >= cfg.low) & (raw <= cfg.high)
    loss = -_masked_mean(keep * raw * t.advantages[:, None] * t.logp_cur, t.mask)
    return loss, ~keep


def kl_per_token(logp_cur: Tensor, logp_ref: Tensor, estimator: str) -> Tensor:
    """``k1 = logp_cur - logp_ref``; ``k3 = exp(logp_ref - logp_cur) - (logp_ref - logp_cur) - 1``."""
    if estimator == "k1":
        return logp_cur - logp_ref
    d = logp_ref - logp_cur
    return torch.exp(d) - d - 1


def objective(cfg: LossConfig, t: TokenTerms) -> tuple[Tensor, dict[str, float]]:
    """The loss of ``cfg`` on ``t`` (policy term + KL - entropy bonus) and its statistics."""
    if isinstance(cfg, TruncatedIS):
        loss, clipped = tis_loss(t, cfg.cap)
    elif isinstance(cfg, DecoupledPPO):
        loss, clipped = decoupled_ppo_loss(t, cfg)
    elif isinstance(cfg, GSPO):
        loss, clipped = gspo_loss(t, cfg)
    elif isinstance(cfg, CISPO):
        loss, clipped = cispo_loss(t, cfg)
    else:
        loss, clipped = masked_is_loss(t, cfg)
    stats = _stats(t, clipped)
    if cfg.kl_coef > 0:
        if t.logp_ref is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        kl = _masked_mean(kl_per_token(t.logp_cur, t.logp_ref, cfg.kl_estimator), t.mask)
        loss = loss + cfg.kl_coef * kl
        stats["kl_ref"] = float(kl.detach())
    if cfg.entropy_coef > 0:
        if t.entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        ent = _masked_mean(t.entropy, t.mask)
        loss = loss - cfg.entropy_coef * ent
        stats["entropy"] = float(ent.detach())
    return loss, stats


def _stats(t: TokenTerms, clipped: Tensor) -> dict[str, float]:
    with torch.no_grad():
        mask = t.mask.float()
        diff = t.logp_cur - t.logp_behaviour
        raw = torch.exp(diff)
        return {
            "tokens": float(mask.sum()),
            "is_weight_mean": float(_masked_mean(raw, mask)),
            "clip_frac": float(_masked_mean(clipped.float(), mask)),
            "logprob_mae": float(_masked_mean(diff.abs(), mask)),
            "approx_kl": float(_masked_mean(-diff, mask)),
            "kl_behaviour": float(
                _masked_mean(kl_per_token(t.logp_cur, t.logp_behaviour, "k3"), mask)
            ),
        }


def policy_gradient_loss(
    logp_cur: Tensor, logp_behaviour: Tensor, advantages: Tensor, loss_mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """The default objective (``tis`` with cap ``cap``) on plain tensors."""
    terms = TokenTerms(logp_cur, logp_behaviour, advantages, loss_mask.float())
    return objective(TruncatedIS(cap=cap), terms)


def overlong_rewards(
    rewards: Sequence[float], lengths: Sequence[int], cut: Sequence[bool], cfg: Overlong
) -> tuple[np.ndarray, np.ndarray]:
    """(rewards, keep) of a group under ``cfg``: ``mask`` keeps no cut sample (the caller
    multiplies its advantage by ``keep``);
    ``penalty`` adds ``min(0, (max_len - soft - len) / soft)`` (``-1`` when cut) to the reward."""
    r = np.asarray(rewards, dtype=np.float64).copy()
    keep = np.ones(len(r), dtype=bool)
    cut_a = np.asarray(cut, dtype=bool)
    if cfg.mode == "mask":
        keep &= ~cut_a
    elif cfg.mode == "penalty":
        n = np.asarray(lengths, dtype=np.float64)
        pen = np.minimum(0.0, (cfg.max_len - cfg.soft - n) / cfg.soft)
        r += np.where(cut_a, -1.0, np.maximum(pen, -1.0))
    return r, keep


def is_cut(token_ids: np.ndarray, loss_mask: np.ndarray, end_ids: Sequence[int]) -> bool:
    """Whether a sample was cut by the token budget: its last generated token is no end token."""
    generated = np.flatnonzero(loss_mask)
    return bool(generated.size) and int(token_ids[generated[-1]]) not in set(end_ids)

"""The policy contract every role relies on, and the helpers that work on any policy.

The policy itself is a Hugging Face transformers causal LM (Qwen3-MoE) behind this contract:
:class:`rlstream.rollout.hf_policy.HFPolicy` (``PolicyModel``). Rules guaranteed here:

- ``forward(tokens, forced_routes=None, cache=None)`` returns ``(logits, routes)``;
  ``routes[b, t, l]`` are the ``top_k`` experts that processed token ``t`` in MoE layer ``l``
  (int64, ``[B, T, L, K]``).
- Router replay: with ``forced_routes`` the layer uses exactly those experts; the gate weights are
  the router's softmax restricted to them (renormalised as the model's own routing does), so no
  gradient reaches an expert that did not process the token. A token whose forced routes are -1
  (recorded without routes) is routed by the router itself.
- ``generate`` samples a batch (the G samples of a group share one prompt) with a KV cache and
  records, for every token fed through the model (prompt and generated), the experts used, and for
  every generated token its behaviour logprob (float32, under the sampling temperature) and, when
  asked (``top_n``), the ``top_n`` most likely tokens of the same distribution. It can
  run a reduced-precision copy of the weights (bf16), as rollout inference does at scale, while the
  learner runs fp32: numerics then differ, and router replay is what keeps the experts identical.
- Deterministic on CPU given the seed (weights) and the ``torch.Generator`` (sampling).
- ``state_dict()`` holds plain tensors only (the weight-delta codec ships them).
- ``build_policy`` is the one factory every role uses; ``generate``, ``sequence_logprobs``,
  ``clone_policy`` and ``inference_copy`` take any ``PolicyModel``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.policy_parts import KVCache as KVCache  # the contract's, re-exported
from rlstream.rollout.policy_parts import load_balance_loss as load_balance_loss

if TYPE_CHECKING:
    from rlstream.rollout.hf_policy import HFPolicy


PolicyModel: TypeAlias = "HFPolicy"
"""The policy type: keeps this module's contract (forward, routes, cache, load balance)."""

PolicyT = TypeVar("PolicyT", bound="HFPolicy")


def build_policy(cfg: PolicyConfig) -> PolicyModel:
    """A policy of ``cfg.architecture``: freshly initialised (weights depend only on ``cfg``), or,
    with ``hf_dir``, that directory's weights (as float32)."""
    from rlstream.rollout.hf_policy import policy_from_config  # transformers imports slowly

    return policy_from_config(cfg)


def clone_policy(model: PolicyT) -> PolicyT:
    """A deep copy of ``model`` (weights and config; not the last forward's router state)."""
    saved, model.last_router_probs = model.last_router_probs, []
    try:
        return copy.deepcopy(model)
    finally:
        model.last_router_probs = saved


def inference_copy(model: PolicyT, dtype: torch.dtype) -> PolicyT:
    """A detached copy of ``model`` in ``dtype`` for rollout inference (bf16 at scale)."""
    dup = clone_policy(model)
    dup.requires_grad_(False)
    dup.to(dtype).eval()  # in place: Module.to and eval return the module itself
    return dup


@dataclass
class Generation:
    """Result of :func:`generate` for a batch of B rows.

    ``tokens``/``logprobs`` ``[B, N]`` hold the generated tokens (padded after each row's
    ``lengths[b]``); ``routes`` ``[B, P + N, L, K]`` are the experts that processed each fed token,
    prompt included; ``cache`` holds keys/values of all fed tokens (rows padded likewise).
    ``top_ids``/``top_logprobs`` ``[B, N, top_n]`` are the most likely tokens at each step and
    their logprobs, most likely first (``top_n`` = 0 when not asked). ``versions`` ``[B, P + N]``
    (int64), when the generator was given a version gate, is the policy version whose weights
    processed each fed token and sampled each generated token (None: one version, the caller's).
    """

    tokens: Tensor
    logprobs: Tensor
    routes: Tensor
    lengths: Tensor
    stopped: Tensor
    cache: KVCache
    prompt_len: int
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None
    versions: Tensor | None = None
    cut: Tensor | None = None  # bool [B]: rows stopped early by ``stop`` (None: none was)


VersionCheck: TypeAlias = Callable[[], int]
"""Called between two forward passes: swaps newer weights into the model in place if there are
any, and returns the version of the weights the next forward pass runs."""


@torch.no_grad()
def generate(
    model: PolicyModel,
    prompt_tokens: Tensor,
    max_new: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    stop_ids: tuple[int, ...] = (),
    cache: KVCache | None = None,
    pad_id: int = 0,
    greedy: bool = False,
    top_n: int = 0,
    gate: VersionCheck | None = None,
    stop: Callable[[], bool] | None = None,
) -> Generation:
    """Sample up to ``max_new`` tokens per row after ``prompt_tokens`` ``[B, P]``.

    Rule: a row stops after emitting a token in ``stop_ids`` (kept) or after ``max_new`` tokens.
    The behaviour logprob of a token is ``log_softmax(logits / temperature)`` at that token, in
    float32. Every generated token is also fed through the model once more, so its routes are
    recorded and the cache is ready for a continuation. ``dtype`` casts a copy of the weights
    (e.g. ``torch.bfloat16``); ``cache`` continues an earlier sequence. ``greedy`` takes the
    most likely token instead of sampling (temperature 0; ties go to the lowest id). ``top_n``
    also records the ``top_n`` most likely tokens of each step's distribution (what an
    OpenAI-style ``logprobs`` answer lists); it changes nothing that is sampled. ``gate`` is
    asked before every forward pass (weights may be swapped there, in place: generation goes on
    with the KV cache of the tokens already fed) and ``versions`` records its answers: a token
    is attributed to the forward pass whose logits sampled it, a fed token to the one that fed it.
    ``stop`` is asked before every sampling step: once it answers True, generation ends there and
    ``cut`` marks the rows that had neither stopped nor used up ``max_new`` (every token already
    sampled was fed, so the cache holds them: a caller may checkpoint and resume the rows).
    """
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model = inference_copy(model, dtype)
    cache = cache if cache is not None else KVCache.empty(model.cfg.n_layers)
    room = model.cfg.max_seq_len - cache.length - prompt_tokens.shape[1]
    max_new = max(0, min(max_new, room))
    b = prompt_tokens.shape[0]
    version = gate() if gate is not None else -1
    versions = [version] * prompt_tokens.shape[1]
    logits, routes = model(prompt_tokens, cache=cache)
    all_routes, toks, lps, tops = [routes], [], [], []
    lengths = torch.zeros(b, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    stops = torch.tensor(stop_ids, dtype=torch.long)
    cut = None
    for _ in range(max_new):
        if stop is not None and stop():
            cut = ~done
            break
        logp = (logits[:, -1] / max(temperature, 1e-6)).log_softmax(dim=-1)
        if greedy:
            nxt = logp.argmax(dim=-1)
        else:
            nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        toks.append(nxt)
        lps.append(torch.where(done, 0.0, logp.gather(1, nxt[:, None]).squeeze(1)))
        if top_n > 0:
            tops.append(logp.topk(min(top_n, logp.shape[-1]), dim=-1))
        lengths += (~done).long()
        done = done | torch.isin(nxt, stops)
        versions.append(version)
        if gate is not None:
            version = gate()
        logits, routes = model(nxt[:, None], cache=cache)
        all_routes.append(routes)
        if bool(done.all()):
            break
    empty = torch.zeros(b, 0)
    return Generation(
        tokens=torch.stack(toks, 1) if toks else empty.long(),
        logprobs=torch.stack(lps, 1).float() if lps else empty,
        routes=torch.cat(all_routes, dim=1),
        lengths=lengths,
        stopped=done,
        cache=cache,
        prompt_len=prompt_tokens.shape[1],
        top_ids=torch.stack([t.indices for t in tops], 1) if tops else None,
        top_logprobs=torch.stack([t.values for t in tops], 1).float() if tops else None,
        versions=None if gate is None else torch.tensor(versions).expand(b, -1).clone(),
        cut=cut,
    )


def sequence_logprobs(
    model: PolicyModel,
    tokens: Tensor,
    forced_routes: Tensor | None = None,
    temperature: float = 1.0,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Logprob of each token given its prefix, ``[B, T]`` (position 0 gets 0), and the routes.

    Rule: ``lp[b, t] = log_softmax(logits[b, t - 1] / temperature)[tokens[b, t]]``; the model runs
    on ``tokens[:, :-1]`` (the last token is never an input), replaying ``forced_routes[:, :-1]``
    when given. Returned routes are ``[B, T - 1, L, K]``. With ``position_ids`` a row holds
    packed sequences (``HFPolicy.forward``); the first token of each gets its predecessor's
    prediction, which the caller discards.
    """
    logp, routes = _next_token_logprobs(model, tokens, forced_routes, temperature, position_ids)
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(picked, (1, 0)), routes


def sequence_logprobs_entropy(
    model: PolicyModel,
    tokens: Tensor,
    forced_routes: Tensor | None = None,
    temperature: float = 1.0,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`sequence_logprobs` plus the entropy of each position's distribution, ``[B, T]``.

    Rule: ``H[b, t] = -sum_v p log p`` of the distribution ``tokens[b, t]`` was drawn from
    (position 0 gets 0), with its gradient.
    """
    logp, routes = _next_token_logprobs(model, tokens, forced_routes, temperature, position_ids)
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0)), routes


def _next_token_logprobs(
    model: PolicyModel,
    tokens: Tensor,
    forced_routes: Tensor | None,
    temperature: float,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``log_softmax(logits / temperature)`` ``[B, T - 1, V]`` of the model run on
    ``tokens[:, :-1]`` (replaying ``forced_routes[:, :-1]``), and its routes."""
    forced = forced_routes[:, :-1] if forced_routes is not None else None
    if position_ids is None:
        logits, routes = model(tokens[:, :-1], forced_routes=forced)
    else:
        logits, routes = model(
            tokens[:, :-1], forced_routes=forced, position_ids=position_ids[:, :-1]
        )
    return (logits / temperature).log_softmax(dim=-1), routes

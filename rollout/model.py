"""A tiny decoder-only MoE transformer: the reference policy for rlstream on CPU.

Rules this module guarantees:

- ``forward(tokens, forced_routes=None)`` returns ``(logits, routes)``; ``routes[b, t, l]`` are the
  ``top_k`` experts that processed token ``t`` in MoE layer ``l`` (int64, ``[B, T, L, K]``).
- Router replay: with ``forced_routes`` the layer uses exactly those experts; the gate weights are
  the router's softmax restricted to them and renormalised (the same formula as free routing), and
  only the chosen experts' outputs are gathered, so no gradient reaches an expert that did not
  process the token. A token whose forced routes are -1 (recorded without routes) is routed by
  the router itself.
- ``generate`` samples a batch (the G samples of a group share one prompt) with a KV cache and
  records, for every token fed through the model (prompt and generated), the experts used, and for
  every generated token its behaviour logprob (float32, under the sampling temperature) and, when
  asked (``top_n``), the ``top_n`` most likely tokens of the same distribution. It can
  run a reduced-precision copy of the weights (bf16), as rollout inference does at scale, while the
  learner runs fp32: numerics then differ, and router replay is what keeps the experts identical.
- Deterministic on CPU given the seed (weights) and the ``torch.Generator`` (sampling).
- ``state_dict()`` holds plain tensors only (the weight-delta codec ships them).
- ``build_policy`` is the one factory every role uses: ``PolicyConfig.architecture`` picks this
  module's ``Policy`` or a transformers model behind the same contract
  (:class:`rlstream.rollout.hf_policy.HFPolicy`); ``generate``, ``sequence_logprobs``,
  ``clone_policy`` and ``inference_copy`` take either (``PolicyModel``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias, TypeVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

if TYPE_CHECKING:
    from rlstream.rollout.hf_policy import HFPolicy


class PolicyConfig(BaseModel):
    """Architecture and shape of the policy network."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Literal["rlstream-moe", "qwen3_moe"] = Field(
        default="qwen3_moe",
        description="`qwen3_moe`: a transformers Qwen3-MoE causal LM (rollout.hf_policy) built "
        "from the shape fields below, or loaded from `hf_dir`; `rlstream-moe`: this module's "
        "homemade MoE (kept for comparison, to be removed).",
    )
    hf_dir: str | None = Field(
        default=None,
        description="Local HF directory to load (qwen3_moe only); its config then decides the "
        "shape and the shape fields below are not used. Never downloaded.",
    )

    vocab_size: int = Field(default=128, ge=2, le=65536, description="Token vocabulary size.")
    max_seq_len: int = Field(default=256, ge=8, le=8192, description="Context window in tokens.")
    d_model: int = Field(default=64, ge=8, le=4096, description="Residual stream width.")
    n_heads: int = Field(
        default=4, ge=1, le=64, description="Attention heads (must divide d_model)."
    )
    n_layers: int = Field(
        default=2, ge=1, le=48, description="Transformer blocks, each with an MoE FFN."
    )
    n_experts: int = Field(
        default=4,
        ge=2,
        le=65536,
        description="Experts per MoE layer (ids are recorded as uint8 up to 256, else uint16).",
    )
    top_k: int = Field(default=2, ge=1, le=8, description="Experts each token is routed to.")
    d_expert: int = Field(
        default=128, ge=4, le=16384, description="Hidden width of one expert MLP."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the weight initialisation.")

    @model_validator(mode="after")
    def _hf_dir_needs_hf(self) -> PolicyConfig:
        if self.hf_dir is not None and self.architecture == "rlstream-moe":
            raise ValueError("hf_dir needs an HF architecture (policy.architecture=qwen3_moe)")
        return self


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


class Attention(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cache: KVCache | None, layer: int) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        past = 0
        if cache is not None:
            past = cache.length
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)  # type: ignore[list-item]
                v = torch.cat([cache.values[layer], v], dim=2)  # type: ignore[list-item]
            cache.keys[layer], cache.values[layer] = k, v
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # query i sits at absolute position past + i and sees keys 0..past + i
            mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MoE(nn.Module):
    """Top-k routed expert MLPs. Experts are stored as stacked tensors ``[E, ...]``."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        scale_in, scale_out = 1 / math.sqrt(cfg.d_model), 1 / math.sqrt(cfg.d_expert)
        self.w_in = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.d_expert) * scale_in)
        self.w_out = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_expert, cfg.d_model) * scale_out)

    def forward(self, x: Tensor, forced: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (output, routes [B, T, K], router probabilities [B, T, E]).

        Every expert is evaluated densely (at this size two batched matmuls beat a per-expert
        dispatch) and the chosen ``top_k`` outputs are gathered: the gather's backward sends
        gradient only to (token, chosen expert) pairs, so an expert's weights receive exactly
        zero gradient from tokens it did not process.
        """
        probs = self.router(x).float().softmax(dim=-1)
        routes = probs.topk(self.top_k, dim=-1).indices
        if forced is not None:  # -1: a token recorded without routes keeps the router's own
            forced = forced.long()
            routes = torch.where(forced[..., :1] < 0, routes, forced)
        gates = probs.gather(-1, routes)
        gates = (gates / gates.sum(dim=-1, keepdim=True)).to(x.dtype)
        b, t, d = x.shape
        flat = x.reshape(1, b * t, d)
        hidden = F.gelu(torch.matmul(flat, self.w_in))  # [E, N, d_expert]
        every = torch.matmul(hidden, self.w_out).transpose(0, 1)  # [N, E, d]
        index = routes.reshape(b * t, self.top_k, 1).expand(-1, -1, d)
        chosen = every.gather(1, index)  # [N, K, d]
        out = (chosen * gates.reshape(b * t, self.top_k, 1)).sum(dim=1)
        return out.view(b, t, d), routes, probs


class Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn, self.moe = Attention(cfg), MoE(cfg)

    def forward(
        self, x: Tensor, cache: KVCache | None, layer: int, forced: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        x = x + self.attn(self.ln1(x), cache, layer)
        y, routes, probs = self.moe(self.ln2(x), forced)
        return x + y, routes, probs


class Policy(nn.Module):
    """Decoder-only MoE transformer with learned positions and tied embeddings."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("n_heads must divide d_model")
        if cfg.top_k > cfg.n_experts:
            raise ValueError("top_k must not exceed n_experts")
        self.cfg = cfg
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)  # weights depend on cfg.seed only, not on global RNG use
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        torch.random.set_rng_state(gen_state)
        self.last_router_probs: list[Tensor] = []

    def forward(
        self, tokens: Tensor, forced_routes: Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor]:
        """Logits ``[B, T, V]`` (float32) and routes ``[B, T, L, K]`` for ``tokens`` ``[B, T]``.

        With ``cache`` the tokens continue the cached sequence (positions start at
        ``cache.length``) and the cache is extended in place.
        """
        t = tokens.shape[1]
        past = cache.length if cache is not None else 0
        if past + t > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {past + t} tokens exceeds max_seq_len")
        x = self.embed(tokens) + self.pos(torch.arange(past, past + t))
        routes, self.last_router_probs = [], []
        for i, block in enumerate(self.blocks):
            forced = forced_routes[:, :, i] if forced_routes is not None else None
            x, r, probs = block(x, cache, i, forced)
            routes.append(r)
            self.last_router_probs.append(probs)
        if cache is not None:
            cache.length = past + t
        logits = F.linear(self.ln_f(x), self.embed.weight).float()
        return logits, torch.stack(routes, dim=2)

    def load_balance_loss(self) -> Tensor:
        """Switch-style auxiliary loss of the last forward (``load_balance_loss``)."""
        return load_balance_loss(self.last_router_probs, self.cfg.top_k)


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


PolicyModel: TypeAlias = "Policy | HFPolicy"
"""Either architecture: both keep this module's contract (forward, routes, cache, load balance)."""

PolicyT = TypeVar("PolicyT", bound="Policy | HFPolicy")


def build_policy(cfg: PolicyConfig) -> PolicyModel:
    """A policy of ``cfg.architecture``: freshly initialised (weights depend only on ``cfg``), or,
    for an HF architecture with ``hf_dir``, that directory's weights (as float32)."""
    if cfg.architecture == "rlstream-moe":
        return Policy(cfg)
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
    their logprobs, most likely first (``top_n`` = 0 when not asked).
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
) -> Generation:
    """Sample up to ``max_new`` tokens per row after ``prompt_tokens`` ``[B, P]``.

    Rule: a row stops after emitting a token in ``stop_ids`` (kept) or after ``max_new`` tokens.
    The behaviour logprob of a token is ``log_softmax(logits / temperature)`` at that token, in
    float32. Every generated token is also fed through the model once more, so its routes are
    recorded and the cache is ready for a continuation. ``dtype`` casts a copy of the weights
    (e.g. ``torch.bfloat16``); ``cache`` continues an earlier sequence. ``greedy`` takes the
    most likely token instead of sampling (temperature 0; ties go to the lowest id). ``top_n``
    also records the ``top_n`` most likely tokens of each step's distribution (what an
    OpenAI-style ``logprobs`` answer lists); it changes nothing that is sampled.
    """
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model = inference_copy(model, dtype)
    cache = cache if cache is not None else KVCache.empty(model.cfg.n_layers)
    room = model.cfg.max_seq_len - cache.length - prompt_tokens.shape[1]
    max_new = max(0, min(max_new, room))
    b = prompt_tokens.shape[0]
    logits, routes = model(prompt_tokens, cache=cache)
    all_routes, toks, lps, tops = [routes], [], [], []
    lengths = torch.zeros(b, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    stops = torch.tensor(stop_ids, dtype=torch.long)
    for _ in range(max_new):
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
    )


def sequence_logprobs(
    model: PolicyModel,
    tokens: Tensor,
    forced_routes: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Logprob of each token given its prefix, ``[B, T]`` (position 0 gets 0), and the routes.

    Rule: ``lp[b, t] = log_softmax(logits[b, t - 1] / temperature)[tokens[b, t]]``; the model runs
    on ``tokens[:, :-1]`` (the last token is never an input), replaying ``forced_routes[:, :-1]``
    when given. Returned routes are ``[B, T - 1, L, K]``.
    """
    forced = forced_routes[:, :-1] if forced_routes is not None else None
    logits, routes = model(tokens[:, :-1], forced_routes=forced)
    logp = (logits / temperature).log_softmax(dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(picked, (1, 0)), routes

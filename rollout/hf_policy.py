"""A Hugging Face transformers causal LM as the rlstream policy, with MoE router replay.

``HFPolicy`` wraps a transformers causal LM (Qwen3-MoE first) and keeps the policy contract of
:mod:`rlstream.rollout.model`, so ``generate``, ``sequence_logprobs``, the harness and GRPO take it.

Rules a maintainer must keep:
- without ``forced_routes`` the output is exactly the unwrapped model's, and forcing a block's
  own routes reproduces it bit for bit (router replay);
- the MoE blocks keep transformers' submodules and names, so ``save_hf`` writes an ordinary HF
  directory;
- tied weights are held once in ``state_dict()``;
- LoRA adapters stay adapters (never merged in memory), so a delta carries adapter bytes only;
- an instance runs one forward at a time; nothing is downloaded.

Details: docs/models.md (The Hugging Face policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
)
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from rlstream.envs import protocol
from rlstream.rollout.config import LoraConfig, PolicyConfig
from rlstream.rollout.policy_parts import KVCache, load_balance_loss
from rlstream.rollout.text import PolicyText, char_tokenizer, with_protocol_tags

# ---------------------------------------------------------------- config


def tiny_qwen3_moe_config(
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    n_experts: int = 8,
    top_k: int = 2,
    d_expert: int = 32,
    max_seq_len: int = 256,
    vocab_size: int = protocol.VOCAB_SIZE,
    head_dim: int | None = None,
) -> Qwen3MoeConfig:
    """A small Qwen3-MoE config for the CPU demo: every layer sparse, tied embeddings; heads
    ``d_model / n_heads`` wide unless ``head_dim`` says otherwise."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=4 * d_model,  # dense MLP width, unused while every layer is sparse
        moe_intermediate_size=d_expert,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=True,
        pad_token_id=protocol.PAD,
        bos_token_id=protocol.BOS,
        eos_token_id=protocol.EOS,
    )
    if head_dim is not None:  # else the modules derive it (an explicit None would break them)
        config.head_dim = head_dim
    return config


def tiny_llama_config(
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_mlp: int = 128,
    max_seq_len: int = 256,
    vocab_size: int = protocol.VOCAB_SIZE,
    head_dim: int | None = None,
) -> LlamaConfig:
    """A small dense Llama config (no router), tied embeddings, the protocol's special ids."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=d_mlp,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=True,
        pad_token_id=protocol.PAD,
        bos_token_id=protocol.BOS,
        eos_token_id=protocol.EOS,
    )
    if head_dim is not None:
        config.head_dim = head_dim
    return config


# ---------------------------------------------------------------- router replay


class ReplayMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen3-MoE sparse block that records its routes and can be forced to given experts.

    It owns the original block's ``gate`` (router) and ``experts`` modules under the same names.
    ``forced`` (``[B, T, K]``, set by :class:`HFPolicy` around one forward) replaces the router's
    top-k; ``routes`` ``[B, T, K]`` and ``probs`` ``[B, T, E]`` (float32 router softmax) hold the
    last forward's choice until the policy collects them.
    """

    def __init__(self, block: Qwen3MoeSparseMoeBlock) -> None:
        nn.Module.__init__(self)  # adopt the block's submodules instead of building new ones
        self.experts = block.experts
        self.gate = block.gate
        self.forced: Tensor | None = None
        self.routes: Tensor | None = None
        self.probs: Tensor | None = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        b, t, d = hidden_states.shape
        flat = hidden_states.reshape(-1, d)
        probs = F.linear(flat, self.gate.weight).softmax(dim=-1, dtype=torch.float32)
        _, weights, routes = self.gate(flat)  # always run: transformers' router hooks see it
        if self.forced is not None:
            forced = self.forced.reshape(b * t, -1).long()
            free = forced[:, :1] < 0  # a token recorded without routes keeps the router's own
            routes = torch.where(free, routes, forced)
            chosen = probs.gather(-1, routes)
            if self.gate.norm_topk_prob:
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            weights = chosen.to(hidden_states.dtype)
        out = self.experts(flat, routes, weights)
        self.routes, self.probs = routes.view(b, t, -1), probs.view(b, t, -1)
        return out.reshape(b, t, d)


def _install_replay(lm: nn.Module) -> list[ReplayMoeBlock]:
    """Swap every sparse MoE block of ``lm`` for a ``ReplayMoeBlock``; the blocks in order."""
    blocks: list[ReplayMoeBlock] = []
    for name, module in list(lm.named_modules()):
        if isinstance(module, ReplayMoeBlock):
            blocks.append(module)
        elif isinstance(module, Qwen3MoeSparseMoeBlock):
            parent, _, child = name.rpartition(".")
            blocks.append(ReplayMoeBlock(module))
            setattr(lm.get_submodule(parent), child, blocks[-1])
    return blocks


# ---------------------------------------------------------------- the policy


@dataclass(frozen=True)
class PolicyShape:
    """What callers read from ``model.cfg`` (the fields ``PolicyConfig`` shares)."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int  # MoE blocks: the L of routes [B, T, L, K]
    n_experts: int
    top_k: int


class HFPolicy(nn.Module):
    """A transformers causal LM behind the policy contract (see the module docstring).

    Its children are the wrapped model's children (``model``, ``lm_head``), so its parameter
    names are transformers' own. The wrapped model stays reachable as ``hf`` for saving; wrapping
    swaps its MoE blocks in place (free-routing behaviour unchanged). A dense model (no router)
    has no routes: ``cfg.n_layers``, ``n_experts`` and ``top_k`` are 0 and routes ``[B, T, 0, 0]``.
    """

    hf: PreTrainedModel

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        blocks = _install_replay(lm)
        for name, child in lm.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf", lm)  # not registered: its children already are
        self._blocks = blocks  # a plain list: the blocks are registered through `model`
        config = lm.config
        self.cfg = PolicyShape(
            vocab_size=config.vocab_size,
            max_seq_len=config.max_position_embeddings,
            d_model=config.hidden_size,
            n_layers=len(blocks),
            n_experts=blocks[0].gate.num_experts if blocks else 0,
            top_k=blocks[0].gate.top_k if blocks else 0,
        )
        self.n_decoder_layers = int(config.num_hidden_layers)
        self.text = PolicyText.chars()  # load_hf sets the directory's own
        self.last_router_probs: list[Tensor] = []
        every = dict(self.named_parameters(remove_duplicate=False))
        self.tied_keys = frozenset(every) - frozenset(dict(self.named_parameters()))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.state_dict`` without the tied duplicates (``tied_keys``)."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        for key in self.tied_keys:
            state.pop(prefix + key, None)
        return state

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, where a missing tied duplicate is no error (loading the
        tensor under its first name loads both)."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        result.missing_keys[:] = [k for k in result.missing_keys if k not in self.tied_keys]
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"error loading state into {type(self).__name__}: missing keys "
                f"{result.missing_keys}, unexpected keys {result.unexpected_keys}"
            )
        return result

    @property
    def config(self) -> Any:
        return self.hf.config

    def shard_units(self) -> list[nn.Module]:
        """The modules a data-parallel learner shards one by one (FSDP2 units,
        ``trainer.distributed.Ranks.adopt``): the decoder layers, in order."""
        return list(self.hf.model.layers)

    def forward(
        self,
        tokens: Tensor,
        forced_routes: Tensor | None = None,
        cache: KVCache | None = None,
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Logits ``[B, T, V]`` (float32) and routes ``[B, T, L, K]`` for ``tokens`` ``[B, T]``.

        With ``cache`` the tokens continue the cached sequence (positions start at
        ``cache.length``) and the cache is extended in place. With ``position_ids`` ``[B, T]``
        (no cache) each row may hold several packed sequences: a position that does not follow
        its predecessor (0 after anything) starts a new one, and attention never crosses
        sequences (transformers' packed-sequence causal mask).
        """
        b, t = tokens.shape
        past = cache.length if cache is not None else 0
        if past + t > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {past + t} tokens exceeds max_seq_len")
        self._check_forced(forced_routes, b, t)
        hf_cache = self._to_hf_cache(cache) if cache is not None else None
        for i, block in enumerate(self._blocks):
            block.forced = forced_routes[:, :, i] if forced_routes is not None else None
        try:
            # cache goes by position: transformers 5 renamed the keyword (past_key_values, cache)
            out = self.hf(tokens, None, position_ids, hf_cache, use_cache=hf_cache is not None)
            routes = (
                torch.stack([blk.routes for blk in self._blocks], dim=2)  # type: ignore[misc]
                if self._blocks
                else torch.zeros(b, t, 0, 0, dtype=torch.long)  # a dense model: no router
            )
            self.last_router_probs = [blk.probs for blk in self._blocks]  # type: ignore[misc]
        finally:
            for block in self._blocks:  # no tensors left on modules: deepcopy must work
                block.forced = block.routes = block.probs = None
        if cache is not None and hf_cache is not None:
            for i, (keys, values, _) in enumerate(hf_cache):
                cache.keys[i], cache.values[i] = keys, values
            cache.length = past + t
        return out.logits.float(), routes

    def _check_forced(self, forced: Tensor | None, b: int, t: int) -> None:
        if forced is None:
            return
        want = (b, t, self.cfg.n_layers, self.cfg.top_k)
        if tuple(forced.shape) != want:
            raise ValueError(f"forced_routes must have shape {want}, got {tuple(forced.shape)}")
        if forced.numel() and (int(forced.min()) < -1 or int(forced.max()) >= self.cfg.n_experts):
            raise ValueError(f"forced expert ids must lie in [0, {self.cfg.n_experts}) or be -1")

    def _to_hf_cache(self, cache: KVCache) -> DynamicCache:
        """A transformers cache holding ``cache``'s keys/values (one list entry per layer)."""
        for entries in (cache.keys, cache.values):
            entries.extend([None] * (self.n_decoder_layers - len(entries)))
        hf_cache = DynamicCache(config=self.hf.config)
        for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            if k is not None and v is not None:
                hf_cache.update(k, v, i)
        return hf_cache

    def load_balance_loss(self) -> Tensor:
        """Switch-style auxiliary loss of the last forward: E * sum_e(load_e * prob_e).

        ``rollout.model.load_balance_loss`` (load normalised by top_k, so it is transformers'
        ``load_balancing_loss_func`` divided by top_k).
        """
        return load_balance_loss(self.last_router_probs, self.cfg.top_k)


def build_hf_policy(config: PretrainedConfig, seed: int = 0) -> HFPolicy:
    """A freshly initialised policy from ``config`` (weights depend only on config and seed)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        lm = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    return HFPolicy(lm)


def policy_from_config(cfg: PolicyConfig) -> HFPolicy:
    """The policy ``build_policy`` makes (``cfg.architecture == "qwen3_moe"``): the local
    ``cfg.hf_dir`` as float32 (the learner's master precision), or else a tiny Qwen3-MoE of the
    config's shape (key/value heads = ``n_heads``), initialised from ``cfg.seed``; with LoRA
    adapters (``with_lora``) when ``cfg.lora.rank``."""
    if cfg.hf_dir is not None:
        policy, _ = load_hf(cfg.hf_dir)
        policy = policy.float()
        return with_lora(policy, cfg.lora) if cfg.lora.rank else policy
    if cfg.d_model % cfg.n_heads or cfg.top_k > cfg.n_experts:
        raise ValueError("n_heads must divide d_model and top_k must not exceed n_experts")
    config: PretrainedConfig
    if cfg.architecture == "llama":
        config = tiny_llama_config(
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_heads,
            d_mlp=cfg.d_expert,
            max_seq_len=cfg.max_seq_len,
            vocab_size=cfg.vocab_size,
            head_dim=cfg.head_dim,
        )
        policy = build_hf_policy(config, cfg.seed)
        return with_lora(policy, cfg.lora) if cfg.lora.rank else policy
    config = tiny_qwen3_moe_config(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        d_expert=cfg.d_expert,
        max_seq_len=cfg.max_seq_len,
        vocab_size=cfg.vocab_size,
        head_dim=cfg.head_dim,
    )
    policy = build_hf_policy(config, cfg.seed)
    return with_lora(policy, cfg.lora) if cfg.lora.rank else policy


def with_lora(policy: HFPolicy, cfg: LoraConfig) -> HFPolicy:
    """``policy`` (in place) with peft LoRA adapters of ``cfg`` on its targeted linears, every
    other parameter frozen; ``A`` drawn from ``cfg.seed`` (deterministic), ``B`` zero."""
    from peft import LoraConfig as PeftLora
    from peft import inject_adapter_in_model

    peft_cfg = PeftLora(
        r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.targets), lora_dropout=0.0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        inject_adapter_in_model(peft_cfg, policy.hf)
    for name, param in policy.named_parameters():
        param.requires_grad_("lora_" in name)
    return policy


def merged_lm(policy: HFPolicy) -> PreTrainedModel:
    """The wrapped model with every LoRA adapter merged into its base linear and removed (in
    place; the policy is not used afterwards); the model itself when it has none."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(policy.hf.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(policy.hf.get_submodule(parent), child, module.get_base_layer())
    return policy.hf


def save_hf(policy: HFPolicy, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    """Write ``policy`` and ``tokenizer`` as an ordinary HF directory (config.json,
    model.safetensors, tokenizer files) that ``from_pretrained`` loads without this module;
    LoRA adapters are merged into the base (``merged_lm``)."""
    merged_lm(policy).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def save_state_hf(cfg: PolicyConfig, state: Mapping[str, Tensor], path: str | Path) -> None:
    """Write the policy of ``cfg`` holding exactly ``state`` (a published state: tied duplicates
    left out, all of one dtype) as an HF directory, in that dtype, so the saved tensors have the
    state's bits. The tokenizer is ``cfg.hf_dir``'s, else :func:`char_tokenizer`."""
    if cfg.hf_dir is not None:  # its model and tokenizer, read from disk once
        policy, tokenizer = load_hf(cfg.hf_dir)
        policy = with_lora(policy, cfg.lora) if cfg.lora.rank else policy
    else:
        policy, tokenizer = policy_from_config(cfg), char_tokenizer()
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"a published state has one dtype, got {sorted(map(str, dtypes))}")
    policy = policy.to(dtypes.pop())
    with torch.no_grad():
        policy.load_state_dict(state)
    save_hf(policy, tokenizer, path)


def load_hf(path: str | Path) -> tuple[HFPolicy, PreTrainedTokenizerBase]:
    """The policy and tokenizer of a local HF directory (never a hub download), the tokenizer
    with the protocol tags (``text.with_protocol_tags``). When added tags lie past the model's
    vocabulary its embeddings grow to hold them, the new rows initialised from a fixed seed,
    so every role that loads the directory builds the same model. The policy's ``text`` is
    that tokenizer, with the end-of-sequence ids of the model's generation config."""
    lm = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    tokenizer = with_protocol_tags(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    rows = int(lm.config.get_text_config().vocab_size)
    if len(tokenizer) > rows:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            lm.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    policy = HFPolicy(lm)
    eos = lm.generation_config.eos_token_id if lm.generation_config is not None else None
    policy.text = PolicyText(tokenizer, [eos] if isinstance(eos, int) else list(eos or []))
    return policy, tokenizer

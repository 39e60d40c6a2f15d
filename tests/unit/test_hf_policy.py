"""The HF policy adapter: tokenizer parity, the policy contract, router replay, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from rlstream.envs import protocol
from rlstream.rollout.hf_policy import (
    HFPolicy,
    build_hf_policy,
    load_hf,
    save_hf,
    save_state_hf,
    tiny_qwen3_moe_config,
)
from rlstream.rollout.model import (
    KVCache,
    PolicyConfig,
    build_policy,
    generate,
    inference_copy,
    sequence_logprobs,
)
from rlstream.rollout.text import char_tokenizer
from rlstream.schemas.deltacodec.bits import from_torch, state_hash, to_torch
from rlstream.trainer.learner_step import published_state

CONFIG = tiny_qwen3_moe_config(max_seq_len=64)
TEXTS = [
    "f(x): add 3, double\nf(2)=10",
    "x=x+3;x=x*2;return x",
    "<run>print(f(2))</run><out>10\n</out><sum>2 runs; last: ok</sum>",
    "<s>not bos</s> <pad> <|unused120|> <<run>> </run</run>>",
    "tabs\tand é, ünïcode, \r\n and emoji 🙂",
    "",
    "  a  b\n\n",
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    return build_hf_policy(CONFIG, seed=0)


def _tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, protocol.VOCAB_SIZE, (b, t), generator=g)


def test_tokenizer_ids_equal_encode(tmp_path: Path) -> None:
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(again) == protocol.VOCAB_SIZE
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (
        protocol.PAD,
        protocol.BOS,
        protocol.EOS,
    )
    for t in (tok, again):
        for text in TEXTS:
            ids = protocol.encode(text)
            assert t(text)["input_ids"] == ids, text
            assert t.encode(text) == ids, text
            framed = [protocol.BOS, *ids, protocol.EOS, protocol.PAD]
            assert t.decode(framed, skip_special_tokens=True) == protocol.decode(framed), text


def test_forward_shapes_and_names(policy: HFPolicy) -> None:
    logits, routes = policy(_tokens(3, 10))
    assert logits.shape == (3, 10, protocol.VOCAB_SIZE) and logits.dtype == torch.float32
    assert routes.shape == (3, 10, CONFIG.num_hidden_layers, CONFIG.num_experts_per_tok)
    assert routes.dtype == torch.int64
    assert int(routes.min()) >= 0 and int(routes.max()) < CONFIG.num_experts
    assert (routes[..., 0] != routes[..., 1]).all()
    cfg = policy.cfg
    assert (cfg.n_layers, cfg.top_k, cfg.n_experts) == (2, 2, CONFIG.num_experts)
    assert (cfg.max_seq_len, cfg.vocab_size) == (64, protocol.VOCAB_SIZE)
    plain = Qwen3MoeForCausalLM(CONFIG)
    # transformers' own names, the tied head held once (as the embedding)
    assert list(policy.state_dict()) == [k for k in plain.state_dict() if k != "lm_head.weight"]
    with pytest.raises(ValueError, match="max_seq_len"):
        policy(_tokens(1, 65))


def test_free_routes_are_the_routers_own_top_k(policy: HFPolicy) -> None:
    """Compared against transformers' own router-logit capture on an unwrapped copy."""
    plain = Qwen3MoeForCausalLM(CONFIG)
    plain.load_state_dict(policy.hf.state_dict())  # both tied names
    x = _tokens(2, 12, seed=1)
    out = plain(x, output_router_logits=True)
    logits, routes = policy(x)
    assert torch.equal(logits, out.logits.float())
    for layer, router_out in enumerate(out.router_logits):
        own = router_out.float().topk(CONFIG.num_experts_per_tok, dim=-1).indices
        assert torch.equal(routes[:, :, layer].reshape(-1, 2), own)


def test_forcing_own_routes_is_bit_exact(policy: HFPolicy) -> None:
    x = _tokens(2, 9, seed=2)
    logits, routes = policy(x)
    forced_logits, forced_routes = policy(x, forced_routes=routes)
    assert torch.equal(forced_routes, routes) and torch.equal(forced_logits, logits)


def _others(routes: torch.Tensor, n_experts: int) -> torch.Tensor:
    """For each token and layer, the lowest-numbered experts the router did not choose."""
    taken = torch.nn.functional.one_hot(routes, n_experts).sum(dim=-2).bool()
    ranked = (taken.long() * n_experts + torch.arange(n_experts)).argsort(dim=-1)
    return ranked[..., : routes.shape[-1]]


def test_forced_routes_are_obeyed_and_change_the_output(policy: HFPolicy) -> None:
    x = _tokens(2, 9, seed=3)
    logits, routes = policy(x)
    other = _others(routes, CONFIG.num_experts)
    assert not (other[..., :, None] == routes[..., None, :]).any()
    forced_logits, forced_routes = policy(x, forced_routes=other)
    assert torch.equal(forced_routes, other)
    assert not torch.allclose(forced_logits, logits)
    with pytest.raises(ValueError, match="expert ids"):
        policy(x, forced_routes=other + CONFIG.num_experts)


def test_replay_gradient_reaches_router_and_only_chosen_experts() -> None:
    policy = build_hf_policy(CONFIG, seed=4)
    x = _tokens(2, 8, seed=4)
    forced = torch.tensor([1, 3]).expand(2, 8, CONFIG.num_hidden_layers, 2)
    lp, _ = sequence_logprobs(policy, x, forced_routes=forced)
    (-lp.sum()).backward()
    for layer in policy.model.layers:
        gate, experts = layer.mlp.gate, layer.mlp.experts
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
        for param in (experts.gate_up_proj, experts.down_proj):
            grad = param.grad.abs().sum(dim=(1, 2))
            assert (grad[[1, 3]] > 0).all()
            assert (grad[[0, 2, 4, 5, 6, 7]] == 0).all()
    assert policy.load_balance_loss().item() > 0


def test_sequence_logprobs_and_greedy_generate(policy: HFPolicy) -> None:
    prompt = torch.tensor([[protocol.BOS, *protocol.encode("f(x): double\nf(2)=4")]])
    a = generate(policy, prompt.repeat(2, 1), max_new=12, greedy=True)
    b = generate(policy, prompt.repeat(2, 1), max_new=12, greedy=True)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routes, b.routes)
    assert torch.equal(a.tokens[0], a.tokens[1])
    n = int(a.lengths[0])
    full = torch.cat([prompt, a.tokens[:1, :n]], dim=1)
    lp, routes = sequence_logprobs(policy, full)
    assert torch.allclose(lp[0, -n:], a.logprobs[0, :n], atol=1e-5)
    assert torch.equal(routes[0], a.routes[0, : full.shape[1] - 1])


def test_cache_continuation_equals_a_full_forward(policy: HFPolicy) -> None:
    prompt = _tokens(3, 6, seed=5)
    gen = generate(policy, prompt, max_new=5, generator=torch.Generator().manual_seed(0))
    row, used = 1, prompt.shape[1] + int(gen.lengths[1])
    cache = gen.cache.select(row, used)  # what the harness does after a tool call
    more = _tokens(1, 4, seed=6)
    logits, routes = policy(more, cache=cache)
    assert cache.length == used + 4
    whole = torch.cat([prompt[row : row + 1], gen.tokens[row : row + 1, : used - 6], more], 1)
    full_logits, full_routes = policy(whole)
    assert torch.allclose(logits, full_logits[:, -4:], atol=1e-5)
    assert torch.equal(routes, full_routes[:, -4:])
    fresh = KVCache.empty(policy.cfg.n_layers)
    policy(whole[:, :5], cache=fresh)
    step, _ = policy(whole[:, 5:], cache=fresh)
    assert torch.allclose(step, full_logits[:, 5:], atol=1e-5)


def test_bf16_inference_copy(policy: HFPolicy) -> None:
    copy = inference_copy(policy, torch.bfloat16)
    assert next(copy.parameters()).dtype == torch.bfloat16
    assert next(policy.parameters()).dtype == torch.float32
    assert copy.hf.model is copy.model and copy.model is not policy.model
    assert all(p.dtype == torch.bfloat16 for p in copy.hf.parameters())
    x = _tokens(2, 8, seed=7)
    logits, routes = copy(x)
    assert logits.dtype == torch.float32 and routes.shape == (2, 8, 2, 2)
    reference, _ = policy(x, forced_routes=routes)
    assert (logits.softmax(-1) - reference.softmax(-1)).abs().max() < 0.05
    gen = generate(policy, x[:1], max_new=4, dtype=torch.bfloat16, greedy=True)
    assert gen.tokens.shape == (1, 4) and gen.logprobs.dtype == torch.float32


def test_save_load_round_trip(policy: HFPolicy, tmp_path: Path) -> None:
    save_hf(policy, char_tokenizer(), tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    x = _tokens(2, 10, seed=8)
    logits, routes = policy(x)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(plain) is Qwen3MoeForCausalLM
    assert torch.equal(plain(x).logits.float(), logits)
    loaded, tok = load_hf(tmp_path)
    again_logits, again_routes = loaded(x)
    assert torch.equal(again_logits, logits) and torch.equal(again_routes, routes)
    state, again = policy.state_dict(), loaded.state_dict()
    assert list(state) == list(again)
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert tok.encode(TEXTS[2]) == protocol.encode(TEXTS[2])


def test_dense_layers_keep_cache_and_route_only_moe_layers() -> None:
    """With a dense first layer, routes cover the MoE layers and the cache every layer."""
    config = tiny_qwen3_moe_config(n_layers=3, max_seq_len=64)
    config.mlp_only_layers = [0]
    policy = build_hf_policy(config)
    assert policy.cfg.n_layers == 2
    prompt = _tokens(2, 5, seed=9)
    gen = generate(policy, prompt, max_new=3, greedy=True)
    assert gen.routes.shape[2:] == (2, 2) and len(gen.cache.keys) == 3
    whole = torch.cat([prompt, gen.tokens], 1)
    _, routes = policy(whole[:, :-1])
    assert torch.equal(routes, gen.routes[:, : whole.shape[1] - 1])


# ---------------------------------------------------------------- behind build_policy

HF_CFG = PolicyConfig(
    architecture="qwen3_moe", vocab_size=protocol.VOCAB_SIZE, max_seq_len=64, d_expert=32
)


def test_build_policy_makes_the_configured_qwen3_moe_from_the_seed() -> None:
    policy = build_policy(HF_CFG)
    assert isinstance(policy, HFPolicy) and type(policy.hf) is Qwen3MoeForCausalLM
    config = policy.config
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (
        HF_CFG.d_model,
        HF_CFG.n_heads,
        HF_CFG.n_layers,
    )
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        HF_CFG.n_experts,
        HF_CFG.top_k,
        HF_CFG.d_expert,
    )
    assert policy.cfg.max_seq_len == 64 and policy.cfg.vocab_size == protocol.VOCAB_SIZE
    state, again = policy.state_dict(), build_policy(HF_CFG).state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    other = build_policy(HF_CFG.model_copy(update={"seed": 1})).state_dict()
    assert not torch.equal(state["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert isinstance(
        build_policy(PolicyConfig(vocab_size=protocol.VOCAB_SIZE)), HFPolicy
    )  # default


def test_build_policy_loads_hf_dir_as_float32(tmp_path: Path) -> None:
    source = build_policy(HF_CFG.model_copy(update={"seed": 3}))
    save_hf(inference_copy(source, torch.bfloat16), char_tokenizer(), tmp_path)
    loaded = build_policy(HF_CFG.model_copy(update={"hf_dir": str(tmp_path)}))
    want = inference_copy(source, torch.bfloat16).state_dict()
    got = loaded.state_dict()
    assert list(got) == list(want)
    assert all(
        v.dtype == torch.float32 and torch.equal(v.bfloat16(), want[k]) for k, v in got.items()
    )
    with pytest.raises(ValueError, match="rlstream-moe"):  # the homemade model is gone
        PolicyConfig(architecture="rlstream-moe", hf_dir=str(tmp_path))  # type: ignore[arg-type]


def test_tied_embedding_is_held_once_and_restored_from_it(policy: HFPolicy) -> None:
    """The published state carries the tied head once; loading it sets both names."""
    assert policy.tied_keys == {"lm_head.weight"}
    state = policy.state_dict()
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    fresh = build_hf_policy(CONFIG, seed=5)
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, policy.lm_head.weight)
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), policy.parameters(), strict=True)
    )
    fresh.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    missing = dict(state)
    del missing["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
        fresh.load_state_dict(missing)
    assert fresh.load_state_dict(missing, strict=False).missing_keys == ["model.norm.weight"]


def test_published_state_written_as_hf_dir_hashes_to_the_state_hash(tmp_path: Path) -> None:
    """What the demo writes as ``model_dir``: ``from_pretrained`` loads it unchanged and its
    weights are the published state's bits (same state hash as the manifest's)."""
    model = build_policy(HF_CFG)
    state = published_state(model, "bfloat16")
    save_state_hf(HF_CFG, to_torch(state), tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(plain) is Qwen3MoeForCausalLM
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    loaded = {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    assert state_hash(from_torch({k: v.bfloat16() for k, v in loaded.items()})) == state_hash(state)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tok.encode(TEXTS[0]) == protocol.encode(TEXTS[0])

"""The policy contract through ``build_policy`` (a tiny Qwen3-MoE): shapes, determinism, router
replay, generation with a KV cache."""

from __future__ import annotations

import pydantic
import pytest
import torch

from rlstream.rollout.model import (
    KVCache,
    PolicyConfig,
    build_policy,
    generate,
    inference_copy,
    sequence_logprobs,
)

CFG = PolicyConfig(
    vocab_size=32,
    max_seq_len=48,
    d_model=32,
    n_heads=4,
    n_layers=2,
    d_expert=32,
)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_route_range() -> None:
    model = build_policy(CFG)
    logits, routes = model(_tokens(3, 10))
    assert logits.shape == (3, 10, CFG.vocab_size) and logits.dtype == torch.float32
    assert routes.shape == (3, 10, CFG.n_layers, CFG.top_k)
    assert int(routes.min()) >= 0 and int(routes.max()) < CFG.n_experts
    assert (routes[..., 0] != routes[..., 1]).all(), "top-k experts are distinct"


def test_init_depends_only_on_seed() -> None:
    torch.manual_seed(123)
    a = build_policy(CFG).state_dict()
    torch.manual_seed(456)
    b = build_policy(CFG).state_dict()
    c = build_policy(CFG.model_copy(update={"seed": 1})).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_state_dict_is_plain_tensors() -> None:
    sd = build_policy(CFG).state_dict()
    assert sd and all(type(v) is torch.Tensor for v in sd.values())


def test_config_is_strict() -> None:
    with pytest.raises(pydantic.ValidationError):
        PolicyConfig(unknown=1)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        PolicyConfig(top_k=0)


def test_the_removed_homemade_architecture_is_refused_by_name() -> None:
    with pytest.raises(
        pydantic.ValidationError, match="homemade `rlstream-moe` policy was removed"
    ):
        PolicyConfig(architecture="rlstream-moe")  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError, match="qwen3_moe"):
        PolicyConfig(architecture="gpt2")  # type: ignore[arg-type]
    assert PolicyConfig().architecture == "qwen3_moe"


def test_forced_routes_equal_to_free_routes_reproduce_bit_exact() -> None:
    model = build_policy(CFG)
    x = _tokens(2, 12)
    logits, routes = model(x)
    replayed, forced = model(x, forced_routes=routes)
    assert torch.equal(forced, routes)
    assert torch.equal(replayed, logits)


def test_forced_routes_are_obeyed_and_unused_experts_get_zero_gradient() -> None:
    model = build_policy(CFG)
    x = _tokens(2, 12)
    forced = torch.zeros(2, 12, CFG.n_layers, CFG.top_k, dtype=torch.long)
    forced[..., 1] = 1  # every token in every layer uses experts 0 and 1 only
    logits, routes = model(x, forced_routes=forced)
    assert torch.equal(routes, forced)
    logits.square().mean().backward()
    for layer in model.model.layers:
        for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert w.grad is not None
            assert torch.count_nonzero(w.grad[2:]) == 0, "experts 2, 3 never saw a token"
            assert torch.count_nonzero(w.grad[:2]) > 0


def test_sequence_logprobs_rule() -> None:
    model = build_policy(CFG)
    x = _tokens(2, 9)
    lp, routes = sequence_logprobs(model, x)
    logits, _ = model(x[:, :-1])
    expected = logits.log_softmax(-1).gather(-1, x[:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp[:, 1:], expected) and torch.all(lp[:, 0] == 0)
    assert routes.shape == (2, 8, CFG.n_layers, CFG.top_k)


def test_generate_is_deterministic_and_stops() -> None:
    model = build_policy(CFG)
    prompt = _tokens(4, 5)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        g = generate(model, prompt, 12, generator=torch.Generator().manual_seed(7), stop_ids=(5,))
        return g.tokens, g.lengths

    (t1, n1), (t2, n2) = run(), run()
    assert torch.equal(t1, t2) and torch.equal(n1, n2)
    for row, n in zip(t1, n1, strict=True):
        assert (row[: int(n) - 1] != 5).all()
        assert int(n) == 12 or int(row[int(n) - 1]) == 5
        assert (row[int(n) :] == 0).all(), "padding after the stop"


def test_top_n_lists_the_distribution_and_changes_no_sample() -> None:
    """The top-n alternatives come from the sampling distribution itself: asking for them
    samples the same tokens, the list is sorted, and a greedy token is its own top-1."""
    model = build_policy(CFG)
    prompt = _tokens(3, 5)

    def run(top_n: int, greedy: bool = False):
        gen = torch.Generator().manual_seed(3)
        return generate(model, prompt, 10, 0.7, gen, top_n=top_n, greedy=greedy)

    plain, listed = run(0), run(4)
    assert plain.top_ids is None and plain.top_logprobs is None
    assert torch.equal(plain.tokens, listed.tokens)
    assert torch.equal(plain.logprobs, listed.logprobs)
    assert listed.top_ids is not None and listed.top_logprobs is not None
    assert listed.top_ids.shape == (*listed.tokens.shape, 4)
    assert (listed.top_logprobs[..., :-1] >= listed.top_logprobs[..., 1:]).all()
    for b in range(3):
        n = int(listed.lengths[b])
        assert (listed.logprobs[b, :n] <= listed.top_logprobs[b, :n, 0]).all()
        hit = listed.top_ids[b, :n] == listed.tokens[b, :n, None]
        assert torch.equal(
            listed.top_logprobs[b, :n][hit], listed.logprobs[b, :n, None].expand(-1, 4)[hit]
        )
    greedy = run(2, greedy=True)
    assert greedy.top_ids is not None and greedy.top_logprobs is not None
    n = int(greedy.lengths[0])
    assert torch.equal(greedy.top_ids[0, :n, 0], greedy.tokens[0, :n])
    assert torch.equal(greedy.top_logprobs[0, :n, 0], greedy.logprobs[0, :n])


def test_generation_replay_matches_behaviour_logprobs_fp32() -> None:
    """fp32 inference with a KV cache vs a full fp32 recompute with the recorded routes."""
    model = build_policy(CFG)
    prompt = _tokens(3, 6)
    g = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert g.routes.shape == (3, 6 + g.tokens.shape[1], CFG.n_layers, CFG.top_k)
    seq = torch.cat([prompt, g.tokens], dim=1)
    lp, _ = sequence_logprobs(model, seq, forced_routes=g.routes)
    for b in range(3):
        n = int(g.lengths[b])
        assert torch.allclose(lp[b, 6 : 6 + n], g.logprobs[b, :n], atol=1e-4)


def test_bf16_inference_differs_numerically_but_records_float32_logprobs() -> None:
    model = build_policy(CFG)
    prompt = _tokens(2, 6)
    g = generate(
        model, prompt, 10, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16
    )
    assert g.logprobs.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32, "the learner's weights are untouched"
    seq = torch.cat([prompt, g.tokens], dim=1)
    lp, _ = sequence_logprobs(model, seq, forced_routes=g.routes)
    diff = (lp[:, 6:] - g.logprobs).abs().detach()
    assert float(diff.detach().max()) > 0, "bf16 and fp32 are not bit-identical"
    assert float(diff.mean()) < 0.1


def test_cache_continuation_equals_one_pass() -> None:
    model = build_policy(CFG)
    x = _tokens(1, 10)
    full, _ = model(x)
    cache = KVCache.empty(CFG.n_layers)
    model(x[:, :6], cache=cache)
    tail, _ = model(x[:, 6:], cache=cache)
    assert cache.length == 10
    assert torch.allclose(tail, full[:, 6:], atol=1e-5)
    row = KVCache.empty(CFG.n_layers)
    model(_tokens(2, 4), cache=row)
    assert row.select(1, 3).length == 3


def test_window_overflow_raises() -> None:
    model = build_policy(CFG)
    with pytest.raises(ValueError):
        model(_tokens(1, CFG.max_seq_len + 1))


def test_inference_copy_is_detached() -> None:
    model = build_policy(CFG)
    dup = inference_copy(model, torch.bfloat16)
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in dup.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())

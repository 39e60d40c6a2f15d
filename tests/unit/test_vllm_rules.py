"""The ``vllm`` engine's rules that need no server: which tensors a version sends (those whose
bits changed, widened to whole decoder layers), what the worker extension refuses before it
touches the model, and the policy shapes vLLM's CPU attention runs."""

from __future__ import annotations

import pytest
import torch

from rlstream.envs import protocol
from rlstream.rollout.config import PolicyConfig, check_vllm_policy
from rlstream.rollout.model import build_policy
from rlstream.rollout.vllm_engine import changed_names, same_bits, whole_layers
from rlstream.rollout.vllm_server.rlstream_vllm.weights import check, layer_of


def test_changed_names_compare_bits() -> None:
    old = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0]), "c": torch.ones(2, 2)}
    new = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([-0.0]), "c": torch.ones(2, 2)}
    assert changed_names(old, new) == {"b"}  # 0.0 and -0.0 compare equal, their bits differ
    assert changed_names(None, new) == set(new)
    assert not same_bits(torch.ones(2), torch.ones(2, dtype=torch.float64))
    nan = torch.tensor([float("nan")])
    assert same_bits(nan, nan.clone())  # a NaN is the same bits as itself


def test_a_changed_tensor_sends_its_whole_decoder_layer() -> None:
    every = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.10.input_layernorm.weight",
        "model.norm.weight",
    }
    got = whole_layers({"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}, every)
    assert got == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.norm.weight",
    }
    assert whole_layers({"model.layers.1.self_attn.q_proj.weight"}, every) == {
        "model.layers.1.self_attn.q_proj.weight"
    }  # layer 1 is not layer 10


def _table(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(t.shape), "F32") for n, t in state.items()}


def test_the_extension_refuses_what_it_cannot_load_whole() -> None:
    state = {
        "model.layers.0.a.weight": torch.ones(2, 3),
        "model.layers.0.b.weight": torch.ones(3),
        "model.norm.weight": torch.ones(3),
    }
    table = _table(state)
    assert check(state, table) == ""
    assert check({"model.norm.weight": torch.ones(3)}, table) == ""
    assert "in part" in check({"model.layers.0.b.weight": torch.ones(3)}, table)
    assert "not a tensor" in check({"model.x": torch.ones(3)}, table)
    assert "shape" in check({**state, "model.norm.weight": torch.ones(4)}, table)
    bad = {**state, "model.norm.weight": torch.tensor([1.0, float("inf"), 0.0])}
    assert "not finite" in check(bad, table)
    assert layer_of("model.layers.12.mlp.experts.3.up_proj.weight") == "model.layers.12"
    assert layer_of("lm_head.weight") is None


def test_vllm_runs_heads_of_its_sizes_only() -> None:
    default = PolicyConfig(vocab_size=protocol.VOCAB_SIZE)
    with pytest.raises(ValueError, match="heads of 16"):
        check_vllm_policy(default)
    shaped = default.model_copy(update={"head_dim": 64})
    check_vllm_policy(shaped)
    q = build_policy(shaped).state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.shape) == (4 * 64, 64)
    # without head_dim the model is the one it always was (weights from the seed alike)
    same = build_policy(default.model_copy(update={"head_dim": None})).state_dict()
    assert all(
        torch.equal(a, b)
        for a, b in zip(same.values(), build_policy(default).state_dict().values(), strict=True)
    )

"""A dense causal LM (no router) is a policy like the MoE one: it generates, its samples pass
admission and the Avro codec with no routes, and the learner trains on them; nothing is replayed.
The tiny Llama here is built locally from its config (``policy.architecture = "llama"``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from rlstream.consumers.admission_rules import AdmissionConfig, PendingGroup, admitted_samples
from rlstream.envs import protocol
from rlstream.rollout.config import DENSE_MODEL_TYPES, HarnessConfig, PolicyConfig
from rlstream.rollout.harness import rollout_group
from rlstream.rollout.hf_policy import build_hf_policy
from rlstream.rollout.model import build_policy, sequence_logprobs
from rlstream.schemas import arrays, events
from rlstream.trainer import grpo
from rlstream.trainer.config import LearnerConfig
from rlstream.trainer.learner_step import StepInput, group_sequences, train_step

DENSE = PolicyConfig(
    architecture="llama", vocab_size=protocol.VOCAB_SIZE, d_model=32, n_heads=4, d_expert=64
)
PROMPT = "f(x): inc\nf(1)=2\n"


def _decision(model: torch.nn.Module) -> tuple[dict, list]:
    samples = rollout_group(model, PROMPT, 2, HarnessConfig(max_new_tokens=12))
    group = PendingGroup("g1", "t1", 2, first_seen_ms=0)
    for s in samples:
        fields = arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, s.routes)
        group.add_sample(
            {
                "sample_index": s.index,
                "policy_version": 0,
                "prompt_tokens": 3,
                "temperature": 1.0,
                "turns": [],
                "routes_recorded": True,
                **fields,
            }
        )
        group.add_reward({"sample_index": s.index, "judge": "tests", "score": float(s.index)})
    cfg = AdmissionConfig(judges={"tests": 1.0}, max_staleness=2, timeout_s=10)
    decision = {
        "run": "r1", "group_id": "g1", "task_id": "t1", "decision": "admitted",
        "source": "rollout", "learner_version": 0, "min_behaviour_version": 0,
        "max_behaviour_version": 0, "staleness": 0, "decided_ms": 1, "group_size": 2,
        "samples": admitted_samples(group, cfg),
    }  # fmt: skip
    return events.decode(events.encode("admission", decision), expect="admission").record, samples


def test_a_dense_model_has_no_routes_to_record() -> None:
    torch.set_num_threads(1)
    model = build_policy(DENSE).eval()
    assert (model.cfg.n_layers, model.cfg.n_experts, model.cfg.top_k) == (0, 0, 0)
    samples = rollout_group(model, PROMPT, 2, HarnessConfig(max_new_tokens=12))
    assert all(s.routes.shape == (len(s.token_ids), 0, 0) for s in samples)


def test_its_samples_reach_the_learner_and_train() -> None:
    torch.set_num_threads(1)
    model = build_policy(DENSE)
    decision, _ = _decision(model.eval())
    seqs, advantages = group_sequences(decision, grpo.GrpoConfig())
    batch = grpo.make_batch(seqs, advantages)
    assert batch.routes.shape[2:] == (0, 0)
    with torch.no_grad():
        again, _ = sequence_logprobs(model, batch.tokens, batch.routes)
    mask = batch.loss_mask > 0
    assert torch.allclose(again[mask], batch.behaviour_logprobs[mask], atol=1e-5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    stats = train_step(
        model.train(), opt, [StepInput({**decision, "staleness": 0})], LearnerConfig(policy=DENSE)
    )
    assert stats["route_mismatch"] == 0.0 and stats["logprob_mae"] < 1e-4
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and np.isfinite(stats["loss"])


@pytest.mark.parametrize("model_type", sorted(DENSE_MODEL_TYPES))
def test_each_checked_architecture_generates_replays_and_trains(model_type: str) -> None:
    """Every dense type ``policy.hf_dir`` accepts, as a tiny model of its own config: the
    sampler's logprobs equal a full forward's, and one GRPO step on its samples moves it."""
    torch.set_num_threads(1)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=protocol.VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=protocol.PAD,
        bos_token_id=protocol.BOS,
        eos_token_id=protocol.EOS,
        tie_word_embeddings=True,
    )
    model = build_hf_policy(config, seed=1)
    assert model.cfg.n_layers == 0
    decision, _ = _decision(model.eval())
    seqs, advantages = group_sequences(decision, grpo.GrpoConfig())
    batch = grpo.make_batch(seqs, advantages)
    with torch.no_grad():
        again, _ = sequence_logprobs(model, batch.tokens, batch.routes)
    mask = batch.loss_mask > 0
    assert torch.allclose(again[mask], batch.behaviour_logprobs[mask], atol=1e-5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model.train(), opt, [StepInput({**decision, "staleness": 0})], LearnerConfig())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())

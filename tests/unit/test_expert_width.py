"""Router replay for a policy with more experts than uint8 holds, from sampler to learner.

Properties asserted: a 300-expert policy's routes (ids >= 256 included) go through the rollout
harness, the trajectory record, admission, the admitted record's Avro codec and the learner's
unpacking without losing a bit, so the learner's forced-routing logprobs equal the behaviour
logprobs; the policy server records its routes 2 bytes wide and refuses, rather than wraps, a
width too narrow for them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlstream.consumers.admission_rules import AdmissionConfig, PendingGroup, admitted_samples
from rlstream.envs import protocol
from rlstream.rollout.config import HarnessConfig, PolicyConfig
from rlstream.rollout.harness import rollout_group
from rlstream.rollout.model import build_policy, generate, sequence_logprobs
from rlstream.rollout.serve import ServedContext, served_choice, served_record
from rlstream.schemas import arrays, events
from rlstream.trainer import grpo
from rlstream.trainer.learner_step import group_sequences

WIDE = PolicyConfig(
    vocab_size=protocol.VOCAB_SIZE,
    d_model=16,
    n_heads=2,
    n_experts=300,
    top_k=2,
    d_expert=8,
    seed=3,
)
PROMPT = "f(x): inc\nf(1)=2\n"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _trajectory(index: int, fields: dict[str, object], prompt_tokens: int) -> dict[str, object]:
    """The fields of a trajectory that admission copies into an admitted sample."""
    return {
        "sample_index": index, "policy_version": 0, "prompt_tokens": prompt_tokens,
        "temperature": 1.0, "turns": [], "region": "local", **fields,
    }  # fmt: skip


def test_the_learner_replays_the_experts_of_a_300_expert_policy_exactly() -> None:
    model = build_policy(WIDE)
    samples = rollout_group(model, PROMPT, 2, HarnessConfig(max_new_tokens=10))
    assert int(max(s.routes.max() for s in samples)) >= 256, "needs ids uint8 would wrap"
    prompt_tokens = 1 + len(protocol.encode(PROMPT))
    cfg = AdmissionConfig(judges={"tests": 1.0}, max_staleness=2, timeout_s=10)
    group = PendingGroup("g1", "t1", len(samples), first_seen_ms=0)
    for s in samples:
        fields = arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, s.routes)
        group.add_sample(_trajectory(s.index, fields, prompt_tokens))
        group.add_reward({"sample_index": s.index, "judge": "tests", "score": 1.0 * s.index})
    admitted = admitted_samples(group, cfg)
    assert [a["expert_bytes"] for a in admitted] == [2, 2], "admission keeps the width"
    decision = {
        "run": "r1", "group_id": "g1", "task_id": "t1", "decision": "admitted",
        "source": "rollout", "learner_version": 0, "min_behaviour_version": 0,
        "max_behaviour_version": 0, "staleness": 0, "decided_ms": 1,
        "group_size": len(samples), "samples": admitted,
    }  # fmt: skip
    parts = arrays.split_group(decision, 1_300)  # sliced by tokens, so every slice keeps it too
    assert len(parts) > 1
    decoded = [events.decode(events.encode("admission", p), expect="admission") for p in parts]
    joined = arrays.join_group([d.record for d in decoded])

    seqs, advantages = group_sequences(joined, grpo.GrpoConfig())
    assert len(seqs) == len(samples)
    for seq, s in zip(seqs, samples, strict=True):
        assert np.array_equal(seq.routes, s.routes)
    batch = grpo.make_batch(seqs, advantages)
    with torch.no_grad():
        replayed, _ = sequence_logprobs(model, batch.tokens, batch.routes)
    mask = batch.loss_mask > 0
    assert torch.allclose(replayed[mask], batch.behaviour_logprobs[mask], atol=1e-4)


def test_the_policy_server_records_routes_at_the_policys_width() -> None:
    model = build_policy(WIDE).eval()
    prompt = [protocol.BOS, *protocol.encode(PROMPT)]
    out = generate(model, torch.tensor([prompt] * 2), 6, 1.0, torch.Generator().manual_seed(1))
    assert int(out.routes.max()) >= 256
    with pytest.raises(arrays.ArrayError, match="do not fit uint8"):
        served_choice(out, 0, prompt)  # width 1 for a 300-expert policy: refused, not wrapped
    width = arrays.expert_bytes_for(WIDE.n_experts)
    ctx = ServedContext(
        run="r1", request_id="req-1", model="policy", policy_version=0, worker_id="serve-1",
        region="local", temperature=1.0, settings={}, received_ms=0, started_ms=0,
        finished_ms=1, swap_ms=0,
    )  # fmt: skip
    for row in range(2):
        choice = served_choice(out, row, prompt, width)
        assert choice.routes.dtype == np.uint16
        record = served_record(ctx, row, 2, choice, "text")
        decoded = events.decode(events.encode("trajectory", record), expect="trajectory").record
        assert decoded["expert_bytes"] == 2
        fed = len(prompt) + int(out.lengths[row])
        got = arrays.unpack_tokens(decoded).routed_experts
        assert np.array_equal(got, out.routes[row, :fed].numpy())


def test_feedback_on_a_wide_served_completion_keeps_its_width() -> None:
    from rlstream.consumers.feedback.rl import FeedbackRLConfig
    from rlstream.consumers.feedback.rules import ClassWindow, Item
    from rlstream.consumers.feedback.served_log import SERVED_FIELDS
    from rlstream.consumers.tap import jsonable

    assert "expert_bytes" in SERVED_FIELDS  # copied from the served record onto the feedback
    routes = np.array([[[299, 3]], [[256, 0]]])  # 2 tokens, 1 layer, top 2
    packed = arrays.pack_tokens(
        np.array([5, 6], dtype=arrays.TOKEN_DTYPE),
        np.zeros(2, dtype=arrays.LOGPROB_DTYPE),
        np.ones(2, dtype=arrays.MASK_DTYPE),
        arrays.expert_ids(routes, 2),
        expert_bytes=2,
    )
    assert jsonable(packed)["routed_experts"] == [299, 3, 256, 0]  # not byte pairs
    record = {"policy_version": 1, "action": "accepted", **packed}
    window = ClassWindow("r", "w", "tab", 1, 0, FeedbackRLConfig())
    sample = window.sample(0, Item(record, {}), 1.0, 0.0)
    assert sample["expert_bytes"] == 2
    assert int(arrays.unpack_tokens(sample).routed_experts.max()) == 299

"""Router replay when the engine reports no routes (vLLM's CPU build): the trajectory says so
(``routes_recorded`` false), admission carries it, and the learner routes those tokens with its
own router, never replaying routes for them, whatever the routes field holds.

Properties: through admission, the Avro codec and the learner's unpacking, a sample marked
without routes reaches the batch as free routing (-1), so its logprobs under the learner equal a
free forward pass, while a sample with routes is replayed exactly; the step reports how many
samples were routed freely; records written before the field read as recorded.
"""

from __future__ import annotations

import numpy as np
import torch

from rlstream.consumers.admission_rules import AdmissionConfig, PendingGroup, admitted_samples
from rlstream.envs import protocol
from rlstream.rollout.config import HarnessConfig, PolicyConfig
from rlstream.rollout.harness import rollout_group
from rlstream.rollout.model import build_policy, sequence_logprobs
from rlstream.schemas import arrays, events
from rlstream.trainer import grpo
from rlstream.trainer.config import LearnerConfig
from rlstream.trainer.learner_step import StepInput, group_sequences, train_step

SMALL = PolicyConfig(vocab_size=protocol.VOCAB_SIZE, d_model=32, n_heads=4, d_expert=32, seed=2)
PROMPT = "f(x): inc\nf(1)=2\n"


def _admitted(model: torch.nn.Module) -> tuple[dict, list]:
    """An admitted decision of two samples; the second's engine 'reported no routes' but its
    routes field holds wrong experts (which replay would force)."""
    samples = rollout_group(model, PROMPT, 2, HarnessConfig(max_new_tokens=12))
    group = PendingGroup("g1", "t1", 2, first_seen_ms=0)
    for s in samples:
        routes = s.routes if s.index == 0 else (s.routes + 1) % SMALL.n_experts
        fields = arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, routes)
        group.add_sample(
            {
                "sample_index": s.index,
                "policy_version": 0,
                "prompt_tokens": 3,
                "temperature": 1.0,
                "turns": [],
                "routes_recorded": s.index == 0,
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


def test_a_sample_without_routes_is_routed_by_the_learner_itself() -> None:
    torch.set_num_threads(1)
    model = build_policy(SMALL).eval()
    decision, samples = _admitted(model)
    assert [s["routes_recorded"] for s in decision["samples"]] == [True, False]
    seqs, advantages = group_sequences(decision, grpo.GrpoConfig())
    assert np.array_equal(seqs[0].routes, samples[0].routes)
    assert seqs[1].routes.shape[1:] == (0, 0)  # never replayed
    batch = grpo.make_batch(seqs, advantages)
    assert bool((batch.routes[1] == -1).all()) and bool((batch.routes[0] >= 0).all())
    with torch.no_grad():
        replayed, _ = sequence_logprobs(model, batch.tokens, batch.routes)
    mask = batch.loss_mask > 0
    # same weights, fp32: free routing for the second sample is the sampler's own routing
    assert torch.allclose(replayed[mask], batch.behaviour_logprobs[mask], atol=1e-5)


def test_the_step_reports_the_samples_routed_freely() -> None:
    torch.set_num_threads(1)
    model = build_policy(SMALL)
    decision, _ = _admitted(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    group = {**decision, "staleness": 0}
    stats = train_step(model, opt, [StepInput(group)], LearnerConfig(policy=SMALL))
    assert stats["routes_absent_samples"] == 1.0
    assert stats["route_mismatch"] == 0.0 and stats["logprob_mae"] < 1e-4


def test_a_record_written_before_the_field_reads_as_recorded() -> None:
    schema = events.load_event_schemas(events.HISTORY_DIR / "v5")["trajectory"]
    assert all(f["name"] != "routes_recorded" for f in schema["fields"])
    _, reader = events.default_store().current("trajectory")
    field = next(f for f in reader["fields"] if f["name"] == "routes_recorded")
    assert field["default"] is True

"""GRPO rules: advantages, truncated importance weights, masked loss, the replayed step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy, generate
from rlstream.trainer import grpo, objectives

CFG = PolicyConfig(vocab_size=32, max_seq_len=48, d_model=32, n_heads=4, n_layers=2, d_expert=32)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_group_advantages_rule() -> None:
    adv = grpo.group_advantages([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(adv, [1, -1, -1, 1], atol=1e-5)
    assert adv.dtype == np.float32


@pytest.mark.parametrize("rewards", [[0.0] * 8, [1.0] * 8, [0.3], []])
def test_zero_variance_group_has_no_signal(rewards: list[float]) -> None:
    assert np.all(grpo.group_advantages(rewards) == 0)


@given(st.lists(st.floats(-10, 10), min_size=2, max_size=64))
def test_advantages_are_centred_and_scaled(rewards: list[float]) -> None:
    adv = grpo.group_advantages(rewards)
    r = np.asarray(rewards)
    if r.std() < 1e-3:  # tiny spreads are numerically a zero-variance group
        return
    assert abs(float(adv.mean())) < 1e-4
    assert np.allclose(adv, (r - r.mean()) / (r.std() + 1e-6), atol=1e-4)


def test_truncated_is_weights_rule() -> None:
    cur = torch.tensor([0.0, -1.0, -3.0], requires_grad=True)
    beh = torch.tensor([0.0, -2.0, -1.0])
    w = objectives.truncated_is_weights(cur, beh, cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, float(np.exp(-2.0))]))
    assert not w.requires_grad, "the weight is a coefficient, not a gradient path"


def test_loss_masks_tokens_and_normalises_by_token_count() -> None:
    cur = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    beh = cur.detach().clone()
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = objectives.policy_gradient_loss(cur, beh, adv, mask, cap=2.0)
    assert stats["tokens"] == 3
    assert float(loss.detach()) == pytest.approx(-(1 * -2 + 1 * -3 + -2 * -1) / 3)
    loss.backward()
    expected = -(mask * adv[:, None]) / 3  # d loss / d logp = -w * A * mask / n, with w = 1
    assert cur.grad is not None and torch.allclose(cur.grad, expected)


def test_make_batch_pads_and_split_segments_drops_prompt_only() -> None:
    def seq(n: int, gen_from: int) -> grpo.TrainSequence:
        mask = (np.arange(n) >= gen_from).astype(np.uint8)
        return grpo.TrainSequence(
            np.arange(n, dtype=np.int32) + 3,
            -mask.astype(np.float32),
            mask,
            np.zeros((n, 2, 2), dtype=np.uint8) + np.array([1, 3], dtype=np.uint8),
        )

    batch = grpo.make_batch([seq(5, 2), seq(3, 1)], [0.5, -0.5])
    assert batch.tokens.shape == (2, 5) and batch.routes.shape == (2, 5, 2, 2)
    assert batch.tokens[1, 3:].tolist() == [0, 0] and batch.loss_mask[1, 3:].sum() == 0
    assert batch.routes[1, 4].tolist() == [[0, 1], [0, 1]]
    s = seq(10, 4)
    parts = grpo.split_segments(s.token_ids, s.logprobs, s.loss_mask, s.routes, [(0, 3), (3, 10)])
    assert len(parts) == 1 and len(parts[0].token_ids) == 7


def _rollout_batch(model: torch.nn.Module, seed: int = 0) -> grpo.GrpoBatch:
    prompt = torch.randint(3, 32, (4, 5), generator=torch.Generator().manual_seed(seed))
    g = generate(model, prompt, 8, generator=torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
    seqs = []
    for b in range(4):
        n = int(g.lengths[b])
        ids = torch.cat([prompt[b], g.tokens[b, :n]]).numpy().astype(np.int32)
        lps = np.concatenate([np.zeros(5, np.float32), g.logprobs[b, :n].numpy()])
        mask = np.concatenate([np.zeros(5, np.uint8), np.ones(n, np.uint8)])
        seqs.append(
            grpo.TrainSequence(ids, lps, mask, g.routes[b, : 5 + n].numpy().astype(np.uint8))
        )
    return grpo.make_batch(seqs, grpo.group_advantages([1.0, 0.0, 0.0, 1.0]).tolist())


def test_grpo_step_is_deterministic_and_replays_routes() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        states = []
        for _ in range(2):
            model = build_policy(CFG)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            batch = _rollout_batch(model)
            stats = [grpo.grpo_step(model, opt, batch, grpo.GrpoConfig()) for _ in range(3)]
            states.append(model.state_dict())
            assert all(s["route_mismatch"] == 0.0 for s in stats)
            assert stats[0]["logprob_mae"] < 1e-4, "same weights, fp32: on-policy"
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    finally:
        torch.use_deterministic_algorithms(False)


def test_grpo_step_moves_probability_towards_positive_advantage() -> None:
    model = build_policy(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = _rollout_batch(model, seed=3)
    from rlstream.rollout.model import sequence_logprobs

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, batch.tokens, batch.routes)
        return (lp * batch.loss_mask).sum(dim=1)

    before = seq_logp()
    for _ in range(5):
        grpo.grpo_step(model, opt, batch, grpo.GrpoConfig())
    delta = seq_logp() - before
    assert float(delta[batch.advantages > 0].mean()) > float(delta[batch.advantages < 0].mean())


def test_a_step_on_a_nan_logprob_is_refused_and_changes_nothing() -> None:
    model = build_policy(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = _rollout_batch(model)
    grpo.grpo_step(model, opt, batch, grpo.GrpoConfig())  # the optimizer has state to keep
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    batch.behaviour_logprobs[0, 3] = float("nan")  # one poisoned token of one sample
    with pytest.raises(grpo.NonFiniteStep):
        grpo.grpo_step(model, opt, batch, grpo.GrpoConfig())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(moments[k], after[k]) for k in moments)


def _without_routes(batch: grpo.GrpoBatch, rows: list[int]) -> grpo.GrpoBatch:
    """The batch re-made with the sequences of ``rows`` recorded without routes (an engine that
    does not report them)."""
    seqs = []
    for b in range(batch.tokens.shape[0]):
        n = int((batch.tokens[b] != 0).sum())
        routes = batch.routes[b, :n].numpy().astype(np.uint8)
        seqs.append(
            grpo.TrainSequence(
                batch.tokens[b, :n].numpy().astype(np.int32),
                batch.behaviour_logprobs[b, :n].numpy(),
                batch.loss_mask[b, :n].numpy().astype(np.uint8),
                np.zeros((n, 0, 0), np.uint8) if b in rows else routes,
            )
        )
    return grpo.make_batch(seqs, batch.advantages.tolist())


@pytest.mark.parametrize("rows", [[1, 2], [0, 1, 2, 3]])
def test_sequences_without_routes_are_routed_freely(rows: list[int]) -> None:
    model = build_policy(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = _without_routes(_rollout_batch(model), rows)
    if len(rows) == 4:
        assert batch.routes.shape[2] == 0  # nothing to replay
    else:
        assert bool((batch.routes[rows] == -1).all()) and bool((batch.routes[[0, 3]] >= 0).all())
    stats = grpo.grpo_step(model, opt, batch, grpo.GrpoConfig())
    # same weights, fp32: the learner's free routing is the sampler's, so still on-policy
    assert stats["logprob_mae"] < 1e-4 and stats["route_mismatch"] == 0.0

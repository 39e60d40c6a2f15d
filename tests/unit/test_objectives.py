"""The learner's objectives on hand-computed cases: loss value, gradient, clipped/masked share;
KL and entropy terms; over-long samples; minibatches with a proximal policy; determinism of a
version's steps under every objective (what bit-exact replay rests on)."""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest
import torch
from test_grpo import _rollout_batch

from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy, sequence_logprobs, sequence_logprobs_entropy
from rlstream.trainer import grpo
from rlstream.trainer import objectives as obj
from rlstream.trainer.config import GrpoConfig, LearnerConfig

CFG = PolicyConfig(vocab_size=32, max_seq_len=48, d_model=32, n_heads=4, n_layers=2, d_expert=32)
LN = math.log


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _terms(cur: list[float], beh: list[float], adv: float, **kw: torch.Tensor) -> obj.TokenTerms:
    c = torch.tensor([cur], requires_grad=True)
    return obj.TokenTerms(
        c, torch.tensor([beh]), torch.tensor([adv]), torch.ones(1, len(cur)), **kw
    )


def _grad(loss: torch.Tensor, t: obj.TokenTerms) -> list[float]:
    loss.backward()
    assert t.logp_cur.grad is not None
    return t.logp_cur.grad[0].tolist()


def test_truncated_is_caps_the_weight_and_keeps_the_gradient_path_through_logp() -> None:
    t = _terms([0.0, LN(3)], [0.0, 0.0], 1.0)
    loss, stats = obj.objective(obj.TruncatedIS(cap=2.0), t)
    assert float(loss.detach()) == pytest.approx(-(2 * LN(3)) / 2)
    assert _grad(loss, t) == pytest.approx([-0.5, -1.0])  # -w A / n, w = [1, 2]
    assert stats["clip_frac"] == 0.5


@pytest.mark.parametrize(
    ("adv", "value", "grad", "clipped"),
    [
        # r = [1.5, 0.5, 1], w = [2, 1, 0.5]: A>0 clips r=1.5 at 1.28 (no gradient there)
        (1.0, -(2 * 1.28 + 0.5 + 0.5) / 3, [0.0, -0.5 / 3, -0.5 / 3], 1 / 3),
        # A<0: min(-r, -clip r) = -max(r, clip r) clips r=0.5 at 0.8
        (-1.0, (2 * 1.5 + 0.8 + 0.5) / 3, [2 * 1.5 / 3, 0.0, 0.5 / 3], 1 / 3),
    ],
)
def test_decoupled_ppo_clips_against_the_proximal_and_weighs_against_the_behaviour(
    adv: float, value: float, grad: list[float], clipped: float
) -> None:
    prox = torch.tensor([[0.0, 0.0, 0.0]])
    t = _terms([LN(1.5), LN(0.5), 0.0], [LN(0.5), 0.0, LN(2)], adv, logp_proximal=prox)
    loss, stats = obj.objective(obj.DecoupledPPO(eps_low=0.2, eps_high=0.28, cap=5.0), t)
    assert float(loss.detach()) == pytest.approx(value)
    assert _grad(loss, t) == pytest.approx(grad)
    assert stats["clip_frac"] == pytest.approx(clipped)


def test_decoupled_ppo_caps_the_behaviour_weight() -> None:
    prox = torch.tensor([[0.0]])
    t = _terms([0.0], [LN(0.1)], 1.0, logp_proximal=prox)  # pi_prox / pi_beh = 10
    loss, _ = obj.objective(obj.DecoupledPPO(cap=3.0), t)
    assert float(loss.detach()) == pytest.approx(-3.0)


def test_gspo_uses_one_length_normalised_ratio_per_row() -> None:
    cur = torch.tensor([[0.1, 0.3], [-0.5, 7.0], [0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # row 2 has no generated token
    t = obj.TokenTerms(cur, torch.zeros(3, 2), torch.tensor([1.0, -1.0, 5.0]), mask)
    loss, stats = obj.objective(obj.GSPO(eps_low=0.2, eps_high=0.28), t)
    s0 = math.exp(0.2)  # inside the band: unclipped; row 1: s = e^-0.5 < 0.8 with A < 0: clipped
    assert float(loss.detach()) == pytest.approx(-(s0 - 0.8) / 2)
    loss.backward()
    assert cur.grad is not None
    # d/dcur of -(s0 A)/2 with s0 = exp(mean): -s0/2 * 1/2 per token of row 0; rows 1, 2: none
    assert cur.grad.flatten().tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0, 0, 0, 0])
    assert stats["clip_frac"] == pytest.approx(1 / 3)  # row 1's one token of 3 tokens


def test_cispo_clips_the_weight_but_every_token_keeps_its_gradient() -> None:
    t = _terms([LN(2), LN(0.5), 0.0], [0.0, 0.0, 0.0], 1.0)
    loss, stats = obj.objective(obj.CISPO(eps_low=0.2, eps_high=0.28), t)
    assert float(loss.detach()) == pytest.approx(-(1.28 * LN(2) + 0.8 * LN(0.5)) / 3)
    assert _grad(loss, t) == pytest.approx([-1.28 / 3, -0.8 / 3, -1 / 3])
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_masked_is_drops_the_tokens_out_of_the_band() -> None:
    t = _terms([LN(2.5), LN(1.5), LN(0.4)], [0.0, 0.0, 0.0], -2.0)
    loss, stats = obj.objective(obj.MaskedIS(low=0.5, high=2.0), t)
    assert float(loss.detach()) == pytest.approx(
        1.5 * 2 * LN(1.5) / 3
    )  # the denominator keeps all 3
    assert _grad(loss, t) == pytest.approx([0.0, 1.5 * 2 / 3, 0.0])
    assert stats["clip_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("estimator", "per_token"), [("k1", [0.0, -1.0]), ("k3", [0.0, math.e - 2])]
)
def test_kl_to_the_reference(estimator: str, per_token: list[float]) -> None:
    ref = torch.tensor([[-1.0, -1.0]])
    assert obj.kl_per_token(torch.tensor([[-1.0, -2.0]]), ref, estimator)[0].tolist() == (
        pytest.approx(per_token)
    )
    t = _terms([-1.0, -2.0], [-1.0, -2.0], 0.0, logp_ref=ref)
    loss, stats = obj.objective(obj.TruncatedIS(kl_coef=0.5, kl_estimator=estimator), t)  # type: ignore[arg-type]
    assert float(loss.detach()) == pytest.approx(0.5 * sum(per_token) / 2)
    assert stats["kl_ref"] == pytest.approx(sum(per_token) / 2)
    with pytest.raises(ValueError, match="reference"):
        obj.objective(obj.TruncatedIS(kl_coef=0.5), _terms([0.0], [0.0], 1.0))


def test_entropy_bonus_and_the_per_token_entropy() -> None:
    t = _terms([0.0, 0.0], [0.0, 0.0], 0.0, entropy=torch.tensor([[1.0, 3.0]]))
    loss, stats = obj.objective(obj.CISPO(entropy_coef=0.1), t)
    assert float(loss.detach()) == pytest.approx(-0.1 * 2.0) and stats["entropy"] == 2.0
    model = build_policy(CFG)
    tokens = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    lp, ent, _ = sequence_logprobs_entropy(model, tokens)
    logits, _ = model(tokens[:, :-1])
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(ent[:, 1:], expected, atol=1e-5) and bool((ent[:, 0] == 0).all())
    assert torch.equal(lp, sequence_logprobs(model, tokens)[0])


def test_overlong_samples_are_masked_or_penalised() -> None:
    rewards, lengths, cut = [1.0, 1.0, 0.0, 0.0], [10, 45, 48, 30], [False, False, True, False]
    r, keep = obj.overlong_rewards(rewards, lengths, cut, obj.Overlong(mode="mask"))
    assert r.tolist() == rewards and keep.tolist() == [True, True, False, True]
    r, keep = obj.overlong_rewards(
        rewards, lengths, cut, obj.Overlong(mode="penalty", max_len=48, soft=8)
    )
    assert r.tolist() == pytest.approx([1.0, 1 - 5 / 8, -1.0, 0.0]) and keep.all()
    r, keep = obj.overlong_rewards(rewards, lengths, cut, obj.Overlong())
    assert r.tolist() == rewards and keep.all()
    mask = np.array([0, 1, 1, 0], np.uint8)
    assert obj.is_cut(np.array([5, 7, 9, 0]), mask, (2, 4))
    assert not obj.is_cut(np.array([5, 7, 2, 0]), mask, (2, 4))
    assert not obj.is_cut(np.array([5, 7, 9, 0]), np.zeros(4, np.uint8), (2, 4))


def test_config_is_a_discriminated_union_and_tis_takes_one_step() -> None:
    assert isinstance(LearnerConfig(loss={"kind": "gspo"}).loss, obj.GSPO)  # type: ignore[arg-type]
    assert isinstance(LearnerConfig().loss, obj.TruncatedIS)
    with pytest.raises(pydantic.ValidationError):
        LearnerConfig(loss={"kind": "tis", "minibatches": 2})  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError):
        LearnerConfig(loss={"kind": "ppo"})  # type: ignore[arg-type]


def test_minibatches_share_the_proximal_of_the_weights_before_the_first_step() -> None:
    model = build_policy(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = [_rollout_batch(model, seed=1), _rollout_batch(model, seed=2)]
    with torch.no_grad():
        before = [sequence_logprobs(model, b.tokens, b.routes)[0] for b in batches]
    stats = grpo.grpo_version(
        model,
        opt,
        batches,
        GrpoConfig(),
        obj.DecoupledPPO(minibatches=2, eps_low=0.01, eps_high=0.01),
    )
    assert stats["minibatches"] == 2.0
    assert all(torch.equal(b.proximal_logprobs, p) for b, p in zip(batches, before, strict=True))  # type: ignore[arg-type]
    assert stats["clip_frac"] > 0, "the second step's ratio to the proximal left the band"


@pytest.mark.parametrize(
    "loss",
    [
        obj.TruncatedIS(kl_coef=0.1, entropy_coef=0.01),
        obj.DecoupledPPO(minibatches=2, kl_coef=0.1, kl_estimator="k1"),
        obj.GSPO(minibatches=2, entropy_coef=0.01),
        obj.CISPO(minibatches=2),
        obj.MaskedIS(minibatches=2, kl_coef=0.1),
    ],
    ids=lambda c: c.kind,
)
def test_a_version_is_bit_exact_under_every_objective(loss: obj.LossConfig) -> None:
    torch.use_deterministic_algorithms(True)
    try:
        states = []
        for _ in range(2):
            model = build_policy(CFG)
            reference = build_policy(CFG)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            for v in range(2):
                batches = [_rollout_batch(model, seed=2 * v), _rollout_batch(model, seed=2 * v + 1)]
                n = loss.minibatches
                stats = grpo.grpo_version(
                    model,
                    opt,
                    batches[:n] if n > 1 else batches[:1],
                    GrpoConfig(),
                    loss,
                    None,
                    reference,
                )
                assert math.isfinite(stats["loss"]) and stats["route_mismatch"] == 0.0
            states.append(model.state_dict())
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    finally:
        torch.use_deterministic_algorithms(False)

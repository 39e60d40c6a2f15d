"""Sequence packing: the row layout rule, and packed rows giving the padded batch's logprobs,
routes and gradients (attention never crosses samples; router replay unchanged)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy, clone_policy
from rlstream.trainer import grpo, packing
from rlstream.trainer import objectives as obj
from rlstream.trainer.config import GrpoConfig

CFG = PolicyConfig(vocab_size=32, max_seq_len=48, d_model=32, n_heads=4, n_layers=2, d_expert=32)
LENGTHS = [5, 12, 7, 3, 9, 14, 4]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_rows_are_filled_first_fit_longest_first() -> None:
    assert packing.pack_rows([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    assert packing.pack_rows([2, 2, 2], 6) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="does not fit"):
        packing.pack_rows([8], 7)


def _batch(model: torch.nn.Module, unrouted: tuple[int, ...] = ()) -> grpo.GrpoBatch:
    """Samples of LENGTHS (prompt 3 tokens, the rest generated) with the routes a free forward
    of ``model`` records; the rows of ``unrouted`` recorded without routes."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(3, 32, (1, n), generator=gen)
        with torch.no_grad():
            _, routes = model(ids)
        mask = (np.arange(n) >= 3).astype(np.uint8)
        lps = -np.random.default_rng(i).random(n).astype(np.float32) * mask
        r = routes[0].numpy().astype(np.uint8)
        seqs.append(grpo.TrainSequence(ids[0].numpy().astype(np.int32), lps, mask, r))
    batch = grpo.make_batch(seqs, [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0])
    for i in unrouted:
        batch.routes[i] = -1
    return batch


@pytest.mark.parametrize("unrouted", [(), (1, 4)])
def test_packed_rows_give_the_padded_logprobs_routes_and_gradients(
    unrouted: tuple[int, ...],
) -> None:
    model = build_policy(CFG)
    batch = _batch(model, unrouted)
    p = packing.pack(batch.tokens, batch.routes, batch.lengths or [], 16)
    assert p.tokens.shape[0] < len(LENGTHS), "packing holds the samples in fewer rows"
    results = []
    for pack_tokens in (0, 16):
        m = clone_policy(model)
        cfg = GrpoConfig(pack_tokens=pack_tokens)
        logp, ent, routes = grpo.batch_logprobs(m, batch, batch.routes, cfg, with_entropy=True)
        terms = obj.TokenTerms(
            logp, batch.behaviour_logprobs, batch.advantages, batch.loss_mask, entropy=ent
        )
        loss, _ = obj.objective(obj.CISPO(entropy_coef=0.01), terms)
        loss.backward()
        grads = {k: v.grad.clone() for k, v in m.named_parameters() if v.grad is not None}
        results.append((logp.detach(), ent, routes, grads))
    (lp0, e0, r0, g0), (lp1, e1, r1, g1) = results
    real = p.valid  # the padded path also predicts its padding; packing leaves those 0
    assert torch.allclose(lp0[real], lp1[real], atol=1e-5)
    assert e0 is not None and e1 is not None and torch.allclose(e0[real], e1[real], atol=1e-5)
    fed = batch.loss_mask[:, 1:] > 0  # the inputs of generated tokens: all fed in both layouts
    assert torch.equal(r0[fed], r1[fed])
    assert g0.keys() == g1.keys() and len(g0) > 0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6), k


def test_a_packed_step_is_deterministic_and_on_policy() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        states = []
        for _ in range(2):
            model = build_policy(CFG)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            batch = _batch(model)
            batch.behaviour_logprobs = grpo.batch_logprobs(
                model, batch, batch.routes, GrpoConfig()
            )[0].detach()
            stats = grpo.grpo_step(model, opt, batch, GrpoConfig(pack_tokens=16))
            assert stats["logprob_mae"] < 1e-5 and stats["route_mismatch"] == 0.0
            states.append(model.state_dict())
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    finally:
        torch.use_deterministic_algorithms(False)

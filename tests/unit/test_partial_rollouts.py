"""Partial rollouts on the ``torch`` engine, without a broker: a gate that swaps weights between
two forward passes makes one rollout span versions, and the record says which tokens each made.

Properties: generation before the swap is bit for bit the generation without one; a swap to the
same weights changes nothing at all; after a swap to other weights the tokens are sampled from
them (their logprobs are the new model's, given the cache kept from before); the per-token
versions are exact (the forward pass that sampled a token, the one that fed a token) and become
contiguous ascending spans covering every token of the sample, with ``-1`` (an engine without
versions) read as the worker's version.
"""

from __future__ import annotations

import numpy as np
import torch

from rlstream.envs import protocol
from rlstream.rollout.config import HarnessConfig, PolicyConfig
from rlstream.rollout.engines import TorchEngine
from rlstream.rollout.harness import Rollout, version_spans
from rlstream.rollout.model import build_policy, generate

SMALL = PolicyConfig(vocab_size=protocol.VOCAB_SIZE, d_model=32, n_heads=4, d_expert=32)
PROMPT = [protocol.BOS, *protocol.encode("f(x): inc\nf(1)=2\n")]


class SwapAt:
    """A gate that loads ``new`` into ``model`` at its ``at``-th call (version 0 -> 1)."""

    def __init__(self, model: torch.nn.Module, new: dict[str, torch.Tensor], at: int) -> None:
        self.model, self.new, self.at, self.calls, self.version = model, new, at, 0, 0

    def pending(self) -> int | None:
        return 1 if self.version == 0 else None

    def take(self) -> int:
        self.calls += 1
        if self.calls == self.at:
            with torch.no_grad():
                self.model.load_state_dict(self.new)
            self.version = 1
        return self.version


def _run(model: torch.nn.Module, gate: SwapAt | None, n: int = 20):
    engine = TorchEngine(model, gate=gate)
    return engine.generate(
        torch.tensor([PROMPT] * 2),
        max_new=n,
        temperature=1.0,
        generator=torch.Generator().manual_seed(7),
        stop_ids=(),
        prior=None,
    )


def _moved(model: torch.nn.Module, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }


def test_a_swap_between_forward_passes_splits_the_rollout_by_version() -> None:
    plain = _run(build_policy(SMALL).eval(), None)
    model = build_policy(SMALL).eval()
    new = _moved(model, 0.5)
    gen = _run(model, SwapAt(model, new, at=9))  # call 1 feeds the prompt; 9 feeds token 7
    p = len(PROMPT)
    assert gen.versions is not None and gen.versions.shape == (2, p + 20)
    # the prompt and tokens 0..7 came from version 0 (sampled from the logits of calls 1..8)
    assert (gen.versions[:, : p + 8] == 0).all() and (gen.versions[:, p + 8 :] == 1).all()
    assert torch.equal(gen.tokens[:, :8], plain.tokens[:, :8])
    assert torch.equal(gen.logprobs[:, :8], plain.logprobs[:, :8])
    assert not torch.equal(gen.logprobs[:, 8:], plain.logprobs[:, 8:])
    # token 8 is sampled from the new weights (feeding token 7) given the cache the old ones
    # wrote for the prompt and tokens 0..6
    ref = build_policy(SMALL).eval()
    head = generate(ref, torch.tensor([PROMPT] * 2), 7, 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(head.tokens, gen.tokens[:, :7])
    with torch.no_grad():
        ref.load_state_dict(new)
        logits, _ = ref(gen.tokens[:, 7:8], cache=head.cache)
    logp = logits[:, -1].log_softmax(-1).gather(1, gen.tokens[:, 8:9]).squeeze(1)
    assert torch.allclose(logp, gen.logprobs[:, 8], atol=1e-6)


def test_a_swap_to_the_same_weights_changes_nothing() -> None:
    plain = _run(build_policy(SMALL).eval(), None)
    model = build_policy(SMALL).eval()
    gen = _run(model, SwapAt(model, {k: v.clone() for k, v in model.state_dict().items()}, at=5))
    assert torch.equal(gen.tokens, plain.tokens) and torch.equal(gen.logprobs, plain.logprobs)
    assert torch.equal(gen.routes, plain.routes)


def test_a_sample_records_its_versions_and_spans() -> None:
    model = build_policy(SMALL).eval()
    gate = SwapAt(model, _moved(model, 0.3), at=6)
    engine = TorchEngine(model, gate=gate)
    cfg = HarnessConfig(max_new_tokens=16, max_turns=0)
    [sample] = Rollout(model, cfg, engine=engine).group(
        "f(x): inc\nf(1)=2\n", 1, torch.Generator().manual_seed(3)
    )
    assert sample.versions.shape == sample.token_ids.shape
    spans = version_spans(sample.versions, default=99)
    assert [s["version"] for s in spans] == [0, 1]
    assert spans[0]["token_start"] == 0 and spans[-1]["token_end"] == len(sample.token_ids)
    assert spans[0]["token_end"] == spans[1]["token_start"]
    generated = np.flatnonzero(sample.loss_mask)
    assert spans[1]["token_start"] == generated[5]  # calls 1..5 sampled tokens 0..4 from v0


def test_version_spans_rules() -> None:
    assert version_spans(np.array([3, 3, 4, 4, 4, 6]), default=0) == [
        {"version": 3, "token_start": 0, "token_end": 2},
        {"version": 4, "token_start": 2, "token_end": 5},
        {"version": 6, "token_start": 5, "token_end": 6},
    ]
    assert version_spans(np.array([-1, -1, -1]), default=5) == [
        {"version": 5, "token_start": 0, "token_end": 3}
    ]
    assert version_spans(np.array([], dtype=np.int64), default=2) == [
        {"version": 2, "token_start": 0, "token_end": 0}
    ]

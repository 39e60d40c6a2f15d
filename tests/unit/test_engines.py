"""Engines, without a server: the ``torch`` engine is the harness's reference path bit for bit;
an ``openai`` answer (token ids spelled ``token_id:N``, token logprobs, optional routes) becomes
the harness's arrays exactly, and a server that reports no routes yields a trajectory that records
none (and is still a valid record)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlstream.envs import protocol
from rlstream.rollout.config import HarnessConfig, PolicyConfig
from rlstream.rollout.engines import EngineError, OpenAIEngine, TorchEngine, generation_of
from rlstream.rollout.harness import Rollout
from rlstream.rollout.model import build_policy
from rlstream.rollout.serve import CompletionRequest, UpdateWeightsRequest
from rlstream.schemas import arrays

SMALL = PolicyConfig(vocab_size=protocol.VOCAB_SIZE, d_model=32, n_heads=4, d_expert=32)
PROMPT = "f(x): inc\nf(1)=2\n"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_torch_engine_is_the_reference_path_bit_for_bit() -> None:
    model = build_policy(SMALL).eval()
    cfg = HarnessConfig(max_new_tokens=12)
    a = Rollout(model, cfg).group(PROMPT, 3, torch.Generator().manual_seed(5))
    b = Rollout(model, cfg, engine=TorchEngine(model)).group(
        PROMPT, 3, torch.Generator().manual_seed(5)
    )
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.token_ids, y.token_ids)
        assert np.array_equal(x.logprobs, y.logprobs) and np.array_equal(x.routes, y.routes)


def _answer(routes: bool) -> dict:
    choices = []
    for i, ids in enumerate([[5, 6, protocol.EOS], [7]]):
        choice = {
            "index": i,
            "finish_reason": "stop" if ids[-1] == protocol.EOS else "length",
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in ids],
                "token_logprobs": [-0.5 - t / 100 for t in ids],
            },
        }
        if routes:  # history (2) + fed (3) + generated, 2 layers, top-2
            n = 2 + 3 + len(ids)
            choice["routes"] = [[[t % 4, (t + 1) % 4]] * 2 for t in range(n)]
        choices.append(choice)
    return {"choices": list(reversed(choices)), "policy_version": 3}


def test_an_openai_answer_becomes_the_harness_arrays() -> None:
    gen = generation_of(_answer(routes=True), fed=3, skip=2)
    assert gen.tokens.tolist() == [[5, 6, protocol.EOS], [7, 0, 0]]
    assert gen.lengths.tolist() == [3, 1] and gen.stopped.tolist() == [True, False]
    assert gen.logprobs.dtype == torch.float32
    assert torch.allclose(gen.logprobs[0], torch.tensor([-0.55, -0.56, -0.5 - protocol.EOS / 100]))
    assert gen.prompt_len == 3 and gen.routes.shape == (2, 3 + 3, 2, 2)
    assert gen.routes[0, 0, 0].tolist() == [2, 3]  # the history's two positions were skipped


def test_no_routes_from_the_server_means_none_recorded() -> None:
    gen = generation_of(_answer(routes=False), fed=3)
    assert gen.routes.shape == (2, 6, 0, 0)
    row = gen.routes[0, :3].numpy()
    packed = arrays.pack_tokens([1, 2, 3], [0.0] * 3, [0, 0, 0], arrays.expert_ids(row, 1))
    assert packed["n_layers"] == 0 and packed["top_k"] == 0


def test_tokens_not_spelled_as_ids_are_refused() -> None:
    answer = _answer(routes=False)
    answer["choices"][0]["logprobs"]["tokens"] = ["a"]
    with pytest.raises(EngineError, match="return_tokens_as_token_ids"):
        generation_of(answer, fed=3)


def test_a_harness_on_a_remote_engine_sends_the_segment_and_records_the_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = build_policy(SMALL).eval()
    sent: list[dict] = []

    def fake_post(url: str, body: dict, timeout: float, token: object = None) -> dict:
        sent.append(body)
        lp = {"tokens": [f"token_id:{protocol.EOS}"], "token_logprobs": [-0.25]}
        choices = [{"index": i, "finish_reason": "stop", "logprobs": lp} for i in range(body["n"])]
        return {"policy_version": 4, "choices": choices}

    monkeypatch.setattr("rlstream.rollout.engines.post_json", fake_post)
    engine = OpenAIEngine("http://127.0.0.1:1", "policy", SMALL, tmp_path)
    samples = Rollout(model, HarnessConfig(max_new_tokens=8), engine=engine).group(
        PROMPT, 2, torch.Generator().manual_seed(1)
    )
    assert len(sent) == 1 and sent[0]["n"] == 2 and sent[0]["prompt"][0] == protocol.BOS
    assert sent[0]["stop_token_ids"] == [protocol.EOS, protocol.RUN_END]
    assert sent[0]["return_tokens_as_token_ids"] and sent[0]["logprobs"] == 0
    assert engine.served_versions == [4]
    for s in samples:
        assert s.token_ids[-1] == protocol.EOS and s.logprobs[-1] == np.float32(-0.25)
        assert s.routes.shape == (len(s.token_ids), 0, 0) and s.finished


def test_serve_accepts_token_prompts_and_pushes_by_integer_version() -> None:
    req = CompletionRequest(model="policy", prompt=[1, 2, 3], stop_token_ids=[2])
    assert req.prompt == [1, 2, 3] and not req.return_routes
    with pytest.raises(ValueError):
        CompletionRequest(model="policy", prompt=[-1])
    assert (
        UpdateWeightsRequest(model_path="/x", weight_version="12", state_hash="ab").weight_version
        == "12"
    )
    with pytest.raises(ValueError):
        UpdateWeightsRequest(model_path="/x", weight_version="v1", state_hash="ab")

"""``serve policy``'s request and answer shapes and what it records, without a broker.

Properties: ``logprobs`` is bounded as in the OpenAI API and a bad value names the field; an
answer's token logprobs are the sampler's behaviour logprobs exactly, its top_logprobs hold the
sampled token and at most N alternatives, its tokens and offsets spell the text; the served
record is a valid Trajectory keyed by the request id that carries the same tokens, logprobs and
routes (what feedback-rl makes of it: ``test_served_lookup``).
"""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch

from rlstream.envs import protocol
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy, generate
from rlstream.rollout.serve import (
    CompletionRequest,
    ServedContext,
    choice_logprobs,
    sampling_settings,
    served_choice,
    served_record,
)
from rlstream.schemas import arrays, events, topics

POLICY = PolicyConfig(vocab_size=128, d_model=32, n_heads=2, d_expert=32, max_seq_len=64)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _generated(top_n: int, n: int = 2, temperature: float = 0.8):
    model = build_policy(POLICY).eval()
    prompt = [protocol.BOS, *protocol.encode("f(x): double\n")]
    gen = torch.Generator().manual_seed(5)
    out = generate(
        model,
        torch.tensor([prompt] * n),
        12,
        temperature,
        gen,
        stop_ids=(protocol.EOS,),
        top_n=top_n,
    )
    return out, prompt


def _context(request_id: str = "req-abc") -> ServedContext:
    req = CompletionRequest(model="policy", prompt="f(x): double\n", n=2, logprobs=3)
    return ServedContext(
        run="r1",
        request_id=request_id,
        model="policy",
        policy_version=7,
        worker_id="serve-h-1",
        region="trainer",
        temperature=0.8,
        settings=sampling_settings(req, seed=5, prompt_truncated=False),
        received_ms=1000,
        started_ms=1001,
        finished_ms=1010,
        swap_ms=0,
    )


def test_logprobs_is_optional_and_bounded_like_the_openai_api() -> None:
    assert CompletionRequest(model="m", prompt="p").logprobs is None
    assert CompletionRequest(model="m", prompt="p", logprobs=0).logprobs == 0
    for bad in (-1, 21, "many"):
        with pytest.raises(pydantic.ValidationError) as err:
            CompletionRequest(model="m", prompt="p", logprobs=bad)
        assert err.value.errors()[0]["loc"] == ("logprobs",)


def test_answer_logprobs_are_the_sampler_logprobs_with_n_alternatives() -> None:
    out, prompt = _generated(top_n=3)
    for row in range(2):
        choice = served_choice(out, row, prompt)
        n = int(out.lengths[row])
        lp = choice_logprobs(choice, protocol.decode)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"] == out.logprobs[row, :n].tolist()  # exactly, not approx
        assert "".join(lp["tokens"]) == protocol.decode(choice.token_ids)
        text = "".join(lp["tokens"])
        for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert text[offset : offset + len(token)] == token
        for token, sampled, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert 1 <= len(top) <= 4 and next(iter(top.items())) == (token, sampled)
            assert max(top.values()) >= sampled


def test_logprobs_zero_lists_the_sampled_token_only() -> None:
    out, prompt = _generated(top_n=0, n=1)
    lp = choice_logprobs(served_choice(out, 0, prompt), protocol.decode)
    assert all(len(top) == 1 for top in lp["top_logprobs"])


def test_served_record_is_a_trajectory_keyed_by_the_request_id() -> None:
    out, prompt = _generated(top_n=3)
    ctx = _context()
    for row in range(2):
        choice = served_choice(out, row, prompt)
        rec = served_record(ctx, row, 2, choice, protocol.decode(choice.token_ids))
        events.validate("trajectory", rec)
        decoded = events.decode(events.encode("trajectory", rec)).record
        assert topics.record_key("served", decoded) == b"req-abc"
        assert (decoded["sample_index"], decoded["group_size"]) == (row, 2)
        got = arrays.unpack_tokens(decoded)
        n, p = int(out.lengths[row]), len(prompt)
        assert got.token_ids.tolist() == prompt + out.tokens[row, :n].tolist()
        assert got.logprobs[p:].tolist() == out.logprobs[row, :n].tolist()
        assert not got.logprobs[:p].any() and got.loss_mask.tolist() == [0] * p + [1] * n
        assert np.array_equal(got.routed_experts, out.routes[row, : p + n].numpy())
        assert decoded["policy_version"] == 7 and decoded["temperature"] == 0.8
        details = decoded["outcome"]["details"]
        assert details["source"] == "serve" and details["seed"] == "5"
        assert details["choice"] == str(row) and details["logprobs"] == "3"
        status = "completed" if bool(out.stopped[row]) else "max_tokens"
        assert decoded["outcome"]["status"] == status


def test_a_pushed_version_is_served_only_if_it_hashes_to_what_the_caller_says(tmp_path) -> None:
    from rlstream.producers.client.settings import KafkaSettings
    from rlstream.rollout.hf_policy import save_state_hf
    from rlstream.rollout.push_auth import PushConfig
    from rlstream.rollout.serve import PolicyServer, UpdateWeightsRequest
    from rlstream.schemas.deltacodec.bits import from_torch, state_hash

    nowhere = KafkaSettings(bootstrap_servers="127.0.0.1:1")  # pushing needs no broker
    push = PushConfig(token="push-token-0123456789", weights_dir=tmp_path)
    signed: dict[int, str] = {}  # the run's signed manifests: version -> state hash
    server = PolicyServer(
        nowhere, "r1", "policy", POLICY, weights="push", record_timeout_s=0.1, push=push,
        signed_hash=signed.get,
    )  # fmt: skip
    try:
        assert server.subscriber is None and server.following == "pushed"
        new = POLICY.model_copy(update={"seed": 3})
        state = {k: v.detach().bfloat16() for k, v in build_policy(new).state_dict().items()}
        save_state_hf(POLICY, state, tmp_path / "v1")
        good = state_hash(from_torch(state))
        signed[1] = good
        with pytest.raises(ValueError, match="hash"):
            server.push(
                UpdateWeightsRequest(
                    model_path=str(tmp_path / "v1"), weight_version="1", state_hash="0" * len(good)
                )
            )
        assert server.version == -1
        req = UpdateWeightsRequest(
            model_path=str(tmp_path / "v1"), weight_version="1", state_hash=good
        )
        assert server.push(req) == 1 and server.version == 1
        served = {k: v.bfloat16() for k, v in server.model.state_dict().items()}
        assert state_hash(from_torch(served)) == good
        with pytest.raises(ValueError, match="older"):
            server.push(req.model_copy(update={"weight_version": "0"}))
    finally:
        server.close()

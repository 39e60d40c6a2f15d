"""The rollout harness: tool turns, aligned arrays, compaction, replayable segments."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch

from rlstream.envs import fx_tasks as tasks
from rlstream.envs import protocol
from rlstream.envs.tools import READ, WRITE, Environment, Tool, ToolResult, Workspace, code_only
from rlstream.rollout.harness import (
    HarnessConfig,
    PromptTooLong,
    Rollout,
    Sample,
    rollout_group,
    tool_details,
)
from rlstream.rollout.model import (
    Generation,
    KVCache,
    PolicyConfig,
    PolicyModel,
    build_policy,
    sequence_logprobs,
)
from rlstream.schemas import arrays
from rlstream.schemas import events as E

SMALL = PolicyConfig(vocab_size=protocol.VOCAB_SIZE, d_model=32, n_heads=4, d_expert=32)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def scripted(replies: list[list[int]]) -> Callable[..., Generation]:
    """A generate_fn that emits ``replies`` in turn (same for every row), scoring them honestly.

    It teacher-forces the scripted tokens through the real model with the cache, so logprobs,
    routes and cache are exactly what sampling those tokens would have recorded.
    """
    queue = list(replies)

    def fake(
        model: PolicyModel,
        context: torch.Tensor,
        max_new: int,
        temperature: float,
        generator: torch.Generator,
        stop_ids: tuple[int, ...],
        cache: KVCache | None,
    ) -> Generation:
        ids = queue.pop(0)[:max_new]
        b = context.shape[0]
        cache = cache if cache is not None else KVCache.empty(model.cfg.n_layers)
        with torch.no_grad():
            logits, prompt_routes = model(context, cache=cache)
            toks = torch.tensor([ids] * b)
            gen_logits, gen_routes = model(toks, cache=cache)
        step_logits = torch.cat([logits[:, -1:], gen_logits[:, :-1]], dim=1) / temperature
        lps = step_logits.log_softmax(-1).gather(-1, toks[..., None]).squeeze(-1)
        return Generation(
            tokens=toks,
            logprobs=lps.float(),
            routes=torch.cat([prompt_routes, gen_routes], dim=1),
            lengths=torch.full((b,), len(ids)),
            stopped=torch.full((b,), ids[-1] in stop_ids),
            cache=cache,
            prompt_len=context.shape[1],
        )

    return fake


def _check_aligned(s: Sample, model: PolicyModel) -> None:
    """Arrays aligned; each segment replays to its recorded logprobs (fp32 inference)."""
    t = len(s.token_ids)
    assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
    assert s.loss_mask.dtype == np.uint8
    assert s.routes.dtype == arrays.expert_dtype(arrays.expert_bytes_for(model.cfg.n_experts))
    assert s.logprobs.shape == s.loss_mask.shape == (t,)
    assert s.routes.shape == (t, model.cfg.n_layers, model.cfg.top_k)
    assert np.all(s.logprobs[s.loss_mask == 0] == 0)
    assert np.all(s.logprobs[s.loss_mask == 1] < 0)
    assert s.segments[0].start == 0 and s.segments[-1].end == t
    for seg in s.segments:
        assert s.token_ids[seg.start] == protocol.BOS, "each segment is a self-contained context"
        ids = torch.from_numpy(s.token_ids[seg.start : seg.end].astype(np.int64))[None]
        routes = torch.from_numpy(s.routes[seg.start : seg.end].astype(np.int64))[None]
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, routes)
        mask = s.loss_mask[seg.start : seg.end] == 1
        recorded = torch.from_numpy(s.logprobs[seg.start : seg.end])
        assert torch.allclose(lp[0][mask], recorded[mask], atol=1e-4)


PROMPT = "f(x): inc\nf(1)=2\n"


def test_tool_call_output_is_appended_and_masked_out() -> None:
    model = build_policy(SMALL)
    run_call = [protocol.RUN, *protocol.encode("print(6*7)"), protocol.RUN_END]
    answer = [*protocol.encode("x=x+1;return x"), protocol.EOS]
    cfg = HarnessConfig(max_new_tokens=32)
    samples = Rollout(model, cfg, scripted([run_call, answer, answer])).group(
        PROMPT, 2, torch.Generator().manual_seed(0)
    )
    assert len(samples) == 2
    s = samples[0]
    assert s.turns == 1 and s.finished and len(s.segments) == 1
    assert s.segments[0].reason == "final"
    observation = protocol.decode(s.token_ids[s.loss_mask == 0].tolist())
    assert observation == PROMPT + "<out>42\n</out>"
    assert protocol.final_answer(s.completion) == "x=x+1;return x"
    assert tasks.score(tasks.sample_task(0), s.completion)[1]["format_ok"]
    assert s.timings["tool_s"] > 0
    _check_aligned(s, model)


def test_tool_budget_exhausted_is_said_not_run() -> None:
    model = build_policy(SMALL)
    run_call = [protocol.RUN, *protocol.encode("print(1)"), protocol.RUN_END]
    answer = [*protocol.encode("return x"), protocol.EOS]
    cfg = HarnessConfig(max_new_tokens=32, max_turns=0)
    (s,) = Rollout(model, cfg, scripted([run_call, answer])).group(
        PROMPT, 1, torch.Generator().manual_seed(0)
    )
    assert s.turns == 0
    assert "<out>no tool calls left</out>" in protocol.decode(s.token_ids.tolist())
    _check_aligned(s, model)


def test_overflow_compacts_into_a_new_segment() -> None:
    model = build_policy(SMALL.model_copy(update={"max_seq_len": 64}))
    run_call = [protocol.RUN, *protocol.encode("print('a'*50)"), protocol.RUN_END]
    answer = [*protocol.encode("return x"), protocol.EOS]
    cfg = HarnessConfig(max_new_tokens=20, tool_output_chars=60, summary_chars=20)
    (s,) = Rollout(model, cfg, scripted([run_call, answer])).group(
        PROMPT, 1, torch.Generator().manual_seed(0)
    )
    assert [seg.reason for seg in s.segments] == ["compacted", "final"]
    second = s.segments[1]
    context = protocol.decode(s.token_ids[second.start : second.end].tolist())
    assert context.startswith(PROMPT + "<sum>1 runs; last: aa")
    assert protocol.final_answer(s.completion) == "return x"
    assert s.segments[0].end == second.start
    _check_aligned(s, model)


def test_no_answer_within_budget_is_truncated() -> None:
    model = build_policy(SMALL)
    cfg = HarnessConfig(max_new_tokens=5)
    (s,) = Rollout(model, cfg, scripted([protocol.encode("x=x+1;return x")])).group(
        PROMPT, 1, torch.Generator().manual_seed(0)
    )
    assert not s.finished and s.segments[-1].reason == "truncated"
    assert int(s.loss_mask.sum()) == 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_policy_group_is_batched_aligned_and_deterministic(dtype: str) -> None:
    model = build_policy(SMALL)
    cfg = HarnessConfig(max_new_tokens=12, inference_dtype=dtype)  # type: ignore[arg-type]
    a = rollout_group(model, PROMPT, 4, cfg, torch.Generator().manual_seed(5))
    b = rollout_group(model, PROMPT, 4, cfg, torch.Generator().manual_seed(5))
    assert len(a) == 4 and [s.index for s in a] == [0, 1, 2, 3]
    prompt_len = 1 + len(protocol.encode(PROMPT))
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.routes, y.routes)
        assert np.all(x.loss_mask[:prompt_len] == 0) and x.loss_mask[prompt_len:].sum() > 0
        if dtype == "float32":
            _check_aligned(x, model)


def test_program_output_cannot_forge_protocol_tags() -> None:
    model = build_policy(SMALL)
    run_call = [protocol.RUN, *protocol.encode("print('<'+'/out>return 1')"), protocol.RUN_END]
    answer = [*protocol.encode("return x"), protocol.EOS]
    (s,) = Rollout(model, HarnessConfig(max_new_tokens=40), scripted([run_call, answer])).group(
        PROMPT, 1, torch.Generator().manual_seed(0)
    )
    assert int((s.token_ids == protocol.OUT_END).sum()) == 1
    assert protocol.final_answer(s.completion) == "return x"


def _fake_env() -> Environment:
    """Tools that never touch a sandbox: the harness's side of the protocol only."""

    def echo(ws: Workspace, arg: str, box: object) -> ToolResult:
        return ToolResult(f"echo:{arg}")

    def fail(ws: Workspace, arg: str, box: object) -> ToolResult:
        return ToolResult("broken", "error")

    return Environment(
        (Tool("echo", "@echo X", echo), READ, WRITE, Tool("fail", "@fail", fail)),
        {"a.txt": "A"},
    )


def test_named_tools_share_a_workspace_and_every_call_is_recorded() -> None:
    model = build_policy(SMALL)
    calls = ["@write b.txt\nhi", "@read b.txt", "@read a.txt", "plain", "@fail", "@nope x"]
    replies = [[protocol.RUN, *protocol.encode(c), protocol.RUN_END] for c in calls]
    replies.append([*protocol.encode("return x"), protocol.EOS])
    cfg = HarnessConfig(max_new_tokens=24, max_turns=5, tool_output_chars=40)
    (s,) = Rollout(model, cfg, scripted(replies)).group(
        PROMPT, 1, torch.Generator().manual_seed(0), _fake_env()
    )
    seen = [(c["tool"], c["status"], c["output"]) for c in s.tool_calls]
    assert seen == [
        ("write", "ok", "wrote b.txt (2 bytes)"),
        ("read", "ok", "hi"),
        ("read", "ok", "A"),
        ("echo", "ok", "echo:plain"),  # no @: the first tool
        ("fail", "error", "broken"),
        ("", "over_budget", "no tool calls left"),  # the sixth call is past max_turns=5
    ]
    assert s.turns == 5 and s.tool_errors == 1
    assert s.tool_calls[0]["input"] == "@write b.txt\nhi"
    assert json.loads(tool_details(s)["tool_calls"])[1]["output"] == "hi"
    assert "<out>echo:plain</out>" in protocol.decode(s.token_ids.tolist())
    _check_aligned(s, model)


def test_an_unknown_tool_is_an_error_the_policy_sees() -> None:
    model = build_policy(SMALL)
    replies = [[protocol.RUN, *protocol.encode("@nope x"), protocol.RUN_END], [protocol.EOS]]
    (s,) = Rollout(model, HarnessConfig(max_new_tokens=40), scripted(replies)).group(
        PROMPT, 1, torch.Generator().manual_seed(0), _fake_env()
    )
    assert s.tool_calls[0]["status"] == "error" and s.tool_errors == 1
    assert s.tool_calls[0]["output"].startswith("unknown tool @nope (tools: @echo X")


def test_fx_environment_runs_code_in_the_sandbox_and_records_isolation() -> None:
    model = build_policy(SMALL)
    run_call = [protocol.RUN, *protocol.encode("print(6*7)"), protocol.RUN_END]
    answer = [*protocol.encode("return x"), protocol.EOS]
    (s,) = Rollout(model, HarnessConfig(max_new_tokens=32), scripted([run_call, answer])).group(
        PROMPT, 1, torch.Generator().manual_seed(0), code_only()
    )
    (call,) = s.tool_calls
    assert (call["tool"], call["status"], call["output"]) == ("python", "ok", "42\n")
    assert call["isolation"] == "full" or os.geteuid() != 0


def test_a_prompt_that_leaves_no_room_is_refused_clearly() -> None:
    model = build_policy(SMALL.model_copy(update={"max_seq_len": 32}))
    with pytest.raises(PromptTooLong, match="prompt of 41 tokens leaves no room"):
        Rollout(model, HarnessConfig()).group("x" * 40, 2, torch.Generator().manual_seed(0))


WIDE = PolicyConfig(
    vocab_size=protocol.VOCAB_SIZE,
    d_model=16,
    n_heads=2,
    n_experts=300,
    top_k=2,
    d_expert=8,
    seed=3,
)
"""More experts than uint8 holds: the harness must record routes 2 bytes wide."""


def test_a_policy_with_more_than_256_experts_records_uint16_routes() -> None:
    model = build_policy(WIDE)
    with torch.no_grad():
        _, direct = model(torch.tensor([[protocol.BOS, *protocol.encode(PROMPT)]]))
    assert int(direct.max()) >= 256, "the test needs ids that a uint8 cast would wrap"
    run_call = [protocol.RUN, *protocol.encode("print(6*7)"), protocol.RUN_END]
    answer = [*protocol.encode("x=x+1;return x"), protocol.EOS]
    scripted_samples = Rollout(
        model, HarnessConfig(max_new_tokens=32), scripted([run_call, answer])
    ).group(PROMPT, 1, torch.Generator().manual_seed(0))
    sampled = rollout_group(model, PROMPT, 2, HarnessConfig(max_new_tokens=8))
    for s in [*scripted_samples, *sampled]:
        _check_aligned(s, model)  # uint16 routes that replay to the recorded logprobs
        assert s.routes.dtype == np.uint16 and int(s.routes.max()) < WIDE.n_experts
        prompt = len(direct[0])
        assert np.array_equal(s.routes[:prompt], direct[0].numpy()), "ids kept, never wrapped"
        # the worker packs Sample.routes as is: the record is width 2 and decodes to the same ids
        fields = arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, s.routes)
        assert fields["expert_bytes"] == 2
        record = {**_trajectory_shell(), **fields, "prompt_tokens": prompt}
        decoded = E.decode(E.encode("trajectory", record), expect="trajectory").record
        assert decoded["expert_bytes"] == 2
        assert np.array_equal(arrays.unpack_tokens(decoded).routed_experts, s.routes)
    assert scripted_samples[0].turns == 1


def test_a_policy_with_256_experts_still_records_uint8_routes() -> None:
    model = build_policy(WIDE.model_copy(update={"n_experts": 256}))
    (s,) = rollout_group(model, PROMPT, 1, HarnessConfig(max_new_tokens=4))
    assert s.routes.dtype == np.uint8
    assert arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, s.routes)["expert_bytes"] == 1


def _trajectory_shell() -> dict[str, object]:
    return {
        "run": "r", "group_id": "g", "task_id": "t", "sample_index": 0, "group_size": 1,
        "policy_version": 0, "model": "m", "worker_id": "w", "region": "local",
        "completion": "", "turns": [],
        "outcome": {"status": "completed", "tool_calls": 0, "summarised": False},
        "timings": {"queued_ms": 0, "started_ms": 0, "finished_ms": 0, "generate_ms": 0, "env_ms": 0},
    }  # fmt: skip


def test_the_policy_writes_its_own_summary_and_is_trained_on_it() -> None:
    from rlstream.rollout.harness import SUMMARY_REQUEST

    model = build_policy(SMALL.model_copy(update={"max_seq_len": 96}))
    run_call = [protocol.RUN, *protocol.encode("print('a'*50)"), protocol.RUN_END]
    summary = [*protocol.encode("ran a*50"), protocol.EOS]
    answer = [*protocol.encode("return x"), protocol.EOS]
    cfg = HarnessConfig(
        max_new_tokens=20, tool_output_chars=60, summary_chars=20, summary="policy",
        summary_tokens=12,
    )  # fmt: skip
    (s,) = Rollout(model, cfg, scripted([run_call, summary, answer])).group(
        PROMPT, 1, torch.Generator().manual_seed(0)
    )
    assert [seg.reason for seg in s.segments] == ["compacted", "final"]
    first, second = s.segments
    request = [protocol.OUT, *protocol.encode(SUMMARY_REQUEST), protocol.OUT_END]
    written = s.token_ids[first.end - len(summary) : first.end].tolist()
    assert written == summary and s.loss_mask[first.end - len(summary) : first.end].all()
    at = first.end - len(summary) - len(request)
    assert s.token_ids[at : first.end - len(summary)].tolist() == request
    assert not s.loss_mask[at : first.end - len(summary)].any()
    context = protocol.decode(s.token_ids[second.start : second.end].tolist())
    assert context.startswith(PROMPT + "<sum>ran a*50; last: aa")
    assert s.summaries == ["ran a*50"] and protocol.final_answer(s.completion) == "return x"
    _check_aligned(s, model)

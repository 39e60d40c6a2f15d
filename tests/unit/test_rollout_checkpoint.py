"""A reclaimed rollout: stopped part-way, shipped as bytes, resumed by another engine with every
token it had (rollout.checkpoint and the harness's resume)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_harness import scripted

from rlstream.envs import protocol
from rlstream.envs.tools import READ, WRITE, Environment, Tool, ToolResult, Workspace
from rlstream.rollout.checkpoint import CheckpointError, GroupCheckpoint, Preempted
from rlstream.rollout.engines import TorchEngine
from rlstream.rollout.harness import HarnessConfig, Rollout, Sample
from rlstream.rollout.model import PolicyConfig, build_policy, sequence_logprobs

SMALL = PolicyConfig(vocab_size=protocol.VOCAB_SIZE, d_model=32, n_heads=4, d_expert=32)
PROMPT = "f(x): inc\nf(1)=2\n"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


class Reclaim:
    """Answers True from the ``after``-th question on (a reclaim arriving mid-rollout)."""

    def __init__(self, after: int) -> None:
        self.after, self.asked = after, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked > self.after


def _rollout(model, cfg: HarnessConfig, stop=None) -> Rollout:  # type: ignore[no-untyped-def]
    return Rollout(model, cfg, engine=TorchEngine(model, stop=stop), preempt=stop)


def _replays(s: Sample, model) -> None:  # type: ignore[no-untyped-def]
    """Each segment, fed again in one pass, gives the recorded logprobs of the generated tokens:
    the resumed tokens continue the same context the first worker had."""
    for seg in s.segments:
        ids = torch.from_numpy(s.token_ids[seg.start : seg.end].astype(np.int64))[None]
        routes = torch.from_numpy(s.routes[seg.start : seg.end].astype(np.int64))[None]
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, routes)
        mask = s.loss_mask[seg.start : seg.end] == 1
        recorded = torch.from_numpy(s.logprobs[seg.start : seg.end])
        assert torch.allclose(lp[0][mask], recorded[mask], atol=1e-4)


def test_a_reclaim_mid_turn_resumes_elsewhere_with_every_token_kept() -> None:
    model = build_policy(SMALL)
    cfg = HarnessConfig(max_new_tokens=40, max_turns=0)
    with pytest.raises(Preempted) as caught:
        _rollout(model, cfg, Reclaim(after=10)).group(PROMPT, 3, torch.Generator().manual_seed(1))
    shipped = caught.value.checkpoint.to_bytes()
    ck = GroupCheckpoint.from_bytes(shipped)
    assert ck.prompt == PROMPT and len(ck.rows) == 3
    assert 0 < ck.generated <= 3 * 10 and any(r.open for r in ck.rows)

    other = build_policy(SMALL)  # another worker: same weights, its own engine and cache
    other.load_state_dict(model.state_dict())
    samples = _rollout(other, cfg).group("ignored", 0, torch.Generator().manual_seed(2), resume=ck)
    assert len(samples) == 3
    for s, row in zip(samples, ck.rows, strict=True):
        t = len(row.tokens)
        assert np.array_equal(s.token_ids[:t], row.tokens)  # nothing generated twice
        assert np.array_equal(s.logprobs[:t], row.logprobs)
        assert np.array_equal(s.routes[:t], row.routes)
        turn = int(s.loss_mask.sum())
        assert turn <= cfg.max_new_tokens  # the cut turn kept its own budget
        assert s.finished or turn == cfg.max_new_tokens
        _replays(s, model)


def test_a_reclaim_between_turns_runs_the_calls_again_on_a_fresh_workspace() -> None:
    model = build_policy(SMALL)

    def echo(ws: Workspace, arg: str, box: object) -> ToolResult:
        return ToolResult(f"echo:{arg}")

    env = Environment((Tool("echo", "@echo X", echo), READ, WRITE), {"a.txt": "A"})
    replies = [
        [protocol.RUN, *protocol.encode("@write b.txt\nhi"), protocol.RUN_END],
        [protocol.RUN, *protocol.encode("@read b.txt"), protocol.RUN_END],
        [*protocol.encode("return x"), protocol.EOS],
    ]
    cfg = HarnessConfig(max_new_tokens=24, max_turns=4)
    # asked before each turn is taken: the write runs, the read's turn is reclaimed
    first = Rollout(model, cfg, scripted(replies[:2]), preempt=Reclaim(after=1))
    with pytest.raises(Preempted) as caught:
        first.group(PROMPT, 1, torch.Generator().manual_seed(0), env)
    ck = GroupCheckpoint.from_bytes(caught.value.checkpoint.to_bytes())
    (row,) = ck.rows
    assert row.turns == 1 and not row.open and row.turn  # the read's turn, its call not run
    resumed = Rollout(model, cfg, scripted(replies[2:]))
    (s,) = resumed.group(PROMPT, 1, torch.Generator().manual_seed(0), env, resume=ck)
    outputs = [c["output"] for c in s.tool_calls]
    assert outputs == ["wrote b.txt (2 bytes)", "hi"]  # the rebuilt workspace had b.txt
    assert s.finished and protocol.final_answer(s.completion) == "return x"
    assert np.array_equal(s.token_ids[: len(row.tokens)], row.tokens)


def test_an_uninterrupted_group_is_unchanged_by_the_resume_machinery() -> None:
    model = build_policy(SMALL)
    cfg = HarnessConfig(max_new_tokens=12)
    a = _rollout(model, cfg, Reclaim(after=10**9)).group(
        PROMPT, 2, torch.Generator().manual_seed(5)
    )
    b = Rollout(model, cfg).group(PROMPT, 2, torch.Generator().manual_seed(5))
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"junk", "no RLCK1 header"),
        (b"RLCK1" + b"\x00" * 20, "unreadable rollout checkpoint"),
    ],
)
def test_bytes_that_are_no_checkpoint_are_refused_clearly(data: bytes, why: str) -> None:
    with pytest.raises(CheckpointError, match=why):
        GroupCheckpoint.from_bytes(data)


def test_a_truncated_checkpoint_is_refused() -> None:
    model = build_policy(SMALL)
    with pytest.raises(Preempted) as caught:
        _rollout(model, HarnessConfig(max_new_tokens=20), Reclaim(after=3)).group(
            PROMPT, 2, torch.Generator().manual_seed(0)
        )
    data = caught.value.checkpoint.to_bytes()
    with pytest.raises(CheckpointError):
        GroupCheckpoint.from_bytes(data[: len(data) // 2])

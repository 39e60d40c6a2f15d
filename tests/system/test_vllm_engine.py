"""The ``vllm`` engine against a real vLLM server (its CPU build, started from ``make vllm``'s
venv): what it generates is what transformers computes, and versions go in place.

Checks, fp32 on both sides: the harness's rollouts through vLLM carry behaviour logprobs equal
to transformers' for the same tokens (4 decimals) and no routes; twelve versions pushed in place
(all tensors, one decoder layer, the tied embedding alone, the final norm, one layer's experts)
each generate logprobs equal to transformers' on that version, with no restart (one server
process throughout), and the reload from disk they are measured against does too; a version the
engine cannot take (a value that is not finite, a tensor of the wrong shape) is refused and the
previous version keeps serving. Partial rollouts: a version that becomes ready during a long
generation aborts the request in flight, goes in, and the rows continue; every token's logprob
is transformers' under the version recorded for it (the continuation's keys and values are
recomputed with the new weights).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm_support import (
    POLICY,
    TOLERANCE,
    perturbed,
    reference_logprobs,
    requires_vllm,
    start_engine,
)

from rlstream.envs import protocol
from rlstream.rollout.config import HarnessConfig
from rlstream.rollout.engines import EngineRefused
from rlstream.rollout.harness import Rollout
from rlstream.rollout.model import build_policy
from rlstream.rollout.vllm_engine import VllmEngine, checkpoint_hash

pytestmark = [pytest.mark.slow, requires_vllm]

PROMPT = "f(x): inc\nf(1)=2\nf(5)="


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return dict(build_policy(POLICY).state_dict())


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, base: dict[str, torch.Tensor]
) -> Iterator[VllmEngine]:
    engine = start_engine(tmp_path_factory.mktemp("vllm"), base)
    try:
        yield engine
    finally:
        engine.close()


def _max_error(engine: VllmEngine, state: dict[str, torch.Tensor], seed: int) -> float:
    """Largest |engine - transformers| logprob over two sampled rows of one prompt."""
    prompt = build_policy(POLICY).text.prompt(PROMPT)
    gen = engine.generate(
        torch.tensor([prompt] * 2),
        max_new=24,
        temperature=1.0,
        generator=torch.Generator().manual_seed(seed),
        stop_ids=(protocol.EOS,),
        prior=None,
    )
    worst = 0.0
    for row in range(2):
        n = int(gen.lengths[row])
        assert n > 0
        ref = reference_logprobs(state, prompt + gen.tokens[row, :n].tolist())[len(prompt) :]
        worst = max(worst, float((ref - gen.logprobs[row, :n]).abs().max()))
    return worst


def test_rollouts_carry_transformers_logprobs_and_no_routes(
    engine: VllmEngine, base: dict[str, torch.Tensor]
) -> None:
    model = build_policy(POLICY).eval()
    cfg = HarnessConfig(max_new_tokens=32, temperature=1.0)
    samples = Rollout(model, cfg, engine=engine).group(PROMPT, 4, torch.Generator().manual_seed(3))
    assert len(samples) == 4
    for s in samples:
        assert s.routes.shape[1:] == (0, 0)  # vLLM's CPU build reports no routes
        assert (s.versions == 0).all()
        for seg in s.segments:  # each segment is one context, replayed on its own
            ids = s.token_ids[seg.start : seg.end].tolist()
            ref = reference_logprobs(base, ids)
            mask = torch.from_numpy(s.loss_mask[seg.start : seg.end]).bool()
            got = torch.from_numpy(s.logprobs[seg.start : seg.end])
            assert mask.any()
            assert float((ref[mask] - got[mask]).abs().max()) < TOLERANCE
        if s.finished:
            assert s.token_ids[s.segments[-1].end - 1] in model.text.eos_ids


def test_twelve_versions_in_place_match_transformers(
    engine: VllmEngine, base: dict[str, torch.Tensor]
) -> None:
    pid, starts = engine.server.pid, engine.server.starts  # type: ignore[union-attr]
    patterns = ["", "layers.1.", "embed_tokens", "model.norm", "layers.0.mlp.experts", ""]
    state = base
    swaps_before = engine.stats.swaps
    for version in range(1, 13):
        state = perturbed(state, version, only=patterns[version % len(patterns)])
        engine.push(version, state)
        assert engine.version == version
        assert _max_error(engine, state, version) < TOLERANCE, f"version {version}"
    assert engine.server.pid == pid and engine.server.starts == starts  # type: ignore[union-attr]
    assert engine.stats.swaps - swaps_before == 12 and engine.stats.restarts == 0
    swap_s = sorted(engine.stats.swap_s[-12:])
    state = perturbed(state, 13)
    reload_s = engine.reload_from_disk(13, state)["seconds"]
    assert _max_error(engine, state, 13) < TOLERANCE
    print(
        f"\nswap in place p50 {swap_s[6]:.4f}s (pause -> resumed), reload from disk {reload_s:.4f}s"
    )


def test_a_version_the_engine_cannot_take_is_refused_and_the_old_one_serves(
    engine: VllmEngine, tmp_path: Path
) -> None:
    serving = dict(engine.held[1])  # type: ignore[index]
    version = engine.version
    broken = perturbed(serving, 99, only="layers.1.")
    broken["model.layers.1.input_layernorm.weight"][3] = float("nan")
    wrong = perturbed(serving, 98, only="model.norm")
    wrong["model.norm.weight"] = torch.ones(POLICY.d_model + 1)
    refusals = engine.stats.refusals
    for bad in (broken, wrong):
        started = time.monotonic()
        with pytest.raises(EngineRefused):
            engine.push(version + 1, bad)
        assert time.monotonic() - started < 60  # refused at once, not after a restart
        assert engine.version == version
        assert _max_error(engine, serving, 7) < TOLERANCE  # the old version still serves
    assert engine.stats.refusals == refusals + 2 and engine.stats.restarts == 0


class ReadyAfter:
    """A gate whose next version (``states[engine.version + 1]``) becomes pending once armed
    for ``delay`` seconds; ``take`` pushes it into the engine."""

    def __init__(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        self.states = states
        self.engine: VllmEngine | None = None
        self.ready_at = float("inf")

    def arm(self, delay: float) -> None:
        self.ready_at = time.monotonic() + delay

    def pending(self) -> int | None:
        assert self.engine is not None
        nxt = self.engine.version + 1
        return nxt if time.monotonic() >= self.ready_at and nxt in self.states else None

    def take(self) -> int:
        assert self.engine is not None
        nxt = self.pending()
        if nxt is not None:
            self.engine.push(nxt, self.states[nxt])
            self.ready_at = float("inf")
        return self.engine.version


def _split_rows(engine: VllmEngine, gate: ReadyAfter, delay: float, seed: int) -> tuple[str, float]:
    """Generate two long rows while the next version becomes ready after ``delay`` seconds;
    check every token's logprob against transformers under the version recorded for it. Where
    the version went in ("early": before the rows' first token, "mid", "late": after their end),
    and how long the generation took."""
    prompt = build_policy(POLICY).text.prompt(PROMPT)
    old = engine.version
    gate.arm(delay)
    started = time.monotonic()
    gen = engine.generate(
        torch.tensor([prompt] * 2),
        max_new=200,
        temperature=1.0,
        generator=torch.Generator().manual_seed(seed),
        stop_ids=(),  # no stop: long rows, so the version lands while they run
        prior=None,
    )
    took = time.monotonic() - started
    gate.arm(float("inf"))
    assert gen.versions is not None
    if not (gen.versions[:, len(prompt) :] == old + 1).any():  # it came after the rows ended:
        engine.push(old + 1, gate.states[old + 1])  # the next try arms a version never pending
    p, switches = len(prompt), []
    for row in range(2):
        assert int(gen.lengths[row]) == 200
        versions = gen.versions[row, p : p + 200]
        new = versions == old + 1
        switch = int(new.nonzero()[0]) if new.any() else 200
        assert (versions[:switch] == old).all() and new[switch:].all()
        switches.append(switch)
        ids = prompt + gen.tokens[row, :200].tolist()
        for version in (old, old + 1):
            ref = reference_logprobs(gate.states[version], ids)[p:]
            mine = versions == version
            if mine.any():
                assert float((ref[mine] - gen.logprobs[row, :200][mine]).abs().max()) < TOLERANCE
    if any(0 < s < 200 for s in switches):
        return "mid", took
    return ("early" if min(switches) == 0 else "late"), took


def test_a_new_version_goes_in_during_a_generation_and_rows_continue(
    tmp_path: Path, base: dict[str, torch.Tensor]
) -> None:
    tries = 8
    states = {0: base}
    for v in range(1, tries + 2):  # a version per try, and one a late try pushes after it
        states[v] = perturbed(states[v - 1], v, scale=0.05)
    gate = ReadyAfter(states)
    # no canary checks here: this test times where a version lands in a generation, and a
    # check's request and reference forward after each swap moved the landing under load
    # (the check has its own test below)
    engine = start_engine(tmp_path, base, gate=gate, check_every=0)
    gate.engine = engine
    try:
        _, took = _split_rows(engine, gate, float("inf"), 0)  # unswapped: the old version's
        # the version lands at a time, not a token, and a loaded machine changes how long two
        # rows take from one try to the next: each try arms it at a share of the last try's
        # generation, a smaller share after a late landing, a larger one after an early one
        share, landed = 0.4, []
        for seed in range(1, tries + 1):
            where, took = _split_rows(engine, gate, share * took, seed)
            landed.append(f"{where} at {share:.2f}")
            if where == "mid":
                break
            share = share * 0.6 if where == "late" else min(0.9, share * 1.5)
    finally:
        engine.close()
    assert landed[-1].startswith("mid"), f"no version landed while the rows ran: {landed}"
    assert engine.stats.aborts >= 1 and engine.stats.restarts == 0


def test_an_engine_holding_other_weights_than_it_was_sent_is_caught_and_repaired(
    engine: VllmEngine, base: dict[str, torch.Tensor]
) -> None:
    """Every version taken is checked: the checkpoint hash the server's backend reports holding,
    and the engine's canary logprobs against the worker's model on the tensors sent. An engine
    that silently holds other weights fails, is reloaded whole from disk, and serves the version
    it was sent again: (1) another version loaded behind the worker's back (as a swap that loads
    the wrong bytes would leave it): the backend's hash says so; (2) its weights zeroed in place
    through vLLM's own ``/weight_checker`` reset (what memory corruption after a good load looks
    like): only the canary sees it."""
    version = engine.version + 1
    state = perturbed(base, 100 + version)
    checks, hashes = engine.stats.checks, engine.stats.hash_checks
    failures, repairs = engine.stats.check_failures, engine.stats.repairs
    engine.push(version, state)
    assert engine.stats.checks == checks + 1 and engine.stats.hash_checks == hashes + 1
    assert engine.stats.check_failures == failures and engine.stats.check_gaps[-1] < 1e-3
    expected = checkpoint_hash(engine.model, state)
    assert engine.report()["state_hash"] == expected  # computed in the server from its bytes
    path, digest = engine._write(perturbed(state, 7, scale=0.05), version)
    try:  # behind its back
        assert engine._transfer({"path": str(path), "sha256": digest, "version": version})["ok"]
    finally:
        path.unlink(missing_ok=True)
    assert engine.report()["state_hash"] != expected
    engine._verify(version, state, engine.report()["state_hash"], expected)  # caught, repaired
    assert engine.stats.check_failures == failures + 1 and engine.stats.repairs == repairs + 1
    assert engine.report()["state_hash"] == expected
    assert _max_error(engine, state, version) < TOLERANCE
    engine._post("/weight_checker", {"action": "reset"})  # every weight zeroed in place
    assert engine.report()["state_hash"] == expected  # the backend cannot see it ...
    assert engine.check(state) > engine.cfg.tolerance  # ... the canary does
    engine._verify(version, state)
    assert engine.stats.check_failures == failures + 2 and engine.stats.repairs == repairs + 2
    assert engine.stats.check_gaps[-1] < engine.cfg.tolerance
    assert _max_error(engine, state, version) < TOLERANCE

"""Faults of the ``vllm`` engine against a real vLLM server (its CPU build).

Checks:
- the server killed with SIGKILL in the middle of a generation (or, when the generation ended
  just before the kill, before the next one) is restarted by the engine on the version it held,
  the request is sent again, and what comes back is that version's
  (logprobs equal transformers', fp32); the killed server's processes are all gone;
- a version the engine fails to load half-way (a fault injected into the weight-transfer
  backend: it changes a weight, then fails) is refused, the engine is restarted on the version it had before
  anything more is generated, so the next generation is exactly the old version's (nothing comes
  from a half-swapped engine), and the version after it goes in as usual.
"""

from __future__ import annotations

import os
import signal
import threading
import time
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
from rlstream.rollout.engines import EngineRefused
from rlstream.rollout.model import Generation, build_policy
from rlstream.rollout.vllm_engine import VllmEngine

pytestmark = [pytest.mark.slow, requires_vllm]

PROMPT = "f(x): dbl\nf(2)=4\nf(3)="
HERE = Path(__file__).resolve().parent


def _generate(engine: VllmEngine, seed: int, max_new: int = 24) -> tuple[list[int], Generation]:
    prompt = build_policy(POLICY).text.prompt(PROMPT)
    gen = engine.generate(
        torch.tensor([prompt] * 2),
        max_new=max_new,
        temperature=1.0,
        generator=torch.Generator().manual_seed(seed),
        stop_ids=(protocol.EOS,),
        prior=None,
    )
    return prompt, gen


def _max_error(state: dict[str, torch.Tensor], prompt: list[int], gen: Generation) -> float:
    worst = 0.0
    for row in range(gen.tokens.shape[0]):
        n = int(gen.lengths[row])
        ref = reference_logprobs(state, prompt + gen.tokens[row, :n].tolist())[len(prompt) :]
        worst = max(worst, float((ref - gen.logprobs[row, :n]).abs().max()))
    return worst


def _caught_running(url: str, worker: threading.Thread, timeout: float = 120.0) -> bool:
    """Whether the vLLM server at ``url`` reported a request running (its /metrics) while
    ``worker`` was still waiting for it; False when the request finished unseen (a fast
    generation on a quiet machine, or a scrape that came too late on a busy one)."""
    from urllib.request import urlopen

    deadline = time.monotonic() + timeout
    while worker.is_alive() and time.monotonic() < deadline:
        with urlopen(f"{url}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) > 0:
                    return worker.is_alive()
        time.sleep(0.01)
    if worker.is_alive():
        raise TimeoutError(f"no request running on {url} within {timeout:.0f}s")
    return False


def _session(pid: int) -> list[int]:
    """The live processes of the session ``pid`` leads (the server and its engine)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except ProcessLookupError:
                continue
    return found


def test_a_killed_server_is_restarted_and_the_request_sent_again(tmp_path: Path) -> None:
    base = dict(build_policy(POLICY).state_dict())
    engine = start_engine(tmp_path, base)
    try:
        state = perturbed(base, 1)
        engine.push(1, state)
        server = engine.server
        assert server is not None and server.pid is not None
        killed = server.pid
        assert len(_session(killed)) >= 2  # the API server and its engine processes
        out: dict[str, object] = {}

        def run() -> None:
            out["result"] = _generate(engine, seed=5, max_new=200)

        for _ in range(5):  # until a request is caught in flight (a fixed wait raced its end)
            worker = threading.Thread(target=run)
            worker.start()
            if _caught_running(engine.url, worker):
                break
            worker.join()
        os.kill(killed, signal.SIGKILL)
        worker.join(600)
        assert not worker.is_alive()
        if engine.stats.restarts == 0:
            # the request ended between the server's report and the kill (its metrics lag a
            # step): the next request meets the dead server, which must be restarted the same way
            run()
        prompt, gen = out["result"]  # type: ignore[misc]
        assert engine.stats.restarts == 1 and engine.version == 1
        assert server.pid != killed and server.starts == 2
        deadline = time.monotonic() + 30
        while _session(killed) and time.monotonic() < deadline:  # orphans reaped by init
            time.sleep(0.5)
        assert _session(killed) == []  # the killed server's engine went with it
        assert _max_error(state, prompt, gen) < TOLERANCE  # the version it held, served again
        prompt, gen = _generate(engine, seed=6)
        assert _max_error(state, prompt, gen) < TOLERANCE
    finally:
        engine.close()


def test_a_version_that_fails_half_way_is_refused_and_the_old_one_serves(tmp_path: Path) -> None:
    base = dict(build_policy(POLICY).state_dict())
    # the harness's backend: each server's second load fails half-way (tests/system/vllm_fault_ext)
    fault = {
        "backend": "rlstream-half-failing",
        "extension": "vllm_fault_ext.Register",
        "extension_path": [str(HERE)],
    }
    engine = start_engine(tmp_path, base, **fault)
    try:
        v1 = perturbed(base, 1)
        engine.push(1, v1)  # the server's first load: fine
        v2 = perturbed(v1, 2)
        with pytest.raises(EngineRefused, match="fault injected"):
            engine.push(2, v2)  # changes a weight, then fails: the engine is half swapped
        assert engine.version == 1 and engine.stats.refusals == 1
        assert engine.stats.restarts == 1  # restarted on version 1 before generating again
        prompt, gen = _generate(engine, seed=3)
        assert _max_error(v1, prompt, gen) < TOLERANCE  # exactly the old version
        v3 = perturbed(v1, 3)
        engine.push(3, v3)  # the restarted server's first load: fine
        prompt, gen = _generate(engine, seed=4)
        assert _max_error(v3, prompt, gen) < TOLERANCE
    finally:
        engine.close()

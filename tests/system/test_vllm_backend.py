"""A stock vLLM server follows a run through rlstream's weight-transfer backend.

The server is vLLM's own OpenAI server (its CPU build, ``make vllm``'s venv) started with no
rlstream code beyond the backend package installed in that venv, named on its command line
(``--weight-transfer-config '{"backend": "rlstream"}'``). A run's versions are published signed
on a real broker; ``rlstream serve vllm --run R --url URL`` (a process of its own) keeps the
server on the newest verified version. Checks, for each of three versions of a tiny dense Llama
with its own BPE tokenizer: the follower reports the version taken, the state hash the server's
backend computed from the bytes it loaded equals the learner's signed state hash, nothing failed
a check; the server's own answers (greedy, token logprobs) are transformers' on that version
(fp32, 4 decimals), so they change with the version.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import signed_run, stop_procs
from hf_checkpoints import bpe_checkpoint
from vllm_support import requires_vllm

from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.runtime.ports import free_port
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.hf_policy import save_state_hf
from rlstream.rollout.model import build_policy, sequence_logprobs
from rlstream.rollout.vllm_process import vllm_python
from rlstream.schemas.deltacodec import from_torch, state_hash

pytestmark = [pytest.mark.slow, requires_vllm]

PROMPT = [5, 17, 42, 9, 33, 8, 21, 4]


def _stock_server(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on ``folder`` with rlstream's backend named, nothing else of ours."""
    port = free_port()
    cmd = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", "smol",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(2**28), "--max-num-seqs", "8",
        "--weight-transfer-config", '{"backend": "rlstream"}',
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env |= {"OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the server did not answer in 600 s")


def _greedy(url: str) -> tuple[list[int], list[float]]:
    body = {
        "model": "smol", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
        "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lp = json.loads(resp.read())["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    return ids, [float(x) for x in lp["token_logprobs"]]


def _lines(proc: subprocess.Popen) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            out.put(json.loads(line))

    threading.Thread(target=pump, daemon=True).start()
    return out


def test_a_stock_vllm_server_follows_a_runs_versions(kafka, unique_run, tmp_path: Path) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    checkpoint = bpe_checkpoint(tmp_path / "checkpoint", dense=True, head_dim=64)
    policy = PolicyConfig(hf_dir=str(checkpoint))
    model = build_policy(policy).eval()
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # two more versions: every weight moved a little
        states.append({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in states[-1].items()})  # fmt: skip
    save_state_hf(policy, states[0], tmp_path / "served")  # what the server starts from
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner.0", timeout=30)
    publisher = WeightPublisher(
        producer, run, "policy", keyframe_every=4, signer=signed_run(kafka, run)
    )
    server, url = _stock_server(tmp_path / "served", tmp_path / "vllm.log")
    cmd = [
        sys.executable, "-m", "rlstream", "serve", "vllm", "--run", run, "--url", url,
        "--bootstrap", kafka.bootstrap_servers, "--set", f"policy.hf_dir={checkpoint}",
        "--set", f"rollout.vllm.work_dir={tmp_path}", "--json", "--max-versions", "3",
    ]  # fmt: skip
    follower = None
    try:
        with open(tmp_path / "follow.log", "wb") as errors:
            follower = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
        lines = _lines(follower)
        seen = []
        for version, state in enumerate(states):
            publisher.publish_version(from_torch(state), version)
            signed = state_hash(from_torch(state))
            line = lines.get(timeout=300)
            assert line["version"] == version, line
            assert line["learner_state_hash"] == signed
            assert line["engine_state_hash"] == signed  # computed in the server from its bytes
            assert line["check_failures"] == 0 and line["whole"] == (version == 0)
            ids, got = _greedy(url)
            with torch.no_grad():
                model.load_state_dict(state)
                lp, _ = sequence_logprobs(model, torch.tensor([PROMPT + ids]))
            want = lp[0, len(PROMPT) :]
            assert float((want - torch.tensor(got)).abs().max()) < 1e-4, f"version {version}"
            seen.append(got)
        assert seen[0] != seen[1] != seen[2]  # the answers change with the version
        summary = lines.get(timeout=60)["summary"]
        assert summary["swaps"] == 2 and summary["pause_s_p50"] is not None
        assert summary["engine_checks"]["mismatches"] == 0
        assert follower.wait(timeout=60) == 0
    finally:
        stop_procs({"follower": follower} if follower else {})
        publisher.close()
        with contextlib.suppress(ProcessLookupError):  # the server leads its own session
            os.killpg(server.pid, signal.SIGTERM)
        stop_procs({"server": server})
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)

"""``serve policy`` on a real broker and real HTTP: completions carry the policy version and a
request id, new versions are hot-swapped from the weight stream, bad requests get a 4xx that
names the field, and the LLM-as-judge rubric scores a sample through this endpoint."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import torch
from aiohttp import web
from helpers import signed_run

from rlstream.envs.judges import JudgeConfig, judge_llm
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.runtime import aio
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.rollout.capacity import parse_metrics
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy
from rlstream.rollout.serve import PolicyServer, make_app
from rlstream.schemas.deltacodec import from_torch

POLICY = PolicyConfig(vocab_size=128, d_model=32, n_heads=2, d_expert=32, max_seq_len=128)


def _publisher(kafka, run: str) -> WeightPublisher:
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner.0", timeout=30)
    signer = signed_run(kafka, run)  # the run is signed from its creation
    return WeightPublisher(producer, run, "policy", keyframe_every=4, signer=signer)


def _state(seed: int):
    torch.manual_seed(seed)
    model = build_policy(POLICY.model_copy(update={"seed": seed}))
    return from_torch({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})


class _Serving:
    def __init__(self, app: web.Application) -> None:
        self.loop = aio.new_event_loop()  # as `rlstream serve policy` runs it
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _served_version(base: str) -> int:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["policy_version"]


def _serving_v0(kafka, run: str) -> tuple[WeightPublisher, PolicyServer, _Serving, str]:
    """Version 0 published, and a server following the run's weights on a free port."""
    ensure_run_topics(kafka, run)
    publisher = _publisher(kafka, run)
    publisher.publish_version(_state(0), 0)
    server = PolicyServer(kafka, run, "policy", POLICY)
    serving = _Serving(make_app(server))
    return publisher, server, serving, f"http://127.0.0.1:{serving.port}"


def test_policy_served_hot_swapped_and_judged(kafka, unique_run):
    publisher, server, serving, base = _serving_v0(kafka, unique_run)
    try:
        deadline = time.monotonic() + 30
        status, body = 503, {}
        while status == 503 and time.monotonic() < deadline:
            status, body = _post(
                f"{base}/v1/completions",
                {"model": "policy", "prompt": "f(x): double\n", "max_tokens": 8, "seed": 1},
            )
            time.sleep(0.2)
        assert status == 200, body
        assert body["policy_version"] == 0 and body["request_id"].startswith("req-")
        assert body["object"] == "text_completion" and len(body["choices"]) == 1

        status, body = _post(
            f"{base}/v1/completions", {"model": "policy", "prompt": "x", "max_tokens": 0}
        )
        assert status == 422 and body["error"]["param"] == "max_tokens"
        status, body = _post(f"{base}/v1/completions", {"model": "other", "prompt": "x"})
        assert status == 404 and body["error"]["param"] == "model"
        # what a capacity role reads (rollout.capacity): the load and each answer's latency
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
            samples = parse_metrics(resp.read().decode())
        assert samples["rlstream_serve_request_seconds_count"][0][1] >= 3
        assert samples["rlstream_serve_requests_running"][0][1] == 0
        assert samples["rlstream_serve_requests_waiting"][0][1] == 0

        publisher.publish_version(_state(1), 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _post(f"{base}/v1/completions", {"model": "policy", "prompt": "x", "max_tokens": 1})
            if _served_version(base) == 1:
                break
            time.sleep(0.3)
        assert _served_version(base) == 1

        cfg = JudgeConfig(
            kind="llm",
            endpoint=f"{base}/v1/completions",
            llm_model="policy",
            allow_policy_grader=True,  # this test grades with the served policy on purpose
        )
        verdict = judge_llm({"prompt": "f(x): double", "completion": "return x*2"}, cfg)
        assert 0.0 <= verdict["score"] <= 1.0
        if "error" not in verdict:  # a tiny policy rarely prints a number; both paths are valid
            assert verdict["details"]["served_version"] == 1.0
        else:
            assert verdict["error"] == "unparseable grade"
    finally:
        serving.close()
        server.close()


def _health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/healthz", timeout=10) as resp:
        return json.loads(resp.read())


def test_healthz_swaps_weights_only_under_the_generation_lock(kafka, unique_run):
    """A version that arrives while a generation holds the lock is not swapped in by a health
    probe (the weights would change under that generation, which is recorded under the version
    it started with); the next probe after the lock is free swaps it in."""
    publisher, server, serving, base = _serving_v0(kafka, unique_run)
    try:
        deadline = time.monotonic() + 30
        while _health(base)["policy_version"] != 0:
            assert time.monotonic() < deadline, "version 0 never served"
            time.sleep(0.2)
        # a generation in progress: the lock is held on the server's loop
        asyncio.run_coroutine_threadsafe(server.lock.acquire(), serving.loop).result(5)
        publisher.publish_version(_state(1), 1)
        assert server.subscriber is not None
        deadline = time.monotonic() + 30
        while (snap := server.subscriber.current()) is None or snap.version < 1:
            assert time.monotonic() < deadline, "the subscriber never applied version 1"
            time.sleep(0.2)
        before = {k: v.clone() for k, v in server.model.state_dict().items()}
        assert [_health(base)["policy_version"] for _ in range(3)] == [0, 0, 0]
        after = server.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "weights changed under lock"
        serving.loop.call_soon_threadsafe(server.lock.release)
        deadline = time.monotonic() + 10
        while _health(base)["policy_version"] != 1:
            assert time.monotonic() < deadline, "version 1 not swapped in once the lock was free"
            time.sleep(0.1)
    finally:
        serving.close()
        server.close()

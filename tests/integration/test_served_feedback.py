"""Real-time RL closes through the log: serve -> feedback -> feedback-rl -> learner -> new weights.

On a real broker, with the official ``openai`` client over real HTTP: a learner (its own
process) publishes version 0; ``serve policy`` answers ``completions.create(..., logprobs=1)``
with each token's logprob and the policy version, and records every choice in ``rl.RUN.served``;
the editor posts feedback through feedback-ingest naming only the request id (and which choice);
feedback-rl looks the request up in the served stream and admits an online group built from the
served tokens, behaviour logprobs and routes bit for bit (a request id never served is rejected
with the reason); the learner trains on that group, its version-1 manifest lists the group's
admitted record among its step inputs, and the server hot-swaps to version 1. A completion that
cannot be recorded is not served (503), and serving resumes once the stream is back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers import decode_all, read_all
from test_feedback_ingest import TOKEN, post_json
from test_serve_policy import POLICY, _post, _publisher, _Serving, _state

from rlstream.consumers.consumer import Stopper
from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig
from rlstream.envs import protocol
from rlstream.producers.client.admin import (
    admin_client,
    apply_topics,
    ensure_run_topics,
    run_topic_wants,
)
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback import models as fm
from rlstream.producers.feedback.service import running_service
from rlstream.rollout.serve import PolicyServer, make_app
from rlstream.schemas import arrays, events, topics

LEARNER = textwrap.dedent(
    """
    import sys
    from rlstream.consumers.consumer import Stopper
    from rlstream.producers.client.settings import KafkaSettings
    from rlstream.rollout.config import PolicyConfig
    from rlstream.trainer.learner import Learner
    from rlstream.trainer.config import LearnerConfig

    bootstrap, run, state_dir, policy = sys.argv[1:5]
    cfg = LearnerConfig(
        policy=PolicyConfig.model_validate_json(policy),
        warm_start={"steps": 0},
        groups_per_step=1,
        max_versions=1,
        state_dir=state_dir,
    )
    learner = Learner(KafkaSettings(bootstrap_servers=bootstrap), run, cfg)
    try:
        print("version", learner.run_until(Stopper()), flush=True)
    finally:
        learner.close()
    """
)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _wait_for_version(base: str, version: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _get(f"{base}/healthz")["policy_version"] < version:
        assert time.monotonic() < deadline, f"version {version} not served in {timeout:.0f}s"
        time.sleep(0.3)


def _served_records(kafka: KafkaSettings, run: str, request_id: str) -> list[dict[str, Any]]:
    served = decode_all(kafka, topics.topic_name(run, "served"))
    return sorted(
        (d.record for d in served if d.record["group_id"] == request_id),
        key=lambda r: r["sample_index"],
    )


def _feedback(request_id: str, i: int, action: str, choice: int) -> dict[str, Any]:
    """What an editor sends: the request id, version and model from the answer, nothing else
    about the completion."""
    return {
        "feedback_id": f"fb-{i}",
        "request_id": request_id,
        "policy_version": 0,
        "model": "policy",
        "action": action,
        "user_id": f"user-{i}",
        "task_class": "tab",
        "metadata": {"choice": str(choice)},
    }


@pytest.mark.unsecured_only("its worker process is given a bare bootstrap address, no credentials")
@pytest.mark.timeout(240)
def test_feedback_on_a_served_completion_is_trained_on(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path
) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    learner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LEARNER,
            kafka.bootstrap_servers,
            run,
            str(tmp_path),
            POLICY.model_dump_json(),
        ],
        stdout=(tmp_path / "learner.out").open("w"),
        stderr=subprocess.STDOUT,
    )
    server = PolicyServer(kafka, run, "policy", POLICY)
    serving = _Serving(make_app(server))
    base = f"http://127.0.0.1:{serving.port}"
    try:
        _wait_for_version(base, 0, timeout=60)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(
            model="policy", prompt="f(x): double\n", max_tokens=8, logprobs=1, n=2, seed=11
        )
        extra = answer.model_extra or {}
        assert extra["policy_version"] == 0 and answer.object == "text_completion"
        request_id = extra["request_id"]

        # (a) the answer's logprobs are the behaviour logprobs recorded for training, exactly
        records = _served_records(kafka, run, request_id)
        assert [r["sample_index"] for r in records] == [0, 1]
        for choice, record in zip(answer.choices, records, strict=True):
            lp = choice.logprobs
            assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
            assert "".join(lp.tokens) == choice.text == record["completion"]
            assert all(
                len(top) <= 2 and top[t] == v
                for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
            )
            got = arrays.unpack_tokens(record)
            p = record["prompt_tokens"]
            assert got.logprobs[p:].tolist() == lp.token_logprobs  # float32 values, bit for bit
            assert protocol.decode(got.token_ids[p:].tolist()) == choice.text
            assert got.routed_experts.shape == (len(got.token_ids), POLICY.n_layers, POLICY.top_k)
            assert record["policy_version"] == 0
            assert record["outcome"]["details"]["seed"] == "11"

        with pytest.raises(openai.UnprocessableEntityError) as err:
            client.completions.create(model="policy", prompt="x", logprobs=99)
        assert err.value.body["param"] == "logprobs"  # type: ignore[index]

        # (b) feedback naming only the request id becomes an admitted online group
        cfg = fm.FeedbackServiceConfig(run=run, port=0, tokens=[TOKEN], durable_dedupe=False)
        with running_service(cfg, settings=kafka, environ={fm.SALT_ENV: "salt"}) as ingest:
            sent = [
                _feedback(request_id, 0, "accepted", 0),
                _feedback(request_id, 1, "rejected", 1),
                _feedback("req-never-served", 2, "accepted", 0),
            ]
            status, _, body = post_json(ingest.url, {"events": sent})
            assert status == 202 and body["accepted"] == 3, body
        rl_cfg = FeedbackRLConfig(window_size=2, window_seconds=1.0)
        counts = FeedbackRL(kafka, run, rl_cfg).run(Stopper(), idle_exit_s=4.0)
        assert counts["served_found"] == 2 and counts["served_not_found"] == 1, counts

        admitted_topic = topics.topic_name(run, "admitted")
        [(group, where)] = [
            (
                decoded.record,
                {"topic": admitted_topic, "partition": m.partition(), "offset": m.offset()},
            )
            for _, value, m in read_all(kafka, admitted_topic)
            if (decoded := events.decode(value)).record["source"] == "online"
        ]
        samples = group["samples"]
        assert len(samples) == 2 and group["decision"] == "admitted"
        for sample, record in zip(samples, records, strict=True):
            for name in arrays.TOKEN_FIELDS:
                assert sample[name] == record[name], name
            assert sample["policy_version"] == 0
            assert sample["trajectory"]["topic"] == topics.topic_name(run, "served")
        assert [s["rewards"]["feedback"] for s in samples] == [1.0, -1.0]
        rejected = decode_all(kafka, topics.topic_name(run, "rejected"))
        [lost] = [d.record for d in rejected]
        assert lost["reason"] == "other" and "not found" in (lost["detail"] or "")

        # the learner trains on it: version 1 lists the online group, and it is served
        learner.wait(timeout=120)
        said = (tmp_path / "learner.out").read_text()
        assert learner.returncode == 0 and "version 1" in said, said[-3000:]
        manifests = decode_all(kafka, topics.topic_name(run, "weights.manifests"))
        [v1] = [m.record for m in manifests if m.record["version"] == 1]
        assert v1["step_inputs"] == [where]  # the one online group, and nothing else
        _wait_for_version(base, 1, timeout=30)
    finally:
        serving.close()
        server.close()
        if learner.poll() is None:
            learner.kill()
            learner.wait(10)


def test_a_completion_that_cannot_be_recorded_is_not_served(
    kafka: KafkaSettings, unique_run: str
) -> None:
    run = unique_run
    wants = run_topic_wants(run)
    served = topics.topic_name(run, "served")
    apply_topics(admin_client(kafka), [w for w in wants if w.name != served])  # served is missing
    _publisher(kafka, run).publish_version(_state(0), 0)
    server = PolicyServer(kafka, run, "policy", POLICY, record_timeout_s=2.0)
    serving = _Serving(make_app(server))
    base = f"http://127.0.0.1:{serving.port}"
    request = {"model": "policy", "prompt": "f(x): double\n", "max_tokens": 4}
    try:
        _wait_for_version(base, 0, timeout=60)
        status, body = _post(f"{base}/v1/completions", request)
        assert status == 503 and "could not be recorded" in body["error"]["message"], body

        apply_topics(admin_client(kafka), [w for w in wants if w.name == served])
        deadline = time.monotonic() + 60
        while (status := _post(f"{base}/v1/completions", request)[0]) == 503:
            assert time.monotonic() < deadline, "still 503 after the served stream came back"
        status, body = _post(f"{base}/v1/completions", request)
        assert status == 200, body
        recorded = {d.record["group_id"] for d in decode_all(kafka, served)}
        assert body["request_id"] in recorded
    finally:
        serving.close()
        server.close()

"""The eval role on a real broker: SIGKILLed mid-run and restarted, it evaluates every due
version (0 and every N-th) exactly once, in order, with the release decision in each event."""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path

import torch
from helpers import decode_all, signed_run

from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy
from rlstream.schemas import topics
from rlstream.schemas.deltacodec import from_torch

POLICY = PolicyConfig(vocab_size=128, d_model=32, n_heads=2, d_expert=32, max_seq_len=128)
SETS = {
    "policy.d_model": 32,
    "policy.n_heads": 2,
    "policy.d_expert": 32,
    "policy.max_seq_len": 128,
    "rollout.harness.max_new_tokens": 16,
    "eval.every": 2,
    "eval.eval_tasks": 6,
    "eval.k": 2,
    "eval.max_version": 8,
}
DUE = [0, 2, 4, 6, 8]


def _state(seed: int):
    torch.manual_seed(seed)
    model = build_policy(POLICY.model_copy(update={"seed": seed}))
    return from_torch({k: v.detach().to(torch.float32) for k, v in model.state_dict().items()})


def _evals(kafka, run: str) -> list[dict]:
    return [d.record for d in decode_all(kafka, topics.topic_name(run, "evals"))]


def test_eval_role_killed_and_restarted_evaluates_each_due_version_once(
    kafka, unique_run, tmp_path: Path
):
    ensure_run_topics(kafka, unique_run)
    producer = EventProducer.transactional(kafka, f"rlstream.{unique_run}.learner.0", timeout=30)
    signer = signed_run(kafka, unique_run)  # the run is signed from its creation
    publisher = WeightPublisher(producer, unique_run, "policy", keyframe_every=3, signer=signer)
    for version in range(9):
        publisher.publish_version(_state(version), version)
    extra = ["--once"] + [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    first = start_role("eval", unique_run, kafka, tmp_path, extra, "eval-1").proc
    try:
        deadline = time.monotonic() + 90
        while not _evals(kafka, unique_run) and time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "eval-1.log").read_text()
            time.sleep(0.2)
        assert _evals(kafka, unique_run), "no evaluation within 90 s"
        first.send_signal(signal.SIGKILL)  # mid-run: the next version is being evaluated
        first.wait(10)
        before = [r["version"] for r in _evals(kafka, unique_run)]
        second = start_role("eval", unique_run, kafka, tmp_path, extra, "eval-2").proc
        assert second.wait(120) == 0, (tmp_path / "eval-2.log").read_text()
    finally:
        for p in (first, locals().get("second")):
            if p is not None and p.poll() is None:
                p.kill()
        producer.close()
    records = _evals(kafka, unique_run)
    versions = [r["version"] for r in records]
    counts = collections.Counter(versions)
    assert sorted(counts) == DUE, f"skipped or extra versions: {versions}"
    assert all(c == 1 for c in counts.values()), f"a version evaluated twice: {versions}"
    assert versions == DUE, "evaluated in order"
    assert before and versions[: len(before)] == before
    assert len(before) < len(DUE), "the kill interrupted the run"
    assert len({r["task_set"] for r in records}) == 1
    for r in records:
        assert r["n_tasks"] == 6 and r["k"] == 2
        assert 0.0 <= r["greedy_success"] <= r["pass_at_k"] + 1.0
        assert r["released"] == (
            r["baseline_version"] is None
            or r["greedy_success"] >= r["baseline_greedy_success"] - 0.05
        )
    assert records[0]["released"] and records[0]["baseline_version"] is None


def _eval_event(run: str, version: int, released: bool) -> dict:
    return {
        "run": run,
        "model": "policy",
        "version": version,
        "task_set": "heldout-1-test",
        "n_tasks": 1,
        "k": 1,
        "greedy_success": 0.5,
        "pass_at_k": 0.5,
        "sample_success": 0.5,
        "released": released,
        "release_rule": "test",
        "evaluated_ms": 0,
        "duration_ms": 0,
        "evaluator": "test",
    }


def test_serving_follows_released_versions_only(kafka, unique_run):
    from rlstream.rollout.serve import CompletionRequest, PolicyServer

    ensure_run_topics(kafka, unique_run)
    producer = EventProducer.transactional(kafka, f"rlstream.{unique_run}.learner.0", timeout=30)
    signer = signed_run(kafka, unique_run)  # the run is signed from its creation
    publisher = WeightPublisher(producer, unique_run, "policy", keyframe_every=3, signer=signer)
    for version in range(6):
        publisher.publish_version(_state(version), version)
    evals = EventProducer.transactional(kafka, topics.group_id(unique_run, "eval"), timeout=30)
    topic = topics.topic_name(unique_run, "evals")

    def write(version: int, released: bool) -> None:
        rec = _eval_event(unique_run, version, released)
        with evals.transaction():
            evals.produce(topic, "eval", rec, topics.record_key("evals", rec))

    lines: list[str] = []
    server = PolicyServer(kafka, unique_run, "policy", POLICY, released_only=True, log=lines.append)
    newest = PolicyServer(kafka, unique_run, "policy", POLICY)
    req = CompletionRequest(model="policy", prompt="f(x): inc\n", max_tokens=4, seed=1)
    try:
        time.sleep(2)
        try:
            server.complete(req)
            raise AssertionError("served before any release")
        except LookupError as exc:
            assert "released" in str(exc)
        write(0, True)
        write(2, True)
        write(4, False)  # evaluated, held back: never served

        def served(s) -> int:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    out = s.complete(req)
                    if out["policy_version"] in (2, 5):
                        return out["policy_version"]
                except LookupError:
                    pass
                time.sleep(0.2)
            return s.version

        assert served(server) == 2
        assert server.complete(req)["following"] == "released"
        assert served(newest) == 5, "without gating the newest version is served"
        time.sleep(2)
        assert server.complete(req)["policy_version"] == 2, "v4 was held back"
        write(5, True)
        deadline = time.monotonic() + 30
        while server.complete(req)["policy_version"] != 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.complete(req)["policy_version"] == 5
        assert any("serving version 5" in line for line in lines), lines
    finally:
        server.close()
        newest.close()
        producer.close()
        evals.close()

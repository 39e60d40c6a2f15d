"""feedback-rl against a real broker: feedback with tokens in, online admitted groups out.

The role runs as a real process that is killed (os._exit) right after it wrote a batch's
outputs but before that transaction committed, then restarted. Properties: every feedback record
is reflected in exactly one committed decision (duplicates of a feedback id in none), stale
feedback is rejected with reason ``stale`` against the learner version from the manifests
stream, and admitted samples carry the served tokens bit for bit with baselined rewards.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest
from helpers import decode_all, read_all

from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import arrays, topics

ROLE = textwrap.dedent(
    """
    import json, os, sys
    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig
    from rlstream.producers.client.settings import KafkaSettings

    bootstrap, run, crash_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = FeedbackRLConfig(window_size=3, window_seconds=1.0, batch_size=4, max_staleness=1)
    role = FeedbackRL(KafkaSettings(bootstrap_servers=bootstrap), run, cfg)
    produce, batches = role.loop.produce, []

    def crashing_produce(outputs):
        produce(outputs)
        batches.append(len(outputs))
        if crash_after and sum(1 for n in batches if n) >= crash_after:
            role.loop.producer.wait(10)  # written, not committed
            os._exit(9)

    role.loop.produce = crashing_produce  # fault injection point
    counts = role.run(Stopper(), idle_exit_s=4.0)
    print(json.dumps(dict(counts)))
    """
)


def run_role(kafka: KafkaSettings, run: str, crash_after: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ROLE, kafka.bootstrap_servers, run, str(crash_after)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def manifest(run: str, version: int) -> dict[str, Any]:
    return {
        "run": run,
        "model": "policy",
        "version": version,
        "base_version": None,
        "keyframe_version": version,
        "kind": "keyframe",
        "created_ms": int(time.time() * 1000),
        "tensors": [],
        "chunks": [],
        "chunk_topic": topics.topic_name(run, "weights.chunks"),
        "state_hash": "0" * 64,
        "base_state_hash": None,
        "raw_bytes": 0,
        "encoded_bytes": 0,
        "codec_version": 1,
    }


def feedback(
    run: str, i: int, version: int, action: str, cls: str, tokens: bool = True
) -> dict[str, Any]:
    n = 5 + i % 4
    packed = arrays.pack_tokens(
        np.arange(n, dtype=np.int32) + 100 * i,
        np.linspace(-1, -0.1, n, dtype=np.float32),
        (np.arange(n) >= 2).astype(np.uint8),
    )
    record = {
        "feedback_id": f"fb-{i}",
        "request_id": f"req-{i}",
        "run": run,
        "policy_version": version,
        "model": "policy",
        "action": action,
        "prompt_tokens": 2,
        "task_class": cls,
        "user_id_hash": "h",
        "received_ms": int(time.time() * 1000),
        **(packed if tokens else {}),
    }
    return record


@pytest.mark.unsecured_only("its worker process is given a bare bootstrap address, no credentials")
def test_online_groups_exactly_once_across_a_crash(kafka: KafkaSettings, unique_run: str) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    records = []
    actions = ["accepted", "rejected", "edited", "dissatisfied", "accepted"]
    for i in range(36):
        version = 1 if i % 6 == 5 else 3  # learner at 3, max_staleness 1: version 1 is stale
        records.append(
            feedback(run, i, version, actions[i % 5], ["tab", "agent"][i % 2], i % 9 != 4)
        )
    with EventProducer.connect(kafka) as producer:
        producer.produce(
            topics.topic_name(run, "weights.manifests"),
            "weight_manifest",
            manifest(run, 3),
            "policy",
        )
        feedback_topic = topics.topic_name(run, "feedback")
        for rec in records:
            producer.produce(feedback_topic, "feedback", rec, topics.record_key("feedback", rec))
        for rec in records[:4]:  # retries of already stored events, same key
            producer.produce(feedback_topic, "feedback", rec, topics.record_key("feedback", rec))

    crashed = run_role(kafka, run, crash_after=2)
    assert crashed.returncode == 9, crashed.stderr[-2000:]
    finished = run_role(kafka, run, crash_after=0)
    assert finished.returncode == 0, finished.stderr[-2000:]
    counts = json.loads(finished.stdout.strip().splitlines()[-1])

    decided = decode_all(kafka, topics.topic_name(run, "admitted"))
    decided += decode_all(kafka, topics.topic_name(run, "rejected"))
    decisions = [d.record for d in decided]
    uncommitted = read_all(kafka, topics.topic_name(run, "admitted"), committed_only=False)
    uncommitted += read_all(kafka, topics.topic_name(run, "rejected"), committed_only=False)
    assert len(uncommitted) > len(decisions), "the crash should have left an aborted batch"

    # exactly once: every feedback position in one decision; retries in none
    positions = collections.Counter(
        (i["partition"], i["offset"]) for d in decisions for i in d["inputs"]
    )
    by_position = _positions(kafka, run)
    assert max(positions.values()) == 1
    reflected = collections.Counter(by_position[p] for p in positions)
    assert sorted(reflected) == sorted(r["feedback_id"] for r in records)
    assert max(reflected.values()) == 1
    assert counts.get("admitted", 0) >= 1

    by_id = {r["feedback_id"]: r for r in records}
    for d in decisions:
        assert d["source"] == "online" and d["run"] == run
        ids = [by_position[(i["partition"], i["offset"])] for i in d["inputs"]]
        if d["reason"] == "stale":
            assert all(by_id[f]["policy_version"] == 1 for f in ids) and d["staleness"] == 2
        if d["decision"] == "admitted":
            assert d["learner_version"] == 3 and len(d["samples"]) >= 2
            for sample, fid in zip(d["samples"], ids, strict=True):
                assert sample["token_ids"] == by_id[fid]["token_ids"]  # bit for bit
                assert (
                    sample["reward"]
                    == sample["rewards"]["feedback"] - sample["rewards"]["baseline"]
                )
    stale_ids = {r["feedback_id"] for r in records if r["policy_version"] == 1}
    rejected_stale = {
        by_position[(i["partition"], i["offset"])]
        for d in decisions
        if d["reason"] == "stale"
        for i in d["inputs"]
    }
    assert rejected_stale == {f for f in stale_ids if by_id[f].get("token_ids") is not None}
    assert any(d["decision"] == "admitted" for d in decisions)


def _positions(kafka: KafkaSettings, run: str) -> dict[tuple[int, int], str]:
    """(partition, offset) -> feedback id, for every record of the feedback topic."""
    from rlstream.schemas import events

    out = {}
    for _, value, msg in read_all(kafka, topics.topic_name(run, "feedback")):
        out[(msg.partition(), msg.offset())] = events.decode(value).record["feedback_id"]
    return out


def test_a_restarted_role_still_drops_retries_of_decided_feedback(
    kafka: KafkaSettings, unique_run: str
) -> None:
    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig

    run = unique_run
    ensure_run_topics(kafka, run)
    cfg = FeedbackRLConfig(window_size=4, window_seconds=0.5)
    records = [feedback(run, i, 0, ["accepted", "rejected"][i % 2], "tab") for i in range(12)]
    topic = topics.topic_name(run, "feedback")

    def produce(batch: list[dict[str, Any]]) -> None:
        with EventProducer.connect(kafka) as producer:
            for rec in batch:
                producer.produce(topic, "feedback", rec, topics.record_key("feedback", rec))

    produce(records)
    first = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    produce(records[::2])  # retries after everything was decided, to a fresh process
    second = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    assert first.get("duplicate", 0) == 0 and second["duplicate"] == 6
    decisions = decode_all(kafka, topics.topic_name(run, "admitted"))
    decisions += decode_all(kafka, topics.topic_name(run, "rejected"))
    assert sum(len(d.record["inputs"]) for d in decisions) == 12


def test_feedback_by_trajectory_ref_is_trained_on_the_referenced_tokens(
    kafka: KafkaSettings, unique_run: str
) -> None:
    """Feedback without tokens but with a trajectory_ref gets the sample's tokens copied in;
    a reference to nothing is rejected with the reason."""
    from test_events import examples

    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig

    run = unique_run
    ensure_run_topics(kafka, run)
    traj_topic = topics.topic_name(run, "trajectories")
    with EventProducer.connect(kafka) as producer:
        for i in range(2):
            producer.produce(
                traj_topic,
                "trajectory",
                {
                    **examples()["trajectory"],
                    "run": run,
                    "group_id": "g0",
                    "sample_index": i,
                    "segment_index": 0,
                    "segment_count": 1,
                    "token_offset": 0,
                },
                "g0",
            )
    positions = [(m.partition(), m.offset()) for _, _, m in read_all(kafka, traj_topic)]
    refs = [{"topic": traj_topic, "partition": p, "offset": o} for p, o in positions]
    refs.append({"topic": traj_topic, "partition": 0, "offset": 999})  # nothing there
    records = [
        {
            **feedback(run, i, 0, ["accepted", "rejected", "accepted"][i], "agent", tokens=False),
            "trajectory_ref": ref,
        }
        for i, ref in enumerate(refs)
    ]
    with EventProducer.connect(kafka) as producer:
        for rec in records:  # one key: one partition, so one window holds all three
            producer.produce(topics.topic_name(run, "feedback"), "feedback", rec, "editor-1")
    cfg = FeedbackRLConfig(window_size=3, window_seconds=0.5, reject_no_signal=False)
    counts = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    assert counts["trajectory_ref_unreadable"] == 1
    admitted = decode_all(kafka, topics.topic_name(run, "admitted"))
    samples = [s for d in admitted for s in d.record["samples"]]
    rejected = decode_all(kafka, topics.topic_name(run, "rejected"))
    assert len(samples) == 2, [(d.record["reason"], d.record["detail"]) for d in rejected]
    want = examples()["trajectory"]["token_ids"]
    assert all(s["token_ids"] == want for s in samples)
    assert any("trajectory_ref" in (d.record["detail"] or "") for d in rejected)

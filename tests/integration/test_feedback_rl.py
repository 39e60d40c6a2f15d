"""feedback-rl against a real broker: feedback on served completions in, online admitted groups
out.

The role runs as a real process that is killed (os._exit) right after it wrote a batch's
outputs but before that transaction committed, then restarted. Properties: every feedback record
is reflected in exactly one committed decision (duplicates of a feedback id in none), stale
feedback is rejected with reason ``stale`` against the learner version from the manifests
stream, and admitted samples carry the served tokens bit for bit with baselined rewards.

Feedback trains only what was served: every completion a feedback names is first recorded in
the run's served stream (as ``serve policy`` records it); a feedback whose tokens, logprobs or
version differ from that record, that names a request never served, or whose
``trajectory_ref`` names anything but the served record (a rollout trajectory) is rejected with
the reason and trains nothing; feedback ids are per client (``feedback_client``), so one client's
id never drops another client's feedback.
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
from helpers import decode_all, read_all, signed_run

from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.schemas import arrays, events, topics
from rlstream.schemas.deltacodec.bits import TensorBits

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


def publish_version(kafka: KafkaSettings, run: str, version: int) -> None:
    """The learner's ``version`` of a one-tensor model, signed with the run's key (the run is
    signed from its creation; feedback-rl reads the learner's version from verified manifests)."""
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner.0", timeout=30)
    try:
        publisher = WeightPublisher(producer, run, "policy", signer=signed_run(kafka, run))
        publisher.publish_version({"w": TensorBits.from_numpy(np.zeros(4, np.float32))}, version)
    finally:
        producer.close()


def served(run: str, record: dict[str, Any], **over: Any) -> dict[str, Any]:
    """The served-stream record of the completion ``record`` (a feedback with tokens) names:
    its request id, choice 0, the same tokens, logprobs, mask and version."""
    from test_events import examples

    fields = ("token_ids", "logprobs", "loss_mask", "routed_experts", "n_layers", "top_k")
    return {
        **examples()["trajectory"],
        "run": run,
        "group_id": record["request_id"],
        "task_id": record["request_id"],
        "sample_index": 0,
        "group_size": 1,
        "policy_version": record["policy_version"],
        "model": record["model"],
        "prompt_tokens": record["prompt_tokens"],
        "segment_index": 0,
        "segment_count": 1,
        "token_offset": 0,
        **{k: record[k] for k in fields},
        "expert_bytes": 1,
        **over,
    }


def record_served(kafka: KafkaSettings, run: str, records: list[dict[str, Any]]) -> None:
    """Record, as serve policy would, the completions of the feedback that carry tokens."""
    topic = topics.topic_name(run, "served")
    with EventProducer.connect(kafka) as producer:
        for rec in records:
            if rec.get("token_ids") is not None:
                producer.produce(topic, "trajectory", served(run, rec), rec["request_id"])


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
    record_served(kafka, run, records)
    publish_version(kafka, run, 3)
    with EventProducer.connect(kafka) as producer:
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
    record_served(kafka, run, records)
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
    served_topic = topics.topic_name(run, "served")
    records = [
        feedback(run, i, 0, ["accepted", "rejected", "accepted"][i], "agent", tokens=False)
        for i in range(3)
    ]
    with EventProducer.connect(kafka) as producer:
        for i in range(2):  # the completions of the first two, as serve policy records them
            sample = examples()["trajectory"]
            producer.produce(
                served_topic,
                "trajectory",
                {
                    **served(run, {**records[i], **{k: sample[k] for k in arrays.ARRAY_FIELDS}}),
                    "expert_bytes": sample["expert_bytes"],
                },
                records[i]["request_id"],
            )
    positions = {
        events.decode(v).record["group_id"]: (m.partition(), m.offset())
        for _, v, m in read_all(kafka, served_topic)
    }
    refs = [
        {"topic": served_topic, "partition": p, "offset": o}
        for p, o in (positions[r["request_id"]] for r in records[:2])
    ]
    refs.append({"topic": served_topic, "partition": 0, "offset": 999})  # nothing there
    records = [{**rec, "trajectory_ref": ref} for rec, ref in zip(records, refs, strict=True)]
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


def test_feedback_trains_only_what_was_served(kafka: KafkaSettings, unique_run: str) -> None:
    """Forged tokens, logprobs or version for a served completion, tokens for a request never
    served, and a trajectory_ref to a rollout trajectory are each rejected with the reason; only
    feedback that agrees with the served record is trained, on the served record's arrays."""
    from test_events import examples

    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig

    run = unique_run
    ensure_run_topics(kafka, run)

    def choice(i: int, action: str, **over: Any) -> dict[str, Any]:
        """Feedback on choice ``i`` of one served request (n = 3): one partition for all."""
        rec = {**feedback(run, i, 2, action, "tab"), "request_id": "req-x"}
        return {**rec, "metadata": {"choice": str(i)}, **over}

    honest = [choice(0, "accepted"), choice(1, "rejected")]
    victim = choice(2, "accepted")
    with EventProducer.connect(kafka) as producer:
        for i, rec in enumerate([*honest, victim]):
            producer.produce(
                topics.topic_name(run, "served"),
                "trajectory",
                served(run, rec, sample_index=i, group_size=3),
                "req-x",
            )
    trajectories = topics.topic_name(run, "trajectories")
    with EventProducer.connect(kafka) as producer:  # a rollout sample: not a served completion
        producer.produce(trajectories, "trajectory", {**examples()["trajectory"], "run": run}, "g")
    [(_, _, rollout)] = read_all(kafka, trajectories)
    forged_tokens = np.frombuffer(victim["token_ids"], np.int32) + 1
    zeros = np.zeros(len(forged_tokens), np.float32).tobytes()
    no_tokens = {k: None for k in ("token_ids", "logprobs", "loss_mask", "routed_experts")}
    attacks = [
        {**victim, "feedback_id": "fb-t", "token_ids": forged_tokens.tobytes()},
        {**victim, "feedback_id": "fb-l", "logprobs": zeros},
        {**victim, "feedback_id": "fb-v", "policy_version": 1},
        {**feedback(run, 7, 2, "accepted", "tab"), "feedback_id": "fb-n"},  # never served
        {
            **victim,
            **no_tokens,
            "feedback_id": "fb-r",
            "trajectory_ref": {
                "topic": trajectories, "partition": rollout.partition(), "offset": rollout.offset()
            },
        },
    ]  # fmt: skip
    with EventProducer.connect(kafka) as producer:
        for rec in [*honest, *attacks]:
            key = topics.record_key("feedback", rec)
            producer.produce(topics.topic_name(run, "feedback"), "feedback", rec, key)
    cfg = FeedbackRLConfig(window_size=7, window_seconds=1.0, reject_no_signal=False)
    counts = FeedbackRL(kafka, run, cfg, version=lambda: 2).run(Stopper(), idle_exit_s=3.0)
    assert counts["served_found"] == 2 and counts["served_mismatch"] == 3, counts
    assert counts["served_not_found"] == 1 and counts["trajectory_ref_unreadable"] == 1, counts
    admitted = [d.record for d in decode_all(kafka, topics.topic_name(run, "admitted"))]
    samples = [s for d in admitted for s in d["samples"]]
    assert [s["token_ids"] for s in samples] == [r["token_ids"] for r in honest]
    refused = [d.record for d in decode_all(kafka, topics.topic_name(run, "rejected"))]
    assert {d["reason"] for d in refused} == {"other"}
    assert sum(len(d["inputs"]) for d in refused) == len(attacks)
    detail = " ".join(d["detail"] or "" for d in refused)
    for why in ("token_ids differ", "logprobs differ", "policy_version", "not found"):
        assert why in detail, (why, detail)
    assert trajectories in detail and "served stream" in detail


def test_feedback_ids_are_per_client(kafka: KafkaSettings, unique_run: str) -> None:
    """Two clients that use the same feedback id are both trained; a retry of one client's
    record (same client header) is dropped, within a window and after a restart."""
    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig
    from rlstream.producers.feedback.dedupe import record_headers

    run = unique_run
    ensure_run_topics(kafka, run)
    records = [  # the four choices of one served request: one partition, one window
        {
            **feedback(run, i, 0, ["accepted", "rejected"][i % 2], "tab"),
            "request_id": "req-s",
            "metadata": {"choice": str(i)},
        }
        for i in range(4)
    ]
    with EventProducer.connect(kafka) as producer:
        for i, rec in enumerate(records):
            value = served(run, rec, sample_index=i, group_size=4)
            producer.produce(topics.topic_name(run, "served"), "trajectory", value, "req-s")
    topic = topics.topic_name(run, "feedback")
    same_id = [{**r, "feedback_id": "shared-id"} for r in records]

    def produce(sends: list[tuple[dict[str, Any], str]]) -> None:
        with EventProducer.connect(kafka) as producer:
            for rec, client in sends:
                headers = record_headers(client, rec["feedback_id"])
                producer.produce(topic, "feedback", rec, "req-s", headers=headers)

    clients = ["key:a", "key:b", "token:c", "token:d"]
    produce([(rec, client) for rec, client in zip(same_id, clients, strict=True)])
    cfg = FeedbackRLConfig(window_size=4, window_seconds=0.5)
    first = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    produce([(same_id[0], "key:a"), (same_id[1], "key:b")])  # retries, to a fresh process
    second = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    assert first.get("duplicate", 0) == 0 and second["duplicate"] == 2
    admitted = decode_all(kafka, topics.topic_name(run, "admitted"))
    assert sum(len(d.record["samples"]) for d in admitted) == 4


@pytest.mark.unsecured_only("its worker process is given a bare bootstrap address, no credentials")
def test_a_served_completion_is_trained_once_however_many_feedbacks_name_it(
    kafka: KafkaSettings, unique_run: str
) -> None:
    """Feedback with fresh ids (from other clients) naming a served completion that feedback
    already named is dropped as a duplicate, within a window and after a restart: one served
    completion, one trained sample."""
    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig
    from rlstream.producers.feedback.dedupe import record_headers

    run = unique_run
    ensure_run_topics(kafka, run)
    choices = [
        {**feedback(run, 0, 0, "accepted", "tab"), "request_id": "req-1", "metadata": {"choice": c}}
        for c in ("0", "1")
    ]
    with EventProducer.connect(kafka) as producer:
        for i, rec in enumerate(choices):
            value = served(run, rec, sample_index=i, group_size=2)
            producer.produce(topics.topic_name(run, "served"), "trajectory", value, "req-1")
    topic = topics.topic_name(run, "feedback")

    def produce(sends: list[tuple[int, str]]) -> None:
        with EventProducer.connect(kafka) as producer:
            for choice, fid in sends:
                rec = {
                    **choices[choice],
                    "feedback_id": fid,
                    "action": "rejected" if choice else "accepted",
                }
                producer.produce(
                    topic, "feedback", rec, "req-1", headers=record_headers(f"key:{fid}", fid)
                )

    cfg = FeedbackRLConfig(window_size=4, window_seconds=0.5)
    produce([(0, "a"), (0, "b"), (1, "c"), (0, "d")])
    first = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    produce([(0, "e"), (1, "f")])  # to a fresh process: both completions are remembered
    second = FeedbackRL(kafka, run, cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    assert first.get("duplicate", 0) == 2 and second["duplicate"] == 2, (first, second)
    admitted = decode_all(kafka, topics.topic_name(run, "admitted"))
    samples = [s for d in admitted for s in d.record["samples"]]
    assert len(samples) == 2, (first, second)

"""Admission accepts a group only for a task the scheduler released to the region it came from,
on a real broker (one cluster holding the trainer region's topics and the copies MirrorMaker 2
would bring home from ``eu`` and ``us``).

Properties: a group released to ``eu`` and rolled out there is admitted; samples and rewards a
rollout region made up for a task never released, and a copy ``eu`` sends of a task released
only to ``us``, are each dead-lettered with the reason (``invalid_record``) and decide nothing:
no admitted or rejected record names the invented group, and the genuine ``us`` group is still
admitted, from its ``us`` copy only.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from helpers import decode_all
from test_events import examples

from rlstream.consumers.admission import Admission
from rlstream.consumers.admission_rules import AdmissionConfig
from rlstream.consumers.consumer import Stopper
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.rollout.scheduler import SchedulerConfig, task_record
from rlstream.schemas import topics

REGIONS = topics.Regions("trainer", ("eu", "us"))
G = 2


def _samples(run: str, group: str, copy: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(topic, event, record) of a complete group of ``G`` samples with a ``tests`` reward
    each, as region ``copy`` rolls it out and MirrorMaker brings it home."""
    out = []
    for i in range(G):
        trajectory = {
            **examples()["trajectory"],
            "run": run,
            "group_id": group,
            "task_id": group,
            "sample_index": i,
            "group_size": G,
            "policy_version": 0,
            "region": copy,
        }
        reward = {
            **examples()["reward"],
            "run": run,
            "group_id": group,
            "task_id": group,
            "sample_index": i,
            "judge": "tests",
            "score": float(i),
            # judged in the rollout region: it names that region's log, not the copy here
            "trajectory": {
                "topic": topics.topic_name(run, "trajectories"),
                "partition": 0,
                "offset": i,
            },
            "error": None,
        }
        for stream, event, rec in (
            ("trajectories", "trajectory", trajectory),
            ("rewards", "reward", reward),
        ):
            out.append((topics.remote_topic(copy, topics.topic_name(run, stream)), event, rec))
    return out


def _admitted(kafka: KafkaSettings, run: str) -> set[str]:
    return {d.record["group_id"] for d in decode_all(kafka, topics.topic_name(run, "admitted"))}


def _release(run: str, index: int, region: str) -> dict[str, Any]:
    rec = task_record(run, SchedulerConfig(), index, 0)
    return {**rec, "tags": {"region": region}}


def test_only_groups_released_to_their_region_are_admitted(
    kafka: KafkaSettings, unique_run: str
) -> None:
    run = unique_run
    ensure_run_topics(kafka, run, regions=REGIONS, here="trainer")
    to_eu, to_us = _release(run, 0, "eu"), _release(run, 1, "us")
    invented = "invented-task-1"
    with EventProducer.connect(kafka) as producer:
        for task in (to_eu, to_us):
            producer.produce(topics.topic_name(run, "tasks"), "task", task, task["task_id"])
        forged = [*_samples(run, invented, "eu"), *_samples(run, to_us["task_id"], "eu")]
        genuine = [*_samples(run, to_eu["task_id"], "eu"), *_samples(run, to_us["task_id"], "us")]
        for topic, event, rec in [*forged, *genuine]:  # the forged copy arrives first
            producer.produce(topic, event, rec, rec["group_id"])
    cfg = AdmissionConfig(judges={"tests": 1.0}, reject_no_signal=False, timeout_s=600)
    admission = Admission(kafka, run, cfg, regions=REGIONS)
    stopper = Stopper()
    thread = threading.Thread(target=admission.loop.run, args=(stopper,), daemon=True)
    thread.start()
    genuine_ids = {to_eu["task_id"], to_us["task_id"]}
    try:
        deadline = time.monotonic() + 90
        # until the genuine groups are admitted and the forged records refused (or decided)
        while not genuine_ids <= (admitted := _admitted(kafka, run)) or (
            len(decode_all(kafka, topics.topic_name(run, "dlq"))) < len(forged)
            and invented not in admitted
        ):
            assert thread.is_alive() and time.monotonic() < deadline, admission.counts
            time.sleep(0.5)
    finally:
        stopper.stop()
        thread.join(30)
        admission.close()

    decided = [
        d.record
        for stream in ("admitted", "rejected")
        for d in decode_all(kafka, topics.topic_name(run, stream))
    ]
    assert sorted(d["group_id"] for d in decided) == sorted([to_eu["task_id"], to_us["task_id"]])
    assert all(d["decision"] == "admitted" for d in decided)
    [us_group] = [d for d in decided if d["group_id"] == to_us["task_id"]]
    us_copy = topics.remote_topic("us", topics.topic_name(run, "trajectories"))
    assert {s["trajectory"]["topic"] for s in us_group["samples"]} == {us_copy}
    letters = [d.record for d in decode_all(kafka, topics.topic_name(run, "dlq"))]
    assert len(letters) == len(forged) and {d["reason"] for d in letters} == {"invalid_record"}
    errors = " ".join(d["error"] for d in letters)
    assert f"task {invented!r} was never released" in errors
    assert "released to ['us'], not to region 'eu'" in errors
    _check_trace_context(kafka, decided)


def _check_trace_context(kafka: KafkaSettings, decided: list[dict[str, Any]]) -> None:
    """Each decision names its task's release to the copy's region, and each sample its
    trajectory and its rewards, by position: lineage is a join, not a search."""
    from rlstream.consumers.read_to_end import read_at, reader

    consumer = reader(kafka, "trace-check")
    try:
        for decision in decided:
            ref = decision["task_ref"]
            assert ref is not None, decision["group_id"]
            task = read_at(consumer, ref["topic"], ref["partition"], ref["offset"])
            copy = topics.parse_topic(decision["samples"][0]["trajectory"]["topic"]).region
            assert task is not None and task["task_id"] == decision["group_id"]
            assert task["tags"]["region"] == copy
            for sample in decision["samples"]:
                [reward_ref] = sample["reward_refs"]
                where = (reward_ref["topic"], reward_ref["partition"], reward_ref["offset"])
                reward = read_at(consumer, *where)
                assert reward is not None and reward["group_id"] == decision["group_id"]
                assert reward["sample_index"] == sample["sample_index"]
                assert reward["judge"] == "tests" and reward["score"] == sample["rewards"]["tests"]
                t = sample["trajectory"]
                traj = read_at(consumer, t["topic"], t["partition"], t["offset"])
                assert traj is not None and traj["sample_index"] == sample["sample_index"]
    finally:
        consumer.close()

"""Run management on a real broker: runs are listed from ``rl.runs``, a run's trajectories can be
re-scored by another judge into a second run, and a deleted run's topics are gone."""

from __future__ import annotations

import time

from helpers import decode_all
from test_events import examples

from rlstream.consumers.run_log import run_manifests
from rlstream.ops.forensics.replay import rescore
from rlstream.ops.run.config import RunConfig
from rlstream.ops.run.recorded import record_run_manifest
from rlstream.producers.client.admin import admin_client, ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.schemas import topics


def test_list_rescore_and_delete_a_run(kafka, unique_run):
    first, second = unique_run, f"{unique_run}-b"
    ensure_run_topics(kafka, first)
    record_run_manifest(kafka, first, RunConfig(), "finished", int(time.time() * 1000), ["trainer"])
    traj = examples()["trajectory"]
    answers = ["x=x*2;return x", "return (", "return x+1"]
    with EventProducer.connect(kafka) as producer:
        for i, answer in enumerate(answers):
            producer.produce(
                topics.topic_name(first, "trajectories"),
                "trajectory",
                {
                    **traj,
                    "run": first,
                    "group_id": "fx-7",
                    "task_id": "fx-7",
                    "sample_index": i,
                    "segment_index": 0,
                    "segment_count": 1,
                    "token_offset": 0,
                    "completion": answer,
                },
                "fx-7",
            )
    assert run_manifests(kafka)[first]["status"] == "finished"

    assert rescore(kafka, first, "format", second, log=lambda _: None) == len(answers)
    rewards = sorted(
        (d.record["sample_index"], d.record["score"], d.record["judge"])
        for d in decode_all(kafka, topics.topic_name(second, "rewards"))
    )
    assert rewards == [(0, 1.0, "format"), (1, 0.0, "format"), (2, 1.0, "format")]
    copies = decode_all(kafka, topics.topic_name(second, "trajectories"))
    assert [d.record["run"] for d in copies] == [second] * len(answers)

    from rlstream.ops.cli.cmd_replay import _delete

    assert _delete(kafka, first) == 0
    assert first not in run_manifests(kafka)
    time.sleep(1)
    left = [
        t
        for t in admin_client(kafka).list_topics(timeout=10).topics
        if t.startswith(f"rl.{first}.")
    ]
    assert left == []

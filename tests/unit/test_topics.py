"""The topic catalog: names, co-partitioning, size limits and Kafka configs.

Properties asserted: derived names are legal Kafka names and parse back (also as MirrorMaker 2
remote copies); group-keyed streams are co-partitioned whatever the catalog's parameters; every
stream's limit holds its largest record; keys come from records.
"""

from __future__ import annotations

import re

import pytest

from rlstream.schemas import arrays as A
from rlstream.schemas import events as E
from rlstream.schemas import topics as T

KAFKA_LEGAL = re.compile(r"[A-Za-z0-9._-]{1,249}")


def test_catalog_has_every_stream_of_the_design() -> None:
    assert set(T.STREAMS) == {
        "tasks", "trajectories", "rewards", "admitted", "rejected", "weights.manifests",
        "weights.chunks", "feedback", "served", "evals", "capacity", "preempted", "dlq",
        "schemas", "runs", "audit",
    }  # fmt: skip
    for spec in T.STREAMS.values():
        assert spec.event in E.EVENTS or (spec.stream == "schemas" and spec.event == "")
        assert spec.partitions >= 1 and spec.key_doc
        assert spec.cluster_wide == (spec.stream in ("schemas", "runs", "audit"))


def test_topic_names() -> None:
    assert T.topic_name("r1", "trajectories") == "rl.r1.trajectories"
    assert T.topic_name("r1", "weights.chunks") == "rl.r1.weights.chunks"
    assert (
        T.topic_name("r1", "schemas")
        == T.cluster_topic("schemas")
        == T.SCHEMAS_TOPIC
        == "rl.schemas"
    )
    assert T.cluster_topic("runs") == T.RUNS_TOPIC == "rl.runs"
    assert set(T.run_topics("r1")) == set(T.RUN_STREAMS)
    with pytest.raises(ValueError, match="per-run stream"):
        T.cluster_topic("tasks")
    with pytest.raises(ValueError, match="unknown stream"):
        T.topic_name("r1", "trajectory")


@pytest.mark.parametrize("bad", ["", "a.b", "-x", "has space", "ü", "x" * 65, "r/1"])
def test_invalid_run_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        T.topic_name(bad, "tasks")
    with pytest.raises(ValueError, match="invalid run name"):
        T.group_id(bad, "learner")


def test_every_derived_name_is_a_legal_kafka_name_even_when_mirrored() -> None:
    run, region = "R" * T.MAX_NAME_LENGTH, "z" * T.MAX_NAME_LENGTH
    for stream in T.STREAMS:
        name = f"{region}.{T.topic_name(run, stream)}"
        assert KAFKA_LEGAL.fullmatch(name), name


@pytest.mark.parametrize("stream", sorted(T.STREAMS))
def test_parse_topic_inverts_topic_name(stream: str) -> None:
    topic = T.topic_name("run-7_b", stream)
    run = None if T.STREAMS[stream].cluster_wide else "run-7_b"
    assert T.parse_topic(topic) == T.TopicName(None, run, stream)
    assert T.parse_topic(f"eu.{topic}") == T.TopicName("eu", run, stream)


@pytest.mark.parametrize(
    "bad", ["orders", "rl.r1", "rl.r1.nope", "rl.schemas.x", "eu.us.rl.r1.tasks", "rl..tasks"]
)
def test_parse_topic_refuses_foreign_topics(bad: str) -> None:
    with pytest.raises(ValueError, match="not an rlstream topic"):
        T.parse_topic(bad)


def test_topic_pattern_matches_the_named_copies_only() -> None:
    local = re.compile(T.topic_pattern("r1", "trajectories")).fullmatch
    assert local("rl.r1.trajectories") and not local("eu.rl.r1.trajectories")
    pattern = T.topic_pattern("r1", "trajectories", (None, "eu"))
    assert pattern.startswith("^")
    match = re.compile(pattern).fullmatch
    assert match("rl.r1.trajectories") and match("eu.rl.r1.trajectories")
    for other in (
        "us.rl.r1.trajectories",
        "rl.r10.trajectories",
        "rl.r1.trajectoriesX",
        "rl.r1.rewards",
        "rlxr1.trajectories",
        "a.b.rl.r1.trajectories",
        "eu.eu.rl.r1.trajectories",
    ):
        assert not match(other), other
    remote_only = re.compile(T.topic_pattern("r1", "tasks", ["trainer"])).fullmatch
    assert remote_only("trainer.rl.r1.tasks") and not remote_only("rl.r1.tasks")
    with pytest.raises(ValueError):
        T.topic_pattern("r1", "tasks", [])
    with pytest.raises(ValueError, match="invalid region name"):
        T.topic_pattern("r1", "tasks", ["e.u"])


REGIONS = T.Regions("trainer", ("eu", "us"))


def test_each_stream_accepts_only_the_regions_that_write_it() -> None:
    """Outward streams reach a rollout region only as the trainer region's copy; inward streams
    come home from the rollout regions; nothing else (admitted above all) is ever remote."""
    for stream, spec in T.STREAMS.items():
        home, eu = REGIONS.sources(stream, "trainer"), REGIONS.sources(stream, "eu")
        if spec.mirror == "outward":
            assert home == (None,) and eu == ("trainer",), stream
        elif spec.mirror == "inward":
            assert home == (None, "eu", "us") and eu == (None,), stream
        else:
            assert home == eu == (None,), stream
    admitted = re.compile(REGIONS.pattern("r1", "admitted", "trainer")).fullmatch
    assert admitted("rl.r1.admitted")
    assert not any(admitted(f"{r}.rl.r1.admitted") for r in ("eu", "us", "trainer"))
    assert REGIONS.topic("r1", "weights.chunks", "eu") == "trainer.rl.r1.weights.chunks"
    assert REGIONS.topic("r1", "weights.chunks", "trainer") == "rl.r1.weights.chunks"
    assert ("trainer", "tasks") in REGIONS.copies("eu")
    assert set(REGIONS.copies("trainer")) == {
        (r, s) for r in ("eu", "us") for s in ("trajectories", "rewards", "capacity", "preempted")
    }
    assert REGIONS.origin("eu.rl.r1.trajectories", "trainer") == "eu"
    assert REGIONS.origin("rl.r1.rewards", "trainer") == "trainer"
    with pytest.raises(ValueError, match="not one of the run's regions"):
        REGIONS.sources("tasks", "asia")
    with pytest.raises(ValueError, match="distinct"):
        T.Regions("eu", ("eu",))
    single = T.Regions()
    assert all(single.sources(s, "trainer") == (None,) for s in T.STREAMS)


def test_mirror_regexes_select_local_topics_of_their_direction() -> None:
    out = re.compile(T.mirror_regex("outward")).fullmatch
    home = re.compile(T.mirror_regex("inward")).fullmatch
    for stream, spec in T.STREAMS.items():
        name = T.topic_name("run-1", stream)
        assert bool(out(name)) == (spec.mirror == "outward"), stream
        assert bool(home(name)) == (spec.mirror == "inward"), stream
        assert not out(f"trainer.{name}") and not home(f"eu.{name}")  # never a copy again
    assert not out("rl.r.tasksX") and not home("rl.a.b.trajectories")


def test_group_ids() -> None:
    assert T.group_id("r1", "learner") == "rlstream.r1.learner"
    assert T.group_id("r1", "judge", "tests") == "rlstream.r1.judge.tests"
    with pytest.raises(ValueError, match="invalid name name"):
        T.group_id("r1", "judge", "a.b")
    with pytest.raises(ValueError, match="invalid role name"):
        T.group_id("r1", "")


def test_group_keyed_streams_are_copartitioned() -> None:
    for catalog in (T.STREAMS, T.catalog(group_partitions=24, task_partitions=3)):
        counts = {catalog[s].partitions for s in T.CO_PARTITIONED}
        assert len(counts) == 1
        assert {catalog[s].key_fields for s in T.CO_PARTITIONED} == {("group_id",)}
        T.check_copartitioned(catalog)
    assert T.catalog(24)["rewards"].partitions == 24
    broken = dict(T.STREAMS)
    broken["rewards"] = T.with_partitions(broken["rewards"], 5)
    with pytest.raises(ValueError, match="co-partitioned"):
        T.check_copartitioned(broken)
    with pytest.raises(ValueError):
        T.catalog(0)


def test_served_completions_are_keyed_and_partitioned_like_feedback() -> None:
    """A served record's key is its request id (the Trajectory's group_id), the key of the
    feedback that names it, and both streams have one partition count."""
    feedback, served = (T.STREAMS[s] for s in T.REQUEST_STREAMS)
    assert feedback.partitions == served.partitions
    assert served.event == "trajectory" and served.retention_ms >= feedback.retention_ms
    assert T.record_key("served", {"group_id": "req-1"}) == T.record_key(
        "feedback", {"request_id": "req-1"}
    )


def test_size_limits_hold_the_largest_records() -> None:
    chunks = T.STREAMS["weights.chunks"]
    assert chunks.max_message_bytes >= T.CHUNK_PAYLOAD_BYTES + 128 * 1024
    chunk = {"run": "r", "model": "m", "version": 1, "index": 0, "count": 1, "checksum": "0" * 32,
             "payload": b"\x00" * T.CHUNK_PAYLOAD_BYTES}  # fmt: skip
    assert len(E.encode("weight_chunk", chunk)) <= chunks.max_value_bytes
    # 32k tokens x (4 + 4 + 1 + 8 layers x top-8) bytes, unsplit, with room for text and turns
    assert T.STREAMS["trajectories"].max_value_bytes >= 32_768 * (9 + 64) + 512 * 1024
    biggest = max(s.max_message_bytes for s in T.STREAMS.values() if s.stream != "dlq")
    assert T.STREAMS["dlq"].max_message_bytes >= biggest + T.VALUE_HEADROOM
    for spec in T.STREAMS.values():
        assert 0 < spec.max_value_bytes < spec.max_message_bytes


def test_split_records_fit_their_topics() -> None:
    import numpy as np

    n = 40_000  # > 8 MiB at 8 layers x top-32: must be split
    fields = A.pack_tokens(
        np.ones(n, np.int32),
        np.zeros(n, np.float32),
        np.ones(n, np.uint8),
        np.zeros((n, 8, 32), np.uint8),
    )
    record = {
        "run": "r", "group_id": "g", "task_id": "t", "sample_index": 0, "group_size": 1, "policy_version": 0,
        "model": "m", "worker_id": "w", "region": "us", **fields, "prompt_tokens": 1, "completion": "",
        "turns": [], "outcome": {"status": "completed", "tool_calls": 0, "summarised": False},
        "timings": {"queued_ms": 0, "started_ms": 0, "finished_ms": 0, "generate_ms": 0, "env_ms": 0},
    }  # fmt: skip
    spec = T.STREAMS["trajectories"]
    segments = A.split_segments(record, spec.max_value_bytes)
    assert len(segments) == 2
    assert all(len(E.encode("trajectory", s)) <= spec.max_value_bytes for s in segments)


def test_topic_configs() -> None:
    admitted = T.topic_configs(T.STREAMS["admitted"], min_insync_replicas=2)
    assert admitted == {
        "cleanup.policy": "delete",
        "retention.ms": "-1",
        "max.message.bytes": str(8 * T.MIB),
        "message.timestamp.type": "CreateTime",
        "min.insync.replicas": "2",
    }
    schemas = T.topic_configs(T.STREAMS["schemas"])
    assert schemas["cleanup.policy"] == "compact" and schemas["retention.ms"] == "-1"
    assert "min.insync.replicas" not in schemas
    assert T.topic_configs(T.STREAMS["tasks"])["retention.ms"] == str(7 * T.DAY_MS)


def test_replay_inputs_are_kept_forever() -> None:
    for stream in ("admitted", "weights.manifests", "runs", "schemas"):
        assert T.STREAMS[stream].retention_ms == T.FOREVER, stream


def test_weight_chunks_are_never_deleted_by_age() -> None:
    """Time retention could delete the only keyframe a late worker can start from: chunks are
    deleted by the publisher's count-based rule (``producers.weights.retention``), never by the
    broker."""
    assert T.STREAMS["weights.chunks"].retention_ms == T.FOREVER


def test_mirror_directions_follow_the_design() -> None:
    outward = {s for s, spec in T.STREAMS.items() if spec.mirror == "outward"}
    inward = {s for s, spec in T.STREAMS.items() if spec.mirror == "inward"}
    assert outward == {
        "tasks", "weights.manifests", "weights.chunks", "evals", "schemas", "runs", "audit"
    }  # fmt: skip
    assert inward == {"trajectories", "rewards", "capacity", "preempted"}


def test_record_keys() -> None:
    assert T.record_key("trajectories", {"group_id": "g-1", "run": "r"}) == b"g-1"
    assert T.record_key("weights.chunks", {"model": "m", "version": 17, "index": 3}) == b"m/17/3"
    assert T.record_key("dlq", {"source_topic": "rl.r.tasks"}) == b"rl.r.tasks"
    assert T.record_key("runs", {"run": "r"}) == b"r"
    with pytest.raises(ValueError, match="lacks key field 'task_id'"):
        T.record_key("tasks", {"run": "r"})
    with pytest.raises(ValueError, match="not a record field"):
        T.record_key("schemas", {})


def test_librdkafka_accepts_every_subscription_pattern() -> None:
    """librdkafka has its own regex engine (no ``(?:``); subscribing checks a pattern locally."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": "127.0.0.1:9", "group.id": "pattern-check"})
    try:
        for stream in T.STREAMS:
            for here in REGIONS.names:
                consumer.subscribe([REGIONS.pattern("r1", stream, here)])
        consumer.subscribe([T.streams_pattern("r1")])
    finally:
        consumer.close()

"""The self-describing event log on a real broker: every event type round-trips; a record
written with a schema this code never saw is decoded from ``rl.schemas``; a corrupted record
lands in the dead-letter stream; a client we did not write (kcat) reads our records and decodes
them with plain fastavro using only the schema fetched from ``rl.schemas``."""

from __future__ import annotations

import io
import json
import shutil
import subprocess

import fastavro
import pytest
from helpers import decode_all, make_topics, read_all, task
from test_events import examples

from rlstream.consumers.consumer import Stopper, load_schema_topic, schema_topics
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.producers.client.producer import EventProducer
from rlstream.schemas import events, topics


def test_every_event_type_round_trips(kafka, unique_run):
    topic = f"{unique_run}.all"
    make_topics(kafka, topic, partitions=1)
    records = examples()
    with EventProducer.connect(kafka) as producer:
        for event, record in records.items():
            producer.produce(topic, event, record, event)
    decoded = decode_all(kafka, topic)
    assert [d.event for d in decoded] == list(records)
    for d in decoded:
        assert d.record == records[d.event], d.event


def _evolved_task_schema() -> dict:
    """Task as a future version might write it: one more field (canonical form, no docs)."""
    _, parsed = events.default_store().current("task")
    schema = json.loads(events.canonical_form(parsed))
    schema["fields"].append({"name": "priority_v99", "type": "int", "default": 0})
    return schema


def test_record_from_unseen_writer_schema_is_decoded_via_rl_schemas(kafka, unique_run):
    topic = f"{unique_run}.evolve"
    make_topics(kafka, topic, partitions=1)
    writer = events.SchemaStore()
    fp = writer.add(json.dumps(_evolved_task_schema()))
    record = {**examples()["task"], "task_id": "t-new", "priority_v99": 5}
    value = writer_bytes = bytes(events.MAGIC) + fp + _avro_body(_evolved_task_schema(), record)
    with EventProducer.connect(kafka) as producer:
        producer.produce_raw(topics.SCHEMAS_TOPIC, writer.canonical(fp).encode(), fp.hex())
        producer.produce_raw(topic, writer_bytes, b"t-new")
    fresh = events.SchemaStore()  # today's code: knows nothing of the evolved schema
    assert fp not in fresh
    with pytest.raises(events.DecodeError):
        events.deserializer(fresh)(value)
    assert load_schema_topic(kafka, fresh) >= 1
    decoded = events.deserializer(fresh)(read_all(kafka, topic)[0][1])
    assert decoded.event == "task" and decoded.record["task_id"] == "t-new"
    assert "priority_v99" not in decoded.record  # read with today's reader schema


def test_a_writer_schema_known_only_to_a_mirrored_copy_of_rl_schemas_is_found(kafka, unique_run):
    # a rollout region: the trainer region's writer schemas arrive as REGION.rl.schemas
    copy = topics.remote_topic(unique_run, topics.SCHEMAS_TOPIC)
    make_topics(kafka, copy, partitions=1)
    writer = events.SchemaStore()
    schema = _evolved_task_schema()
    schema["fields"].append(
        {"name": f"only_in_{unique_run.replace('-', '_')}", "type": "int", "default": 0}
    )
    fp = writer.add(json.dumps(schema))
    with EventProducer.connect(kafka) as producer:
        producer.produce_raw(copy, writer.canonical(fp).encode(), fp.hex())
    fresh = events.SchemaStore()
    assert copy in schema_topics(kafka)
    load_schema_topic(kafka, fresh)
    assert fp in fresh


def test_garbage_in_the_schema_log_is_skipped_and_the_rest_still_read(kafka, unique_run):
    copy = topics.remote_topic(f"{unique_run}-g", topics.SCHEMAS_TOPIC)
    make_topics(kafka, copy, partitions=1)
    writer = events.SchemaStore()
    schema = _evolved_task_schema()
    schema["fields"].append({"name": "after_garbage", "type": "int", "default": 0})
    fp = writer.add(json.dumps(schema))
    with EventProducer.connect(kafka) as producer:
        producer.produce_raw(copy, b"\xff\xfe not utf-8", "00")
        producer.produce_raw(copy, b"not a schema", "00")
        producer.produce_raw(
            copy, writer.canonical(fp).encode(), "ab" * 8
        )  # key not its fingerprint
        producer.produce_raw(copy, writer.canonical(fp).encode(), fp.hex())
    fresh = events.SchemaStore()
    load_schema_topic(kafka, fresh)  # never raises
    assert fp in fresh


def _avro_body(schema: dict, record: dict) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), record)
    return buf.getvalue()


def test_corrupted_record_goes_to_dead_letter_stream(kafka, unique_run):
    src, out, dlq = (f"{unique_run}.{s}" for s in ("in", "out", "dlq"))
    make_topics(kafka, src, out, dlq, partitions=1)
    good = events.encode("task", task(unique_run, "t1"))
    corrupt = good[:-7]  # truncated body
    with EventProducer.connect(kafka) as producer:
        producer.produce_raw(src, corrupt, b"t0", [("trace", b"abc")])
        producer.produce_raw(src, good, b"t1")
    loop = TransactionalLoop(
        kafka,
        group_id=f"rlstream.{unique_run}.copy",
        topics=[src],
        transactional_id=f"rlstream.{unique_run}.copy.0",
        dlq_topic=dlq,
        process=lambda recs: [Output(out, None, r.message.value(), r.key) for r in recs],
    )
    loop.run(Stopper(), idle_exit_s=3)
    assert [k for k, _, _ in read_all(kafka, out)] == [b"t1"], "the consumer went on"
    (letter,) = decode_all(kafka, dlq)
    rec = letter.record
    assert rec["reason"] == "corrupt_body" and rec["value"] == corrupt
    assert (rec["source_topic"], rec["partition"], rec["offset"]) == (src, 0, 0)
    assert rec["headers"] == [{"key": "trace", "value": b"abc"}]
    headers = dict(read_all(kafka, dlq)[0][2].headers())
    assert headers["rlstream.dlq.reason"] == b"corrupt_body"


@pytest.mark.unsecured_only("kcat is given a plaintext address, no SASL/TLS")
@pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed (make sysdeps)")
def test_kcat_reads_our_record_and_fastavro_decodes_it_with_the_published_schema(kafka, unique_run):
    topic = f"{unique_run}.interop"
    make_topics(kafka, topic, partitions=1)
    record = task(unique_run, "t-kcat")
    with EventProducer.connect(kafka) as producer:
        producer.produce(topic, "task", record, "t-kcat")
    value = _kcat(kafka.bootstrap_servers, topic, "-o", "0", "-c", "1")
    assert value[:2] == events.MAGIC
    fingerprint = value[2:10]
    schemas = _kcat(
        kafka.bootstrap_servers, topics.SCHEMAS_TOPIC, "-o", "beginning", "-f", "%k\t%s\n"
    ).decode()
    published = dict(line.split("\t", 1) for line in schemas.splitlines() if "\t" in line)
    schema = fastavro.parse_schema(json.loads(published[fingerprint.hex()]))
    decoded = fastavro.schemaless_reader(io.BytesIO(value[10:]), schema)
    assert decoded["task_id"] == "t-kcat" and decoded["prompt"] == record["prompt"]


def _kcat(bootstrap: str, topic: str, *args: str) -> bytes:
    cmd = ["kcat", "-b", bootstrap, "-C", "-t", topic, "-e", "-q", *args]
    if "-f" not in args:
        cmd += ["-D", "", "-f", "%s"]
    return subprocess.run(cmd, capture_output=True, check=True, timeout=60).stdout

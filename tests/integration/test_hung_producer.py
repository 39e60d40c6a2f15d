"""A transactional call that hangs replaces the producer in the process, on a real broker.

librdkafka's ``send_offsets_to_transaction`` has blocked for good after a broker died (upstream
#5456, #5511). Here the call is made to block (a stand-in for the stuck C call, which no test can
summon on demand), the limit is one second, and the checks are Kafka's own: the transaction is
reported aborted within the limit and a little, nothing it produced is visible to a
read-committed reader, the same ``EventProducer`` then commits the batch again with a new
instance of the same transactional id, the group's offsets move once, and the stuck instance is
fenced (its next commit fails fatally)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from helpers import make_topics, read_all

from rlstream.producers.client.producer import EventProducer, TransactionAborted


class _Stuck:
    """The producer whose ``send_offsets_to_transaction`` never returns (until released)."""

    def __init__(self, real: object, release: threading.Event) -> None:
        self.real, self.release = real, release

    def send_offsets_to_transaction(self, *args: object) -> None:
        self.release.wait(600)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def test_a_hung_call_replaces_the_producer_and_the_batch_commits_once(kafka, unique_run) -> None:
    src, out = f"{unique_run}.src", f"{unique_run}.out"
    make_topics(kafka, src, out, partitions=1)
    group = f"hung-{uuid.uuid4().hex[:8]}"
    consumer = Consumer({**kafka.librdkafka(), "group.id": group, "enable.auto.commit": "false"})
    release = threading.Event()
    settings = kafka.model_copy(update={"hung_call_exit_s": 1.0})
    producer = EventProducer.transactional(settings, f"rlstream.{unique_run}.hung.0", timeout=30)
    stuck = _Stuck(producer._producer, release)
    producer._producer = stuck  # type: ignore[assignment]
    offsets = [TopicPartition(src, 0, 1)]
    try:
        consumer.subscribe([src])
        consumer.poll(1.0)  # joins the group: its metadata names a live member
        started = time.monotonic()
        with (
            pytest.raises(TransactionAborted, match="replaced"),
            producer.transaction(timeout=10) as txn,
        ):
            producer.produce_raw(out, b"first try")
            txn.send_offsets(offsets, consumer.consumer_group_metadata())
        assert time.monotonic() - started < 30  # the limit, then a new instance's init
        assert producer.replacements == 1 and producer._producer is not stuck
        with producer.transaction(timeout=10) as txn:  # the batch again, on the new instance
            producer.produce_raw(out, b"second try")
            txn.send_offsets(offsets, consumer.consumer_group_metadata())
        assert [value for _, value, _ in read_all(kafka, out)] == [b"second try"]
        (committed,) = consumer.committed([TopicPartition(src, 0)], timeout=10)
        assert committed.offset == 1
        with pytest.raises(KafkaException) as fenced:
            stuck.real.commit_transaction(10)  # type: ignore[attr-defined]
        assert fenced.value.args[0].fatal() or "fenced" in str(fenced.value).lower()
    finally:
        release.set()
        consumer.close()


class _StuckOnce(_Stuck):
    """Stuck in its first ``send_offsets_to_transaction`` only (a new instance replaces it)."""


def test_a_version_whose_commit_hung_is_published_again_and_committed_once(
    kafka, unique_run
) -> None:
    """The learner's publish (one rank) survives the hang in place: the first manifest
    transaction is aborted when its producer is replaced, the version is published again on the
    new instance, and exactly one manifest of it, with the step's offsets, is committed."""
    import numpy as np

    from rlstream.producers.client.admin import ensure_run_topics
    from rlstream.producers.weights.publisher import rank_publisher
    from rlstream.schemas import events, topics
    from rlstream.schemas.deltacodec import TensorBits

    ensure_run_topics(kafka, unique_run)
    src = f"{unique_run}.admitted-src"
    make_topics(kafka, src, partitions=1)
    group = f"hung-learner-{uuid.uuid4().hex[:8]}"
    consumer = Consumer({**kafka.librdkafka(), "group.id": group, "enable.auto.commit": "false"})
    settings = kafka.model_copy(update={"hung_call_exit_s": 1.0})
    pub = rank_publisher(settings, unique_run, "policy", f"rlstream.{unique_run}.learner.0")
    release = threading.Event()
    stuck = _StuckOnce(pub.producer._producer, release)
    pub.producer._producer = stuck  # type: ignore[assignment]
    bits = np.arange(4096, dtype=np.uint16)
    try:
        consumer.subscribe([src])
        consumer.poll(1.0)
        rec = pub.publish_version(
            {"w": TensorBits("bfloat16", (4096,), bits)},
            0,
            offsets=[TopicPartition(src, 0, 5)],
            group_metadata=consumer.consumer_group_metadata(),
            timeout=10,
            attempts=2,
        )
        assert rec["version"] == 0 and pub.producer.replacements == 1
        manifests = read_all(kafka, topics.topic_name(unique_run, "weights.manifests"))
        versions = [events.decode(value).record["version"] for _, value, _ in manifests]
        assert versions == [0]
        (committed,) = consumer.committed([TopicPartition(src, 0)], timeout=10)
        assert committed.offset == 5
    finally:
        release.set()
        pub.close()
        consumer.close()

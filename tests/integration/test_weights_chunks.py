"""Weight chunks outside the transaction, on a real broker: a version's size is not bound by a
transaction's timeout, and the chunks no committed manifest names (an aborted publish, a fenced
publisher) are never applied and go with the older versions when retention cuts past them.

The chunks of a version are written by the publisher's idempotent, non-transactional producer
and acknowledged before one short transaction commits the manifest with the consumer offsets
(``producers.weights.publisher``); these tests check what that changes for readers and for
retention.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaException
from helpers import chunk_filter_publisher, read_all, signed_run
from test_weights_sync import CHUNK, MODEL, Learner, _assert_on, _make_topics, _subscriber

from rlstream.consumers.weights.manifest_log import read_manifests
from rlstream.producers.client.admin import admin_client
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.producers.weights.retention import prune
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics

#: The publisher's transaction timeout in the first test, and how long its chunks take: longer
#: than the timeout plus the broker's sweep of timed-out transactions (every 10 s by default),
#: so a transaction open while the chunks are written would be aborted by the broker.
TXN_TIMEOUT_MS = 2_000
SLOW_CHUNKS_S = 14.0


class _Abandoned(Exception):
    """Raised inside a transaction to abort it."""


def _publisher(kafka: KafkaSettings, run: str, k: int, **kw: Any) -> WeightPublisher:
    txn_timeout = kw.pop("txn_timeout_ms", None)
    overrides = {} if txn_timeout is None else {"transaction.timeout.ms": str(txn_timeout)}
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner", 30, **overrides)
    if "signer" not in kw:  # the run is signed from its creation
        kw["signer"] = signed_run(kafka, run)
    on_chunk = kw.pop("on_chunk", None)
    cls = WeightPublisher if on_chunk is None else chunk_filter_publisher(WeightPublisher, on_chunk)
    return cls(producer, run, MODEL, keyframe_every=k, max_chunk_bytes=CHUNK, **kw)


def _chunks(kafka: KafkaSettings, run: str) -> list[tuple[int, int, dict[str, Any]]]:
    """Every chunk record a ``read_committed`` reader sees: (partition, offset, record)."""
    topic = topics.topic_name(run, "weights.chunks")
    return [
        (m.partition(), m.offset(), events.decode(v).record)
        for _, v, m in read_all(kafka, topic, committed_only=True)
    ]


def _orphans(kafka: KafkaSettings, run: str) -> list[tuple[int, int, dict[str, Any]]]:
    """The chunk records at positions no committed manifest names."""
    named = {
        (c["ref"]["partition"], c["ref"]["offset"])
        for m in read_manifests(kafka, run, MODEL)
        for c in m["chunks"]
    }
    return [(p, o, c) for p, o, c in _chunks(kafka, run) if (p, o) not in named]


def test_a_version_that_outlasts_the_transaction_timeout_commits(kafka, unique_run):
    """Writing the keyframe's chunks takes longer than the publisher's transaction may stay open
    (its timeout plus the broker's sweep); the version still commits, in a short transaction,
    and a subscriber applies it bit-exact, then a delta after it."""
    _make_topics(kafka, unique_run)
    learner = Learner(seed=21)
    n = len(codec.encode_keyframe(learner.states[0], version=0, max_chunk_bytes=CHUNK).chunks)
    assert n >= 6, "the keyframe must spread over the chunk partitions"

    def slow(version: int, kind: str, index: int, payload: bytes) -> bytes:
        if version == 0:
            time.sleep(SLOW_CHUNKS_S / n)  # a slow link to the brokers: acks come late
        return payload

    pub = _publisher(kafka, unique_run, 4, txn_timeout_ms=TXN_TIMEOUT_MS, on_chunk=slow)
    t0 = time.monotonic()
    pub.publish_version(learner.states[0], 0)
    took = time.monotonic() - t0
    assert took > TXN_TIMEOUT_MS / 1000 + 10, f"the chunks took only {took:.1f}s"
    pub.publish_version(learner.step(), 1)  # the producer was not fenced: it publishes on
    with _subscriber(kafka, unique_run) as sub:
        sub.wait_for(1, timeout=30)
        _assert_on(sub, learner, 1)
        assert not sub.failures, sub.failures
    manifests = read_manifests(kafka, unique_run, MODEL)
    assert [(m["version"], m["kind"]) for m in manifests] == [(0, "keyframe"), (1, "delta")]
    assert not _orphans(kafka, unique_run), "every chunk written is named by a manifest"
    parts = {c["ref"]["partition"] for c in manifests[0]["chunks"]}
    assert parts == set(range(topics.STREAMS["weights.chunks"].partitions)), parts


def test_orphan_chunks_are_never_applied_and_retention_deletes_them(kafka, unique_run):
    """An aborted publish leaves its chunks (read_committed readers see them: nothing
    transactional writes the chunk topic) but no manifest: a live subscriber and a late one go
    from version 1 to the real version 2 as if they were not there; once keyframe 6 lands and
    retention keeps only from keyframe 3 on, the orphans are deleted with versions 0 to 2."""
    _make_topics(kafka, unique_run)
    learner, pub = Learner(seed=22), _publisher(kafka, unique_run, 3)
    doomed = Learner(seed=99).states[0]
    with _subscriber(kafka, unique_run) as live:
        pub.publish_version(learner.states[0], 0)
        pub.publish_version(learner.step(), 1)
        live.wait_for(1, timeout=20)
        with pytest.raises(_Abandoned), pub.producer.transaction():
            pub.publish(doomed, 2)  # its chunks are written and acknowledged here
            raise _Abandoned  # the manifest's transaction aborts
        pub.rollback()
        orphans = _orphans(kafka, unique_run)
        assert orphans and {c["version"] for _, _, c in orphans} == {2}
        live.poll(2.0)
        _assert_on(live, learner, 1)  # nothing to apply: no manifest names the orphans
        for v in range(2, 9):  # keyframes at 3 and 6
            pub.publish_version(learner.step(), v)
        live.wait_for(8, timeout=30)
        _assert_on(live, learner, 8)
        steps = [step for r in live.reports for step in r.steps]
        assert steps == [(0, "keyframe")] + [(v, "delta") for v in range(1, 9)], steps
        assert not live.failures, live.failures
    assert codec.state_hash(doomed) not in {m["state_hash"] for m in read_manifests(kafka, unique_run, MODEL)}  # fmt: skip

    low = prune(admin_client(kafka), read_manifests(kafka, unique_run, MODEL), keep_keyframes=2)
    topic = topics.topic_name(unique_run, "weights.chunks")
    for p, offset, _ in orphans:
        assert offset < low.get((topic, p), 0), f"orphan at {p}/{offset} kept; cuts {low}"
    assert not _orphans(kafka, unique_run), "orphans left after the prune"
    assert {c["version"] for _, _, c in _chunks(kafka, unique_run)} == set(range(3, 9))
    with _subscriber(kafka, unique_run) as late:
        late.poll(10)
        _assert_on(late, learner, 8)
        assert late.reports[-1].steps[0] == (6, "keyframe")


def test_a_fenced_publisher_leaves_orphan_chunks_but_never_a_manifest(kafka, unique_run):
    """A zombie learner (its transactional id taken over by a restarted one) still writes its
    chunks, which are not transactional; its manifest's transaction is fenced, so the version
    never exists for any reader, and the new learner's versions apply bit-exact."""
    _make_topics(kafka, unique_run)
    learner = Learner(seed=23)
    zombie = _publisher(kafka, unique_run, 4, epoch=1)
    zombie.publish_version(learner.states[0], 0)
    zombie.publish_version(learner.step(), 1)
    fresh = _publisher(kafka, unique_run, 4, epoch=2)  # same transactional id: fences the zombie
    fresh.resume(learner.states[1], 1, keyframe_version=0)
    stray = Learner(seed=98).states[0]
    with pytest.raises(KafkaException):
        zombie.publish_version(stray, 2)
    assert zombie.version == 1  # rolled back
    orphans = _orphans(kafka, unique_run)
    assert orphans and {c["version"] for _, _, c in orphans} == {2}
    fresh.publish_version(learner.step(), 2)
    with _subscriber(kafka, unique_run) as sub:
        sub.wait_for(2, timeout=20)
        _assert_on(sub, learner, 2)
        assert not sub.failures and not sub.refused_manifests
    manifests = read_manifests(kafka, unique_run, MODEL)
    assert [m["learner_epoch"] for m in manifests] == [1, 1, 2]
    assert codec.state_hash(stray) not in {m["state_hash"] for m in manifests}

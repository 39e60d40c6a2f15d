"""Hostile weights on a real broker: a manifest out of the model's bounds, a decode that runs out
of memory, a fenced learner's manifest and a forged version 10^12 signed with the run's key are
all refused; the subscriber keeps serving the version it has, and the refusals are counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_weights_sync import MODEL, Learner, _assert_on, _make_topics, _publish, _subscriber

from rlstream.consumers.weights.versions import VersionWatcher
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime import metrics
from rlstream.producers.weights import signing
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.producers.weights.run_keys import RunKeys, pin
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics


def _pub(kafka: KafkaSettings, run: str, txn: str, **kw: Any) -> WeightPublisher:
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.{txn}", timeout=30)
    return WeightPublisher(producer, run, MODEL, keyframe_every=4, max_chunk_bytes=64_000, **kw)


def _refused(reason: str) -> float:
    value = metrics.REGISTRY.collectors.get_sample_value(
        "rlstream_weights_refused_total", {"model": MODEL, "reason": reason}
    )
    return value or 0.0


def test_out_of_bounds_and_out_of_memory_versions_are_refused_and_v2_keeps_serving(
    kafka: KafkaSettings, unique_run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(signing.VERIFY_KEY_ENV, raising=False)
    _make_topics(kafka, unique_run)
    pin(unique_run, RunKeys(insecure=True))  # unsigned: created insecure on purpose
    learner = Learner(seed=5)
    pub = _pub(kafka, unique_run, "learner")
    _publish(pub, learner, range(3))
    before = _refused("ManifestInvalid")
    with _subscriber(kafka, unique_run) as sub:
        sub.wait_for(2, timeout=20)  # serving v2: the model's tensors are known from here on
        # a version of another architecture (one tensor reshaped, same bytes), unsigned run
        other = {
            n: codec.TensorBits(t.dtype, (t.numel,), t.bits) if n == "head.w" else t
            for n, t in learner.step().items()
        }
        _pub(kafka, unique_run, "intruder").publish_version(other, 3)
        sub.poll(5.0)
        sub.poll(1.0)
        _assert_on(sub, learner, 2)
        assert [(f.version, f.kind) for f in sub.failures] == [(3, "keyframe")]
        assert (
            "ManifestInvalid" in sub.failures[0].reason
            and "the model's is" in sub.failures[0].reason
        )
        assert _refused("ManifestInvalid") == before + 1
        assert sub.refusal_of(3) is not None and sub.refusal_of(2) is None

        real_decode = codec.decode

        def starved(manifest: Any, chunks: Any, base: Any = None, **kw: Any) -> Any:
            if manifest["version"] == 4:
                raise MemoryError("cannot allocate")
            return real_decode(manifest, chunks, base, **kw)

        monkeypatch.setattr(codec, "decode", starved)
        learner.states.pop()  # the reshaped step was never the learner's
        pub.publish_version(learner.step(), 3)
        pub.publish_version(learner.step(), 4)
        sub.wait_for(3, timeout=20)
        sub.poll(2.0)
        _assert_on(sub, learner, 3)  # the out-of-memory version 4 refused, 3 serving
        assert any(f.version == 4 and "MemoryError" in f.reason for f in sub.failures)


def test_a_fenced_learner_and_a_signed_version_10_to_the_12_are_refused(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_topics(kafka, unique_run)
    key_file, public_hex = signing.generate(tmp_path)
    monkeypatch.setenv(signing.VERIFY_KEY_ENV, public_hex)
    signer = signing.Signer.from_file(key_file)
    learner = Learner(seed=7)
    old = _pub(kafka, unique_run, "learner-a", signer=signer, epoch=1)
    _publish(old, learner, range(3))
    new = _pub(kafka, unique_run, "learner-b", signer=signer, epoch=2)  # the restarted learner
    new.resume(learner.states[2], 2, keyframe_version=0)
    real = new.publish_version(learner.step(), 3)
    zombie_state = {
        n: codec.TensorBits(t.dtype, t.shape, t.bits ^ np.uint16(1))
        for n, t in learner.states[3].items()
    }
    old.publish_version(zombie_state, 4)  # a fenced incarnation writing: delta and keyframe
    forged = {**real, "version": 10**12, "base_version": 3}
    value = events.serializer("weight_manifest")(forged, None)
    topic = topics.topic_name(unique_run, "weights.manifests")
    with EventProducer.connect(kafka) as producer:
        producer.produce_raw(topic, value, MODEL, signer.headers(value))  # the key leaked
    epochs, versions = _refused("epoch"), _refused("version")
    with _subscriber(kafka, unique_run) as sub:
        sub.wait_for(3, timeout=20)
        sub.poll(2.0)
        _assert_on(sub, learner, 3)
        reasons = [why for _, _, why in sub.refused_manifests]
        assert len(reasons) == 3, reasons  # the zombie's delta and keyframe, then the forgery
        assert all("epoch 1 is older than epoch 2" in why for why in reasons[:2])
        assert "jumps" in reasons[2]
        assert sub.newest_known() == 3
    assert _refused("epoch") == epochs + 2 and _refused("version") == versions + 1
    watcher = VersionWatcher(kafka, topic, MODEL)
    try:
        assert watcher.version == 3  # admission's view is not pinned either
    finally:
        watcher.close()

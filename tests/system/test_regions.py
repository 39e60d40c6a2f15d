"""Geo-replication on real brokers and MirrorMaker 2: only committed data crosses regions.

In the trainer region a weight publish is aborted between two committed ones; in a rollout
region a rollout transaction is aborted between two committed ones. MirrorMaker 2 (flows derived
from the catalog, reading ``read_committed``, writing with exactly-once support) carries the
rest: the rollout region's weight subscriber, reading the mirrored names, applies exactly the
committed versions bit-exactly, and neither the aborted manifest nor the aborted trajectory
exists in the other region's copy, even read ``read_uncommitted``. The aborted publish's chunks
were written outside its transaction (``producers.weights.publisher``): they are orphans, and they
cross like every chunk, named by no manifest on either side and applied by no subscriber.
"""

from __future__ import annotations

import time

import pytest
from helpers import read_all, signed_run
from test_events import examples
from test_weights_sync import CHUNK, MODEL, Learner

from rlstream.consumers.weights.subscriber import WeightSubscriber
from rlstream.ops import cluster
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.producers.weights.signing import Verifier
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics

pytestmark = pytest.mark.slow
REGIONS = topics.Regions("trainer", ("eu", "us"))


class _Abandoned(Exception):
    """Raised inside a transaction to abort it."""


def _settings(geo, region: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=geo.bootstrap(region))


def _records(settings: KafkaSettings, topic: str, committed_only: bool) -> list[dict]:
    return [events.decode(v).record for _, v, _ in read_all(settings, topic, committed_only, 10)]


def _wait_for(predicate, timeout: float, what: str, geo=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}" + (_mirror_trouble(geo) if geo else ""))


def _mirror_trouble(geo) -> str:
    """The eu link's last warnings and errors, so that a link that stopped copying says why."""
    said = ""
    for link in cluster.load(geo.home).link_mirrors("eu"):
        lines = link.log.read_text(errors="replace").splitlines() if link.log.exists() else []
        trouble = [line for line in lines if " ERROR " in line or " WARN " in line][-20:]
        said += f"; last warnings of {link.log}:\n" + "\n".join(trouble)
    return said


def test_only_committed_weights_and_trajectories_cross_regions(geo, unique_run):
    run = unique_run
    home, eu = _settings(geo, "trainer"), _settings(geo, "eu")
    for name in REGIONS.names:
        ensure_run_topics(_settings(geo, name), run, regions=REGIONS, here=name)

    # trainer region: v0 committed, v1 aborted after its chunks (outside the transaction) and
    # its manifest (inside) were written, v1 committed again from another state
    learner = Learner(seed=3)
    producer = EventProducer.transactional(home, f"rlstream.{run}.learner", timeout=30)
    signer = signed_run(home, run)  # the run is signed from its creation
    pub = WeightPublisher(
        producer, run, MODEL, keyframe_every=4, max_chunk_bytes=CHUNK, signer=signer
    )
    pub.publish_version(learner.states[0], 0)
    doomed = learner.step()
    with pytest.raises(_Abandoned), producer.transaction():
        pub.publish(doomed, 1)
        producer.flush()
        raise _Abandoned
    pub.rollback()
    kept = learner.step()
    pub.publish_version(kept, 1)

    # rollout region: a rollout transaction aborted between two committed ones
    traj = {**examples()["trajectory"], "run": run, "region": "eu"}
    rollout = EventProducer.transactional(eu, f"rlstream.{run}.rollout.eu.0", timeout=30)
    out = topics.topic_name(run, "trajectories")
    for group, commit in (("g-kept-1", True), ("g-aborted", False), ("g-kept-2", True)):
        try:
            with rollout.transaction():
                rollout.produce(out, "trajectory", {**traj, "group_id": group}, group)
                rollout.flush()
                if not commit:
                    raise _Abandoned
        except _Abandoned:
            pass

    source = REGIONS.sources("weights.manifests", "eu")[0]
    key = Verifier.from_hex(signer.public_hex)  # a rollout region is given the run's key
    with WeightSubscriber(eu, run, MODEL, source=source, fetch_timeout=30, verifier=key) as sub:
        assert sub.manifest_topic == f"trainer.{topics.topic_name(run, 'weights.manifests')}"
        got = sub.wait_for(1, timeout=120)
        assert got is not None and got.version == 1, "eu never got version 1 through MirrorMaker"
        assert codec.state_hash(got.state) == codec.state_hash(kept), "eu applied another state"
        assert not sub.failures, sub.failures
        assert all("MissingChunk" in d.reason for d in sub.deferred), sub.deferred

    mirrored = REGIONS.topic(run, "weights.manifests", "eu")
    every = _records(eu, mirrored, committed_only=False)
    assert sorted((m["version"], m["kind"]) for m in every) == [
        (0, "keyframe"),
        (1, "delta"),
    ], "an aborted manifest crossed"
    aborted_hash = codec.state_hash(doomed)
    assert aborted_hash not in {m["state_hash"] for m in every}
    home_chunks = _records(home, topics.topic_name(run, "weights.chunks"), committed_only=True)
    named = {
        (m["version"], c["index"], c["checksum"])
        for m in _records(home, topics.topic_name(run, "weights.manifests"), committed_only=True)
        for c in m["chunks"]
    }
    written = sorted((c["version"], c["index"], c["checksum"]) for c in home_chunks)
    orphans = [c for c in written if c not in named]
    assert orphans and {v for v, _, _ in orphans} == {1}, "the aborted publish left no chunks"

    def chunks_crossed() -> bool:
        eu_chunks = _records(eu, REGIONS.topic(run, "weights.chunks", "eu"), committed_only=False)
        return sorted((c["version"], c["index"], c["checksum"]) for c in eu_chunks) == written

    # every chunk record crosses, the orphans too: the chunk topic holds no transactions
    _wait_for(chunks_crossed, 60, "the mirrored chunks to be exactly the trainer region's", geo)

    home_copy = topics.remote_topic("eu", out)

    def arrived() -> bool:
        return len(_records(home, home_copy, committed_only=True)) >= 2

    _wait_for(arrived, 90, "the committed trajectories to reach the trainer region", geo)
    groups = [t["group_id"] for t in _records(home, home_copy, committed_only=False)]
    assert sorted(groups) == ["g-kept-1", "g-kept-2"], f"copied: {groups}"

"""Weight sync on a real broker: a publisher writes versions as chunks (acknowledged first,
outside any transaction) + a manifest (in a Kafka transaction); subscribers follow live, join
late, ignore the orphan chunks of an aborted publish, refuse corrupt data, survive SIGKILL and
keep working after retention pruned old chunks, always ending bit-exact on the newest version.

Run as a script (``python test_weights_sync.py worker ...``) this file is the subscriber
process that the SIGKILL test kills mid-apply.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import chunk_filter_publisher, read_all, signed_run

from rlstream.consumers.weights.manifest_log import read_manifests
from rlstream.consumers.weights.subscriber import Snapshot, WeightSubscriber
from rlstream.consumers.weights.versions import VersionWatcher
from rlstream.producers.client.admin import admin_client, apply_topics, run_topic_wants
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights import signing
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.producers.weights.retention import prune
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events, topics

MODEL = "policy"
CHUNK = 64_000  # small chunks so that a ~1.5 MB model spreads over many records/partitions
SHAPES = {"layers.0.w": (256, 1024), "layers.0.norm": (1024,), "head.w": (512, 512)}


class Learner:
    """fp32 master weights, an Adam-like update per step, bf16 bit patterns published."""

    def __init__(self, seed: int = 0, lr: float = 2e-5) -> None:
        self.rng = np.random.default_rng(seed)
        self.lr = np.float32(lr)
        self.master = {
            n: self.rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
            for n, s in SHAPES.items()
        }
        self.states: list[dict[str, codec.TensorBits]] = [self._bf16()]

    def _bf16(self) -> dict[str, codec.TensorBits]:
        out = {}
        for name, w in self.master.items():
            u = w.reshape(-1).view(np.uint32)
            bits = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
            out[name] = codec.TensorBits("bfloat16", w.shape, bits)
        return out

    def step(self) -> dict[str, codec.TensorBits]:
        for w in self.master.values():
            w += self.lr * self.rng.standard_normal(w.shape, dtype=np.float32)
        self.states.append(self._bf16())
        return self.states[-1]


def _make_topics(kafka: KafkaSettings, run: str) -> None:
    wanted = {topics.topic_name(run, s) for s in ("weights.manifests", "weights.chunks")}
    apply_topics(admin_client(kafka), [w for w in run_topic_wants(run) if w.name in wanted])


class _Abandoned(Exception):
    """Raised inside a transaction to abort it."""


def _publisher(kafka: KafkaSettings, run: str, k: int, **kw: Any) -> WeightPublisher:
    if "signer" not in kw:  # the run is signed from its creation
        kw["signer"] = signed_run(kafka, run)
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner", timeout=30)
    on_chunk = kw.pop("on_chunk", None)
    cls = WeightPublisher if on_chunk is None else chunk_filter_publisher(WeightPublisher, on_chunk)
    return cls(producer, run, MODEL, keyframe_every=k, max_chunk_bytes=CHUNK, **kw)


def _publish(pub: WeightPublisher, learner: Learner, versions: range) -> None:
    for v in versions:
        state = learner.states[0] if v == 0 else learner.step()
        pub.publish_version(state, v, stats={"loss": 1.0 / (v + 1)})


def _subscriber(kafka: KafkaSettings, run: str, **kw: Any) -> WeightSubscriber:
    return WeightSubscriber(kafka, run, MODEL, fetch_timeout=10.0, **kw)


def _fresh_hash(state: dict[str, codec.TensorBits]) -> str:
    """State hash recomputed from the bits (decode caches the manifest's hashes)."""
    return codec.state_hash(
        {n: codec.TensorBits(t.dtype, t.shape, t.bits.copy()) for n, t in state.items()}
    )


def _assert_on(sub: WeightSubscriber, learner: Learner, version: int) -> None:
    snap = sub.current()
    assert snap is not None and snap.version == version, f"on {sub.version}, want {version}"
    assert codec.same_state(snap.state, learner.states[version]), "not bit-exact"
    assert list(snap.state) == list(SHAPES), "state-dict order lost"


def test_live_follower_crosses_a_keyframe_on_deltas_and_ends_bit_exact(kafka, unique_run):
    _make_topics(kafka, unique_run)
    learner, pub = Learner(), _publisher(kafka, unique_run, k=3)
    swaps: list[int] = []
    with _subscriber(kafka, unique_run, on_swap=lambda s: swaps.append(s.version)) as sub:
        for v in range(6):
            _publish(pub, learner, range(v, v + 1))
            assert sub.wait_for(v, timeout=20) is not None
            _assert_on(sub, learner, v)
        steps = [r.steps for r in sub.reports]
    assert swaps == list(range(6))
    assert steps[0] == ((0, "keyframe"),)
    assert steps[1:] == [((v, "delta"),) for v in range(1, 6)]  # 3 came as a delta too
    keyframe_bytes = sub.reports[0].bytes_fetched
    assert all(r.bytes_fetched < keyframe_bytes / 4 for r in list(sub.reports)[1:])
    manifests = read_manifests(kafka, unique_run, MODEL)
    kinds = [(m["version"], m["kind"]) for m in manifests]
    assert kinds == [(0, "keyframe"), (1, "delta"), (2, "delta"), (3, "delta"), (3, "keyframe"), (4, "delta"), (5, "delta")]  # fmt: skip
    assert {m["keyframe_version"] for m in manifests if m["version"] >= 3} == {3}


def test_late_joiner_bootstraps_from_the_newest_keyframe(kafka, unique_run):
    _make_topics(kafka, unique_run)
    learner, pub = Learner(seed=1), _publisher(kafka, unique_run, k=3, epoch=4)
    _publish(pub, learner, range(6))
    with _subscriber(kafka, unique_run) as sub:
        applied = sub.poll(10)
        assert [a.steps for a in applied] == [((3, "keyframe"), (4, "delta"), (5, "delta"))]
        _assert_on(sub, learner, 5)
        assert (sub.epoch_of(5), sub.epoch_of(4)) == (4, 0)  # the epoch trajectories of 5 carry
        report = applied[0]
        assert report.bytes_fetched > 0
        assert report.apply_s >= report.fetch_s + report.decode_s - 1e-6
    with _subscriber(kafka, unique_run) as background:  # the rollout worker's mode
        background.start(interval=0.1)
        deadline = time.monotonic() + 15
        while (background.version or -1) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        background.stop()
        _assert_on(background, learner, 5)


def test_an_aborted_publish_is_invisible_and_rollback_rebases_the_next_delta(kafka, unique_run):
    _make_topics(kafka, unique_run)
    learner, pub = Learner(seed=5), _publisher(kafka, unique_run, k=4)
    _publish(pub, learner, range(2))
    doomed = Learner(seed=99).states[0]
    with pytest.raises(_Abandoned), pub.producer.transaction(30):
        pub.publish(doomed, 2)  # a version that never commits: its chunks are written now
        raise _Abandoned  # the manifest's transaction aborts
    pub.rollback()
    chunk_topic = topics.topic_name(unique_run, "weights.chunks")
    written = {events.decode(v).record["version"] for _, v, _ in read_all(kafka, chunk_topic)}
    assert written == {0, 1, 2}  # the orphans of 2: a read_committed reader sees them
    _publish(pub, learner, range(2, 4))
    manifests = read_manifests(kafka, unique_run, MODEL)
    assert [m["version"] for m in manifests] == [0, 1, 2, 3]
    assert codec.state_hash(doomed) not in {m["state_hash"] for m in manifests}
    with _subscriber(kafka, unique_run) as sub:
        sub.wait_for(3, timeout=20)
        _assert_on(sub, learner, 3)
        steps = [r.steps for r in sub.reports]
        assert steps == [((0, "keyframe"), (1, "delta"), (2, "delta"), (3, "delta"))]
        assert not sub.failures


def test_corrupt_chunk_is_refused_then_the_next_keyframe_recovers(kafka, unique_run):
    _make_topics(kafka, unique_run)

    def corrupt(version: int, kind: str, index: int, payload: bytes) -> bytes:
        if (version, kind, index) != (4, "delta", 0):
            return payload
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0x40
        return bytes(bad)

    learner, pub = Learner(seed=2), _publisher(kafka, unique_run, k=3, on_chunk=corrupt)
    with _subscriber(kafka, unique_run) as sub:
        _publish(pub, learner, range(4))
        sub.wait_for(3, timeout=20)
        _assert_on(sub, learner, 3)
        _publish(pub, learner, range(4, 6))  # 4 is corrupt, 5 is a delta on 4
        deadline = time.monotonic() + 5
        while sub.newest_known() != 5 and time.monotonic() < deadline:
            sub.poll(0.5)
        sub.poll(0.5)
        _assert_on(sub, learner, 3)  # still serving the old version, complete
        assert [(f.version, f.kind) for f in sub.failures] == [(4, "delta")]
        assert "ChunkCorrupt" in sub.failures[0].reason
        _publish(pub, learner, range(6, 7))  # keyframe 6 (and a delta on 5)
        sub.wait_for(6, timeout=20)
        _assert_on(sub, learner, 6)
        assert sub.reports[-1].steps == ((6, "keyframe"),)


@pytest.mark.unsecured_only("its worker process is given a bare bootstrap address, no credentials")
def test_subscriber_killed_mid_apply_restarts_onto_the_newest_version(kafka, unique_run):
    _make_topics(kafka, unique_run)
    learner, pub = Learner(seed=3), _publisher(kafka, unique_run, k=3)
    _publish(pub, learner, range(3))
    first = _worker(kafka, unique_run, until=2, slow=5.0)
    _read_until(first, "log weights: applying", timeout=20)  # inside the route, mid-apply
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    _publish(pub, learner, range(3, 5))
    second = _worker(kafka, unique_run, until=4, slow=0.0)
    line = _read_until(second, "applied 4 ", timeout=25)
    assert line.split()[2] == codec.state_hash(learner.states[4])
    assert second.wait(10) == 0


def test_prune_keeps_the_chain_reachable_and_drops_older_chunks(kafka, unique_run):
    _make_topics(kafka, unique_run)
    learner, pub = Learner(seed=4), _publisher(kafka, unique_run, k=3)
    _publish(pub, learner, range(9))  # keyframes at 0, 3, 6
    history = read_manifests(kafka, unique_run, MODEL)
    low = prune(admin_client(kafka), history, keep_keyframes=2)
    assert low, "nothing was pruned"
    for m in history:
        for c in m["chunks"]:
            gone = c["ref"]["offset"] < low.get((c["ref"]["topic"], c["ref"]["partition"]), 0)
            assert gone == (m["version"] < 3), (m["version"], m["kind"], c["ref"])
    assert len(read_manifests(kafka, unique_run, MODEL)) == len(history)  # manifests stay
    with _subscriber(kafka, unique_run) as fresh:
        fresh.poll(10)
        _assert_on(fresh, learner, 8)
        assert fresh.reports[-1].steps[0] == (6, "keyframe")
    seeded = Snapshot(3, learner.states[3])  # a worker mid-catch-up from keyframe 3
    with _subscriber(kafka, unique_run, initial=seeded) as sub:
        sub.poll(10)
        _assert_on(sub, learner, 8)
        assert sub.reports[-1].steps == tuple((v, "delta") for v in range(4, 9))
    stale = Snapshot(1, learner.states[1])  # its deltas 2.. were pruned: recovers via keyframe
    with _subscriber(kafka, unique_run, initial=stale) as sub:
        sub.wait_for(8, timeout=25)
        _assert_on(sub, learner, 8)
        assert sub.failures and sub.failures[0].version == 2


# --- the worker process ----------------------------------------------------------------------


def _worker(kafka: KafkaSettings, run: str, until: int, slow: float) -> subprocess.Popen:
    args = [sys.executable, __file__, "worker", kafka.bootstrap_servers, run, str(until), str(slow)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
    _read_until(proc, "ready", timeout=20)
    return proc


def _read_until(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.strip())
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"no {prefix!r} from the worker; it said {seen[-10:]}")


class _Echo(logging.Handler):
    """Prints the subscriber's log lines; with ``slow`` it lingers in every apply step."""

    def __init__(self, slow: float) -> None:
        super().__init__()
        self.slow = slow

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        print(f"log {message}", flush=True)
        if self.slow and message.startswith("weights: applying"):
            time.sleep(self.slow)


def _worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for name in ("bootstrap", "run"):
        p.add_argument(name)
    p.add_argument("until", type=int)
    p.add_argument("slow", type=float)
    args = p.parse_args(argv)
    logger = logging.getLogger("rlstream.consumers.weights.subscriber")
    logger.setLevel(logging.INFO)
    logger.addHandler(_Echo(args.slow))
    settings = KafkaSettings(bootstrap_servers=args.bootstrap)
    with WeightSubscriber(settings, args.run, MODEL) as sub:
        print("ready", flush=True)
        while True:
            for applied in sub.poll(0.5):
                snap = sub.current()
                assert snap is not None
                print(f"applied {applied.version} {_fresh_hash(snap.state)}", flush=True)
                if applied.version >= args.until:
                    return


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker_main(sys.argv[2:])


def test_forged_manifests_are_refused_and_the_old_weights_keep_serving(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed by the run's key, versions apply; a manifest that is unsigned, signed by another
    key, or altered is refused before it is decoded (a forged version 10^12 pins nothing)."""
    _make_topics(kafka, unique_run)
    key_file, public_hex = signing.generate(tmp_path)
    monkeypatch.setenv(signing.VERIFY_KEY_ENV, public_hex)
    learner = Learner(seed=11)
    pub = _publisher(kafka, unique_run, k=4, signer=signing.Signer.from_file(key_file))
    _publish(pub, learner, range(3))
    real = pub.publish_version(learner.step(), 3)
    forged = {**real, "version": 10**12, "base_version": 3}
    value = events.serializer("weight_manifest")(forged, None)
    intruder = signing.Signer.from_file(signing.generate(tmp_path / "other")[0])
    topic = topics.topic_name(unique_run, "weights.manifests")
    altered = bytearray(value)
    altered[-1] ^= 1  # a bit flipped after signing
    with EventProducer.connect(kafka) as producer:
        producer.produce_raw(topic, value, MODEL)  # unsigned
        producer.produce_raw(topic, value, MODEL, intruder.headers(value))  # another key
        producer.produce_raw(topic, bytes(altered), MODEL, pub.signer.headers(value))
    with _subscriber(kafka, unique_run) as sub:
        sub.wait_for(3, timeout=20)
        sub.poll(2.0)
        _assert_on(sub, learner, 3)
        reasons = [why for _, _, why in sub.refused_manifests]
        assert len(reasons) == 3 and "unsigned" in reasons[0] and "not the run's key" in reasons[1]
        assert "bad signature" in reasons[2]
        assert sub.newest_known() == 3
    watcher = VersionWatcher(kafka, topic, MODEL)
    try:
        assert watcher.version == 3
    finally:
        watcher.close()


def test_a_version_whose_chunks_never_cross_is_skipped_and_the_lag_reported(
    kafka: KafkaSettings, unique_run: str
) -> None:
    """A rollout region's copy holds the manifests but a mirror holds the chunks back: each
    version is deferred, then refused for good once ``crossing_timeout_s`` passed (a region is
    never kept retrying one version), and the region reports how far behind it is."""
    from helpers import make_topics

    from rlstream.producers.runtime.metrics import REGISTRY

    run = unique_run
    _make_topics(kafka, run)
    pub = _publisher(kafka, run, k=2)
    _publish(pub, Learner(seed=5), range(3))
    home = topics.topic_name(run, "weights.manifests")
    copy = topics.remote_topic("trainer", home)
    make_topics(
        kafka, copy, topics.remote_topic("trainer", topics.topic_name(run, "weights.chunks"))
    )
    with EventProducer.connect(kafka) as producer:  # the manifests cross, the chunks never do
        for key, value, msg in read_all(kafka, home):
            producer.produce_raw(copy, value, key, msg.headers())
    key = signing.Verifier.from_hex(signed_run(kafka, run).public_hex)
    with _subscriber(kafka, run, source="trainer", verifier=key, crossing_timeout_s=1.0) as sub:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len(sub.failures) < 2:
            sub.poll(1.0)
        assert sub.version is None and sub.newest_known() == 2
        assert sub.deferred and all("MissingChunk" in d.reason for d in sub.deferred)
        late = [f for f in sub.failures if "ChunksLate" in f.reason]
        assert {f.version for f in late} == {0, 2}, sub.failures  # the keyframes (k=2) it tried
        assert sub.freshness_lag() == 3
    gauge = "rlstream_weights_freshness_lag_versions"
    assert f'{gauge}{{model="{MODEL}"}} 3.0' in REGISTRY.exposition()

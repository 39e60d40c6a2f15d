"""Fail-closed weights on a real broker: a run is signed from its creation, and a reader with no
key given refuses what the run's key did not sign; the attacks of ``ops.faults.attack_weights``
(unsigned, another key, an epoch jump, a replayed manifest, a non-cryptographic hash, a forged
trust anchor in ``rl.runs``) are each
refused and counted while the subscriber keeps serving, and goes on to the next real version;
a run with no key accepts nothing; old (xxh3, unsigned) logs still replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import run_key_file, signed_run
from test_weights_hostile import _refused
from test_weights_sync import MODEL, Learner, _assert_on, _make_topics, _publish, _publisher

from rlstream.consumers.weights.manifest_log import ManifestLog, manifests_by_version
from rlstream.consumers.weights.subscriber import WeightSubscriber
from rlstream.consumers.weights.trust import run_trust
from rlstream.ops.chaos.faults import attack_tally, attack_weights
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights import signing
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.schemas import topics


@pytest.fixture(autouse=True)
def _no_key_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers get no key from their environment: only what this host pins."""
    monkeypatch.delenv(signing.VERIFY_KEY_ENV, raising=False)
    monkeypatch.delenv(signing.SIGNING_KEY_ENV, raising=False)


def _sub(kafka: KafkaSettings, run: str) -> WeightSubscriber:
    return WeightSubscriber(kafka, run, MODEL, fetch_timeout=10.0)


def _intruder(kafka: KafkaSettings, run: str, **kw: Any) -> WeightPublisher:
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.intruder", timeout=30)
    return WeightPublisher(producer, run, MODEL, keyframe_every=4, max_chunk_bytes=64_000, **kw)


def test_a_run_is_signed_from_its_creation_and_readers_verify_with_its_pinned_key(
    kafka: KafkaSettings, unique_run: str
) -> None:
    _make_topics(kafka, unique_run)
    signer = signed_run(kafka, unique_run)
    trust = run_trust(topics.topic_name(unique_run, "weights.manifests"))
    assert trust.verifier is not None and trust.verifier.key_id == signer.key_id
    assert "pinned on this host" in trust.source
    mirrored = topics.remote_topic("trainer", topics.topic_name(unique_run, "weights.manifests"))
    assert run_trust(mirrored).verifier.key_id == signer.key_id  # the pin holds in any region


def test_unsigned_and_foreign_key_manifests_are_refused_in_a_run_not_created_insecure(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path
) -> None:
    _make_topics(kafka, unique_run)
    learner = Learner(seed=31)
    _publish(_publisher(kafka, unique_run, k=4), learner, range(3))  # signed with the run's key
    before = _refused("signature")
    with _sub(kafka, unique_run) as sub:
        sub.wait_for(2, timeout=30)
        _assert_on(sub, learner, 2)
        _intruder(kafka, unique_run).publish_version(learner.step(), 3)  # unsigned
        other = signing.Signer.from_file(signing.generate(tmp_path)[0])
        learner.states.pop()
        _intruder(kafka, unique_run, signer=other).publish_version(learner.step(), 3)
        sub.poll(5.0)
        sub.poll(1.0)
        _assert_on(sub, learner, 2)  # the old weights keep serving
        reasons = [why for _, _, why in sub.refused_manifests]
        assert any("unsigned manifest" in r for r in reasons), reasons
        assert any("not the run's key" in r for r in reasons), reasons
        assert sub.newest_known() == 2
    assert _refused("signature") >= before + 2  # each intruder (no earlier version) a keyframe


def test_a_run_with_no_key_recorded_accepts_nothing(kafka: KafkaSettings, unique_run: str) -> None:
    """No key recorded, none given, not created insecure: every manifest is held, none taken."""
    _make_topics(kafka, unique_run)
    learner = Learner(seed=32)
    _publish(_intruder(kafka, unique_run), learner, range(2))  # unsigned
    with _sub(kafka, unique_run) as sub:
        assert sub.wait_for(0, timeout=5) is None
        assert sub.newest_known() is None and sub._manifests.held
    with ManifestLog.of_run(kafka, unique_run, MODEL) as log:
        log.catch_up(30)
        assert len(log) == 0 and not log.trust.known


def test_every_attack_on_a_live_run_is_refused_and_the_next_real_version_applies(
    kafka: KafkaSettings, unique_run: str
) -> None:
    """``attack_weights`` against a live signed run (the run's key leaked for the attacks that
    need a good signature): each attack refused by the subscriber, counted by kind, the old
    weights served meanwhile, and the learner's next version applied after them."""
    _make_topics(kafka, unique_run)
    learner = Learner(seed=33)
    pub = _publisher(kafka, unique_run, k=4)
    _publish(pub, learner, range(3))
    key_file = run_key_file(unique_run)
    with _sub(kafka, unique_run) as sub:
        sub.wait_for(2, timeout=30)
        landed = attack_weights(kafka, unique_run, MODEL, key_file)
        sub.poll(5.0)
        sub.poll(1.0)
        _assert_on(sub, learner, 2)
        refused = {offset for _, offset, _ in sub.refused_manifests}
        tally = attack_tally(landed, refused)
        kinds = (
            *("unsigned_manifest", "wrong_key", "version_jump", "epoch_jump"),
            *("replayed_manifest", "weak_hash", "mirrored_trust_anchor"),
        )
        assert tally == {k: {"tried": 1, "refused": 1} for k in kinds}, tally
        # a reader started after rl.runs was forged still trusts the pinned key alone
        trust = run_trust(topics.topic_name(unique_run, "weights.manifests"))
        assert trust.verifier is not None and not trust.insecure
        assert trust.verifier.key_id == signing.Signer.from_file(key_file).key_id
        pub.publish_version(learner.step(), 3)  # the real learner goes on
        sub.wait_for(3, timeout=30)
        _assert_on(sub, learner, 3)
        assert not sub.failures


def test_old_xxh3_unsigned_logs_replay_but_a_live_signed_reader_refuses_xxh3(
    kafka: KafkaSettings, unique_run: str
) -> None:
    _make_topics(kafka, unique_run)
    learner = Learner(seed=34)
    old = _intruder(kafka, unique_run, hash_algorithm="xxh3_128")  # as code before BLAKE3 wrote
    _publish(old, learner, range(3))
    replayed = manifests_by_version(kafka, unique_run, MODEL, audit=True)
    assert sorted(replayed) == [0, 1, 2]
    assert {m["hash_algorithm"] for m in replayed.values()} == {"xxh3_128"}
    assert manifests_by_version(kafka, unique_run, MODEL) == {}  # a live reader: no key, nothing
    signer = signed_run(kafka, unique_run)  # now signed: its xxh3 manifests are refused
    weak = _intruder(kafka, unique_run, signer=signer, hash_algorithm="xxh3_128")
    weak.resume(learner.states[2], 2, keyframe_version=0)
    weak.publish_version(learner.step(), 3)
    with ManifestLog.of_run(kafka, unique_run, MODEL) as log:
        log.catch_up(30)
        reasons = [why for _, _, why in log.refused]
        assert len(log) == 0 and any("not cryptographic" in r for r in reasons), reasons


def test_a_replay_takes_no_weak_hash_once_the_log_used_a_cryptographic_one(
    kafka: KafkaSettings, unique_run: str
) -> None:
    """A replay tolerates legacy hashes for logs written before BLAKE3, not a manifest of the
    run's own key with a weak hash in a log that already used BLAKE3 (a leaked key's forgery:
    bench chaos's ``weak_hash``, which the replay of a chaos run took as a version of its own)."""
    _make_topics(kafka, unique_run)
    signer = signed_run(kafka, unique_run)
    learner = Learner(seed=36)
    _publish(_intruder(kafka, unique_run, signer=signer), learner, range(3))
    weak = _intruder(kafka, unique_run, signer=signer, hash_algorithm="xxh3_128")
    weak.resume(learner.states[2], 2, keyframe_version=0)
    weak.publish_version(learner.step(), 3)
    assert sorted(manifests_by_version(kafka, unique_run, MODEL, audit=True)) == [0, 1, 2]


def test_crafted_chunks_under_a_good_signature_are_refused_and_the_old_weights_keep_serving(
    kafka: KafkaSettings, unique_run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner's key leaked: version 3 published again and again (each time by a newer
    learner epoch) with chunks crafted as ``test_weights_crafted`` crafts them (fields at edge
    values, bytes flipped, streams cut or grown) and vouched for by a signed manifest of
    matching checksums, so that they reach the decoders: each is refused, and the subscriber
    keeps serving version 2 bit for bit; then the genuine version 3 applies."""
    import numpy as np
    from test_weights_crafted import CRAFTS, _vouched

    from rlstream.schemas import deltacodec as codec

    _make_topics(kafka, unique_run)
    learner = Learner(seed=35)
    pub = _publisher(kafka, unique_run, k=100)
    _publish(pub, learner, range(3))
    target = learner.step()
    rng = np.random.default_rng(35)
    real_encode = pub._encode

    def crafted(kind: str, state: Any, version: int) -> codec.Encoded:
        enc = real_encode(kind, state, version)
        chunks = list(enc.chunks)
        i = int(rng.integers(0, len(chunks)))
        chunks[i] = CRAFTS[int(rng.integers(0, len(CRAFTS)))](rng, chunks[i])
        return codec.Encoded(_vouched(enc.manifest, chunks), chunks)

    with _sub(kafka, unique_run) as sub:
        sub.wait_for(2, timeout=30)
        monkeypatch.setattr(pub, "_encode", crafted)
        for epoch in range(6):
            pub.resume(learner.states[2], 2, keyframe_version=0)
            pub.epoch = epoch
            pub.publish_version(target, 3)
            sub.poll(3.0)
            sub.poll(0.5)
            if sub.version == 3:  # a corruption that changed nothing decoded: still bit-exact
                break
            _assert_on(sub, learner, 2)
        refusals = [f.reason for f in sub.failures if f.version == 3]
        assert refusals and all(
            r.split(":")[0] in ("ChunkCorrupt", "HashMismatch", "ManifestInvalid") for r in refusals
        ), refusals
        monkeypatch.undo()
        pub.resume(learner.states[2], 2, keyframe_version=0)
        pub.epoch = 6
        pub.publish_version(target, 3)  # the genuine version 3
        sub.wait_for(3, timeout=30)
        _assert_on(sub, learner, 3)


def test_manifests_read_before_the_runs_key_is_pinned_are_held_not_lost(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path
) -> None:
    """A reader started before the run's key is known here holds the records it reads (neither
    kept nor refused), though the run manifest records the key: a record is no trust anchor.
    Once the key is pinned it reads them again and applies them."""
    from rlstream.consumers.weights.trust import record_weight_fields
    from rlstream.producers.weights.run_keys import RunKeys, pin

    _make_topics(kafka, unique_run)
    signer = signing.Signer.from_file(signing.generate(tmp_path)[0])
    learner = Learner(seed=36)
    _publish(_publisher(kafka, unique_run, k=4, signer=signer), learner, range(2))
    record_weight_fields(kafka, unique_run, public_hex=signer.public_hex)
    with _sub(kafka, unique_run) as sub:
        sub.poll(3.0)
        assert sub.version is None and sub._manifests.held and not sub.refused_manifests
        pin(unique_run, RunKeys(signer.public_hex))
        sub.wait_for(1, timeout=30)
        _assert_on(sub, learner, 1)
        assert not sub.refused_manifests and not sub.failures


@pytest.mark.parametrize("where", ["home", "mirrored"])
def test_a_runs_record_is_no_trust_anchor(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path, where: str
) -> None:
    """Whoever can write rl.runs (on the home cluster, or MirrorMaker's copy in a rollout
    region) could write a record naming their own key, or marking the run insecure: neither is
    read; a reader trusts only the key it is given or that this host pins."""
    from helpers import make_topics

    copy = (
        topics.RUNS_TOPIC if where == "home" else topics.remote_topic("trainer", topics.RUNS_TOPIC)
    )
    make_topics(kafka, copy, partitions=1)
    theirs = signing.Signer.from_file(signing.generate(tmp_path)[0])
    record = {
        "run": unique_run, "created_ms": 1, "updated_ms": 1, "status": "created",
        "config_json": "{}", "seeds": {}, "code_version": "x", "model": "", "start_offsets": [],
        "topics": [], "description": "forged", "weights_public_key": theirs.public_hex,
        "weights_insecure": True,
    }  # fmt: skip
    with EventProducer.connect(kafka) as producer:
        producer.produce(copy, "run_manifest", record, unique_run)
    manifests = topics.topic_name(unique_run, "weights.manifests")
    if where == "mirrored":
        manifests = topics.remote_topic("trainer", manifests)
    trust = run_trust(manifests)
    assert trust.verifier is None and not trust.insecure and not trust.known, trust
    assert "never trusted" in trust.source


def test_a_record_never_downgrades_a_learner_to_unsigned(
    kafka: KafkaSettings, unique_run: str
) -> None:
    """A run created with a key and later recorded insecure (a record anyone with write access
    to rl.runs could make): the learner refuses to start rather than publish unsigned."""
    from rlstream.consumers.weights.trust import ensure_run_key, record_weight_fields

    _make_topics(kafka, unique_run)
    signed_run(kafka, unique_run)
    record_weight_fields(kafka, unique_run, insecure=True)
    with pytest.raises(RuntimeError, match="recorded insecure"):
        ensure_run_key(kafka, unique_run, run_key_file(unique_run))

"""Versions tied to the learner's epoch: the rule that refuses a manifest of an older learner
incarnation or an implausible version jump, and the epoch's way from the publisher through the
Avro record (old records, written before epochs, read as epoch 0: see test_schema_compat)."""

from __future__ import annotations

import numpy as np

from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events
from rlstream.schemas.deltacodec.wire import (
    MAX_EPOCH_JUMP,
    MAX_VERSION_JUMP,
    VersionTips,
    implausible,
    manifest_record,
    replayed,
)


def test_an_older_epoch_is_refused_and_a_newer_one_takes_over() -> None:
    assert implausible(5, 1, newest=None, newest_epoch=0) is None  # the first record anchors
    assert implausible(6, 1, newest=5, newest_epoch=1) is None
    assert implausible(7, 2, newest=6, newest_epoch=1) is None  # a restarted learner
    kind, why = implausible(7, 1, newest=7, newest_epoch=2) or ("", "")
    assert kind == "epoch" and "older than epoch 2" in why
    assert implausible(3, 2, newest=7, newest_epoch=2) is None  # an old version: harmless


def test_a_version_far_beyond_the_newest_is_refused() -> None:
    kind, why = implausible(10**12, 2, newest=7, newest_epoch=2) or ("", "")
    assert kind == "version" and str(10**12) in why
    assert implausible(7 + MAX_VERSION_JUMP, 2, newest=7, newest_epoch=2) is None
    assert implausible(8 + MAX_VERSION_JUMP, 2, newest=7, newest_epoch=2) is not None
    assert implausible(10**12, 3, newest=7, newest_epoch=2) is not None  # a new epoch too


def test_the_epoch_travels_in_the_avro_record_and_defaults_to_zero() -> None:
    state = {"w": codec.TensorBits("bfloat16", (8,), np.arange(8, dtype=np.uint16))}
    enc = codec.encode_keyframe(state, version=0)
    common = {"run": "r", "model": "m", "chunk_topic": "t", "keyframe_version": 0}
    rec = manifest_record(enc.manifest, **common, created_ms=1, learner_epoch=3)
    assert events.decode(events.encode("weight_manifest", rec)).record["learner_epoch"] == 3
    assert manifest_record(enc.manifest, **common, created_ms=1)["learner_epoch"] == 0


def test_an_epoch_jump_is_refused_and_one_forged_record_blocks_no_later_version() -> None:
    """A record claiming learner epoch 10^9 (with a plausible version) is refused, so the real
    learner's next versions, of its own epoch, are still accepted after it."""
    kind, why = implausible(6, 10**9, newest=5, newest_epoch=1) or ("", "")
    assert kind == "epoch" and "jumps" in why
    assert implausible(0, 10**9, newest=None, newest_epoch=0) is not None  # nor as the anchor
    assert implausible(6, 1 + MAX_EPOCH_JUMP, newest=5, newest_epoch=1) is None
    assert implausible(6, 2 + MAX_EPOCH_JUMP, newest=5, newest_epoch=1) is not None
    tips = VersionTips()
    assert tips.admit("m", 5, 1, "delta") is None
    assert tips.admit("m", 6, 10**9, "delta") is not None
    assert tips.admit("m", 6, 1, "delta") is None  # the real version 6 still applies
    assert tips.admit("m", 7, 2, "delta") is None  # and a restarted learner after it


def test_a_manifest_replayed_within_its_epoch_is_refused_a_newer_epoch_may_republish() -> None:
    tips = VersionTips()
    for version in range(4):
        assert tips.admit("m", version, 1, "delta") is None
    assert tips.admit("m", 4, 1, "keyframe") is None  # the other kind of a version
    kind, why = tips.admit("m", 2, 1, "delta") or ("", "")
    assert kind == "replayed" and "version 2 replayed in epoch 1" in why
    assert tips.admit("m", 3, 1, "delta") is not None  # the newest again: a duplicate
    assert tips.admit("m", 3, 2, "delta") is None  # a restarted learner republishes
    assert replayed(5, 2, (2, 4)) is None and replayed(4, 2, (2, 4)) is not None
    assert tips.admit("m", 3, 1, "keyframe") is not None  # the older epoch: refused as such

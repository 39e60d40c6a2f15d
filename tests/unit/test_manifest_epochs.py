"""Versions tied to the learner's epoch: the rule that refuses a manifest of an older learner
incarnation or an implausible version jump, and the epoch's way from the publisher through the
Avro record (old records, written before epochs, read as epoch 0: see test_schema_compat)."""

from __future__ import annotations

import numpy as np

from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events
from rlstream.schemas.deltacodec.wire import MAX_VERSION_JUMP, implausible, manifest_record


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

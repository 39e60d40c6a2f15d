"""Pure rules of weight sync: which kinds a version is published as, the Avro manifest mapping
(codec manifest -> WeightManifest -> codec manifest decodes bit-exactly), the catch-up route
(chain of deltas vs keyframe + deltas), fetch windows, where chunks go and the retention rule
(orphan chunks included)."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from confluent_kafka import KafkaError, KafkaException

from rlstream.consumers.weights.routes import Link, Route, fetch_windows, plan_route
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.producers.weights.retention import retention_cutoffs
from rlstream.producers.weights.rules import chunk_partitions, publish_kinds
from rlstream.schemas import deltacodec as codec
from rlstream.schemas import events
from rlstream.schemas.deltacodec.wire import (
    CHUNK_HEADER,
    codec_manifest,
    manifest_record,
    tensor_spans,
)

# --- kinds -----------------------------------------------------------------------------------


def test_first_version_and_multiples_of_k_are_keyframes_and_later_ones_also_deltas() -> None:
    assert publish_kinds(0, 4, has_base=False) == ("keyframe",)
    assert publish_kinds(7, 4, has_base=False) == ("keyframe",)  # fresh process, no base
    assert publish_kinds(1, 4, has_base=True) == ("delta",)
    assert publish_kinds(4, 4, has_base=True) == ("delta", "keyframe")
    assert publish_kinds(5, 4, has_base=True, force_keyframe=True) == ("delta", "keyframe")
    with pytest.raises(ValueError):
        publish_kinds(1, 0, has_base=True)


# --- the manifest mapping --------------------------------------------------------------------


def _state(rng: np.random.Generator, sizes: dict[str, int]) -> dict[str, codec.TensorBits]:
    return {
        n: codec.TensorBits("bfloat16", (k,), rng.integers(0, 2**16, k, dtype=np.uint16))
        for n, k in sizes.items()
    }


def _step(state: dict[str, codec.TensorBits], rng: np.random.Generator, frac: float) -> Any:
    out = {}
    for name, t in state.items():
        bits = t.bits.copy()
        hit = rng.random(bits.size) < frac
        bits[hit] = rng.integers(0, 2**16, int(hit.sum()), dtype=np.uint16)
        out[name] = codec.TensorBits(t.dtype, t.shape, bits)
    return out


SIZES = {"z.out": 30_000, "a.embed": 50_000, "m.norm": 64, "empty": 0}


def _record(enc: codec.Encoded, order: list[str]) -> dict[str, Any]:
    refs = {
        c["index"]: ("rl.r.weights.chunks", c["index"] % 3, 10 + c["index"])
        for c in enc.manifest["chunks"]
    }
    return manifest_record(
        enc.manifest,
        run="r",
        model="policy",
        chunk_topic="rl.r.weights.chunks",
        keyframe_version=0,
        created_ms=1,
        order=order,
        refs=refs,
        step_inputs=[{"topic": "rl.r.admitted", "partition": 0, "offset": 5}],
        stats={"loss": 0.5},
    )


def test_avro_manifest_round_trip_decodes_bit_exact_in_state_dict_order() -> None:
    rng = np.random.default_rng(1)
    v0 = _state(rng, SIZES)
    v1 = _step(v0, rng, 0.3)  # enough changes that the delta spans several chunks
    order = list(SIZES)  # state-dict order, not the codec's sorted order
    for enc, base in (
        (codec.encode_keyframe(v0, version=0, max_chunk_bytes=8_000), None),
        (codec.encode_delta(v0, v1, version=1, base_version=0, max_chunk_bytes=8_000), v0),
    ):
        rec = _record(enc, order)
        events.validate("weight_manifest", rec)  # every required Avro field is filled
        assert [t["name"] for t in rec["tensors"]] == order
        assert len(enc.chunks) > 3  # several chunks, tensors spanning chunk boundaries
        wire = events.decode(events.encode("weight_manifest", rec)).record
        rebuilt = codec_manifest(wire, enc.chunks)
        assert rebuilt["tensors"] == enc.manifest["tensors"]  # the piece table comes back
        out = codec.decode(rebuilt, enc.chunks, base)
        want = v0 if base is None else v1
        assert codec.same_state(out, want)


def test_tensor_spans_tile_the_concatenated_payloads() -> None:
    rng = np.random.default_rng(2)
    enc = codec.encode_keyframe(_state(rng, SIZES), version=0, max_chunk_bytes=8_000)
    spans = tensor_spans(enc.manifest)
    total = sum(c["nbytes"] for c in enc.manifest["chunks"])
    ordered = sorted((s for s in spans.values() if s[1]), key=lambda s: s[0])
    assert ordered[0][0] == CHUNK_HEADER.size
    assert ordered[-1][0] + ordered[-1][1] == total
    for (a, n), (b, _) in itertools.pairwise(ordered):
        assert a + n <= b  # no overlap; gaps are chunk headers only
        assert b - (a + n) in (0, CHUNK_HEADER.size)
    assert spans["empty"][1] == 0


def test_rebuilt_manifest_refuses_a_tampered_chunk_and_a_missing_one() -> None:
    rng = np.random.default_rng(3)
    enc = codec.encode_keyframe(_state(rng, SIZES), version=0, max_chunk_bytes=8_000)
    rec = _record(enc, list(SIZES))
    bad = bytearray(enc.chunks[1])
    bad[-1] ^= 1
    with pytest.raises(codec.ChunkCorrupt):
        codec_manifest(rec, [enc.chunks[0], bytes(bad), *enc.chunks[2:]])
    with pytest.raises(codec.MissingChunk):
        codec_manifest(rec, [enc.chunks[0], None, *enc.chunks[2:]])
    with pytest.raises(codec.ChunkCorrupt):  # a span that disagrees with the pieces
        rec["tensors"][0] = {**rec["tensors"][0], "offset": rec["tensors"][0]["offset"] + 1}
        codec_manifest(rec, enc.chunks)


# --- routes ----------------------------------------------------------------------------------


def _history(newest: int, k: int, delta: int = 10, keyframe: int = 1000) -> list[Link]:
    """Versions 0..newest as the publisher writes them: keyframe at multiples of k, a delta
    for every version after 0."""
    links = [Link(v, "keyframe", None, keyframe) for v in range(0, newest + 1, k)]
    links += [Link(v, "delta", v - 1, delta) for v in range(1, newest + 1)]
    return links


def test_a_worker_a_few_versions_behind_takes_the_delta_chain_across_a_keyframe() -> None:
    route = plan_route(_history(6, 4), current=3)
    assert route == Route(6, ((4, "delta"), (5, "delta"), (6, "delta")), 30)


def test_a_worker_far_behind_takes_the_latest_keyframe_and_the_deltas_after_it() -> None:
    route = plan_route(_history(10, 4, delta=300), current=1)
    assert route is not None and route.from_keyframe
    assert route.steps == ((8, "keyframe"), (9, "delta"), (10, "delta"))
    assert route.nbytes == 1000 + 600


def test_the_cheaper_route_wins_and_a_tie_prefers_the_chain() -> None:
    # 4 deltas of 250 = 1000 = keyframe 8's bytes (+0 deltas after it): the chain wins ties
    assert plan_route(_history(8, 8, delta=250), current=4) == Route(
        8, tuple((v, "delta") for v in range(5, 9)), 1000
    )
    route = plan_route(_history(8, 8, delta=251), current=4)
    assert route == Route(8, ((8, "keyframe"),), 1000)


def test_a_new_worker_bootstraps_from_a_keyframe() -> None:
    route = plan_route(_history(6, 4), current=None)
    assert route == Route(6, ((4, "keyframe"), (5, "delta"), (6, "delta")), 1020)
    assert plan_route(_history(0, 4), current=None) == Route(0, ((0, "keyframe"),), 1000)
    assert plan_route([], current=None) is None


def test_a_failed_delta_strands_the_worker_until_the_next_keyframe() -> None:
    bad = {(5, "delta")}
    assert plan_route(_history(7, 4), current=4, skip=bad) is None  # 6 and 7 need 5
    assert plan_route(_history(7, 4), current=3, skip=bad) == Route(4, ((4, "delta"),), 10)
    route = plan_route(_history(8, 4), current=4, skip=bad)
    assert route == Route(8, ((8, "keyframe"),), 1000)


def test_up_to_date_or_ahead_means_nothing_to_do() -> None:
    assert plan_route(_history(6, 4), current=6) is None
    assert plan_route(_history(6, 4), current=9) is None


def test_a_failed_keyframe_falls_back_to_an_older_keyframe() -> None:
    route = plan_route(_history(9, 4), current=None, skip={(8, "keyframe")})
    assert route is not None and route.steps[0] == (4, "keyframe") and route.target == 9


# --- fetch windows ---------------------------------------------------------------------------


def _chunk(i: int, partition: int, offset: int, topic: str = "t") -> dict[str, Any]:
    ref = {"topic": topic, "partition": partition, "offset": offset}
    return {"index": i, "nbytes": 1, "checksum": "x", "ref": ref}


def test_fetch_windows_from_refs_and_none_when_a_ref_is_missing_or_remote() -> None:
    chunks = [_chunk(0, 0, 7), _chunk(1, 1, 3), _chunk(2, 0, 9), _chunk(3, 0, 8)]
    assert fetch_windows(chunks, "t") == {0: (7, 9), 1: (3, 3)}
    assert fetch_windows(chunks, "eu.t") == {}  # a mirrored copy: offsets differ
    assert fetch_windows([*chunks, {**_chunk(4, 0, 1), "ref": None}], "t") == {}


# --- retention -------------------------------------------------------------------------------


def _manifest(version: int, kind: str, refs: list[tuple[int, int]]) -> dict[str, Any]:
    return {
        "version": version,
        "kind": kind,
        "chunks": [_chunk(i, p, o) for i, (p, o) in enumerate(refs)],
    }


def test_retention_keeps_everything_from_the_second_newest_keyframe_on() -> None:
    # partitions 0 and 1; versions 0..9, keyframes at 0, 4, 8 (with a delta at 4 and 8 too)
    log: list[dict[str, Any]] = [_manifest(0, "keyframe", [(0, 0), (1, 0)])]
    offsets = {0: 1, 1: 1}
    for v in range(1, 10):
        kinds = ["delta", "keyframe"] if v % 4 == 0 else ["delta"]
        for kind in kinds:
            part = v % 2
            log.append(_manifest(v, kind, [(part, offsets[part])]))
            offsets[part] += 1
    cuts = retention_cutoffs(log, keep_keyframes=2)
    # kept: versions >= 4; first kept chunk per partition is the delta of 4 (p0) / of 5 (p1)
    first_kept = {
        p: min(
            c["ref"]["offset"]
            for m in log
            if m["version"] >= 4
            for c in m["chunks"]
            if c["ref"]["partition"] == p
        )
        for p in (0, 1)
    }
    assert cuts == {("t", p): off for p, off in first_kept.items()}
    for m in log:
        for c in m["chunks"]:
            deleted = c["ref"]["offset"] < cuts[("t", c["ref"]["partition"])]
            assert deleted == (m["version"] < 4)
    assert retention_cutoffs(log, keep_keyframes=3) == {}  # keyframe 0 is kept: nothing older
    assert retention_cutoffs(log[:5], keep_keyframes=2) == {}  # one keyframe only


def test_retention_cuts_past_dropped_chunks_where_no_kept_chunk_lies_and_nothing_if_unknown() -> (
    None
):
    log = [
        _manifest(0, "keyframe", [(0, 0), (2, 0)]),
        _manifest(1, "delta", [(2, 1)]),
        _manifest(2, "keyframe", [(0, 1)]),
        _manifest(3, "keyframe", [(0, 2)]),
    ]
    assert retention_cutoffs(log) == {("t", 0): 1, ("t", 2): 2}
    unknown = [*log[:3], {**log[3], "chunks": [{**log[3]["chunks"][0], "ref": None}]}]
    assert retention_cutoffs(unknown) == {}


class _FailingAdmin:
    """An admin client whose record deletion fails as it does while a leader moves."""

    def __init__(self) -> None:
        self.calls = 0

    def delete_records(self, request: list[Any], **_: Any) -> dict[Any, Future[Any]]:
        self.calls += 1
        future: Future[Any] = Future()
        future.set_exception(KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)))
        return dict.fromkeys(request, future)


def test_a_best_effort_prune_that_fails_forgets_nothing_and_raises_nothing() -> None:
    log = [
        _manifest(0, "keyframe", [(0, 0)]),
        _manifest(1, "delta", [(0, 1)]),
        _manifest(2, "keyframe", [(0, 2)]),
        _manifest(3, "keyframe", [(0, 3)]),
    ]
    publisher = SimpleNamespace(history=list(log))
    admin = _FailingAdmin()
    with pytest.raises(KafkaException):
        WeightPublisher.prune(publisher, admin)  # type: ignore[arg-type]
    assert WeightPublisher.prune(publisher, admin, best_effort=True) == {}  # type: ignore[arg-type]
    assert admin.calls == 2 and publisher.history == log  # the next prune deletes the same


# --- chunk partitions and orphans ------------------------------------------------------------


def test_chunks_go_round_robin_from_where_the_previous_publish_ended() -> None:
    assert chunk_partitions(0, 8, 6) == [0, 1, 2, 3, 4, 5, 0, 1]
    assert chunk_partitions(2, 1, 6) == [2]  # a one-chunk delta takes the next partition
    assert chunk_partitions(5, 3, 6) == [5, 0, 1]
    assert chunk_partitions(0, 0, 6) == []
    with pytest.raises(ValueError):
        chunk_partitions(0, 1, 0)


class _Topic:
    """A chunk topic of ``parts`` partitions written as the publisher does: round-robin,
    continuing where the previous publish ended."""

    def __init__(self, parts: int) -> None:
        self.parts, self.start = parts, 0
        self.ends = dict.fromkeys(range(parts), 0)

    def write(self, count: int) -> list[tuple[int, int]]:
        refs = []
        for p in chunk_partitions(self.start, count, self.parts):
            refs.append((p, self.ends[p]))
            self.ends[p] += 1
        self.start = (self.start + count) % self.parts
        return refs


def test_orphans_go_with_the_versions_before_the_oldest_kept_keyframe() -> None:
    # keyframes (8 chunks, more than the 6 partitions) at 0, 3, 6, 9; one-chunk deltas; the
    # publishes of 2 and 4 abort once: their chunks are written, no manifest names them
    topic, log, orphans = _Topic(6), [], {}
    for v in range(10):
        if v in (2, 4):
            orphans[v] = topic.write(1 if v == 2 else 2)
        if v:
            log.append(_manifest(v, "delta", topic.write(1)))
        if v % 3 == 0:
            log.append(_manifest(v, "keyframe", topic.write(8)))

    def deleted(cuts: dict[tuple[str, int], int], ref: tuple[int, int]) -> bool:
        return ref[1] < cuts.get(("t", ref[0]), 0)

    upto_7 = [m for m in log if m["version"] <= 7]
    cuts = retention_cutoffs(upto_7, keep_keyframes=2)  # kept: from keyframe 3 on
    assert all(deleted(cuts, r) for r in orphans[2])  # older than keyframe 3: gone with 0..2
    assert not any(deleted(cuts, r) for r in orphans[4])  # after it: kept for now
    cuts = retention_cutoffs(log, keep_keyframes=2)  # keyframe 9 landed: kept from 6 on
    assert all(deleted(cuts, r) for r in orphans[2] + orphans[4])
    kept = [c["ref"] for m in log if m["version"] >= 6 for c in m["chunks"]]
    assert not any(deleted(cuts, (r["partition"], r["offset"])) for r in kept)

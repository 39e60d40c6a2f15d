"""Raw array fields and record splitting.

Properties asserted: unpack is zero-copy and read-only; pack is little-endian whatever the input
byte order and refuses lossy casts; a 32k-token trajectory with 8 MoE layers x top-8 experts
round-trips through the codec in milliseconds and fits the trajectories topic; split records
each fit their limit and join back bit-exactly, in any arrival order, with duplicates.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlstream.schemas import arrays as A
from rlstream.schemas import events as E
from rlstream.schemas import reassembly as R
from rlstream.schemas import topics as T


def test_pack_is_little_endian_whatever_the_input_order() -> None:
    big = np.array([1, 2, 70000], dtype=">i8")
    data = A.pack(big, np.int32)
    assert data == np.array([1, 2, 70000], dtype="<i4").tobytes()
    assert A.pack(np.array([0.5], dtype=">f8"), np.float32) == b"\x00\x00\x00\x3f"


def test_unpack_is_a_zero_copy_read_only_view() -> None:
    buf = bytearray(A.pack(np.arange(12), np.int32))
    view = A.unpack(buf, np.int32, (3, 4))
    assert view.shape == (3, 4) and view[2, 3] == 11
    assert not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(buf, np.uint8))
    buf[0:4] = (99).to_bytes(4, "little")  # the view sees the buffer: no copy was made
    assert view[0, 0] == 99
    with pytest.raises(ValueError):
        view[0, 0] = 1
    from_bytes = A.unpack(bytes(buf), "<i4")
    assert not from_bytes.flags.writeable


def test_unpack_rejects_bad_sizes() -> None:
    with pytest.raises(A.ArrayError, match="whole number"):
        A.unpack(b"\x00" * 7, np.int32)
    with pytest.raises(A.ArrayError, match="cannot have shape"):
        A.unpack(b"\x00" * 8, np.int32, (3,))


def test_pack_refuses_lossy_casts() -> None:
    with pytest.raises(A.ArrayError, match="do not fit"):
        A.pack(np.array([0, 300]), np.uint8)
    with pytest.raises(A.ArrayError, match="do not fit"):
        A.pack(np.array([2**31]), np.int32)
    with pytest.raises(A.ArrayError, match="refusing to cast"):
        A.pack(np.array([1.5]), np.int32)
    assert A.pack(np.array([True, False]), np.uint8) == b"\x01\x00"
    assert A.pack([3, 4], np.int32) == b"\x03\x00\x00\x00\x04\x00\x00\x00"


def test_pack_tokens_checks_shapes_and_values() -> None:
    ok = A.pack_tokens([1, 2], [-0.1, -0.2], [0, 1], np.zeros((2, 3, 2), np.int64))
    assert (ok["n_layers"], ok["top_k"], len(ok["routed_experts"])) == (3, 2, 12)
    dense = A.pack_tokens([1, 2], [-0.1, -0.2], [0, 1])
    assert (dense["n_layers"], dense["top_k"], dense["routed_experts"]) == (0, 0, b"")
    assert A.unpack_tokens(dense).routed_experts.shape == (2, 0, 0)
    with pytest.raises(A.ArrayError, match="equally long"):
        A.pack_tokens([1, 2], [-0.1], [0, 1])
    with pytest.raises(A.ArrayError, match="only 0 and 1"):
        A.pack_tokens([1, 2], [-0.1, -0.2], [0, 2])
    with pytest.raises(A.ArrayError, match="routed_experts must have shape"):
        A.pack_tokens([1, 2], [-0.1, -0.2], [0, 1], np.zeros((3, 1, 1), np.int64))
    with pytest.raises(A.ArrayError, match="do not fit"):
        A.pack_tokens([1], [-0.1], [1], np.full((1, 1, 1), 256))


def test_unpack_tokens_detects_inconsistent_records() -> None:
    fields = A.pack_tokens([1, 2, 3], [0.0] * 3, [1] * 3, np.zeros((3, 2, 2), np.int64))
    with pytest.raises(A.ArrayError, match="disagree"):
        A.unpack_tokens({**fields, "top_k": 3})
    with pytest.raises(A.ArrayError, match="disagree"):
        A.unpack_tokens({**fields, "logprobs": b"\x00" * 8})
    with pytest.raises(A.ArrayError, match="no token arrays"):
        A.unpack_tokens({"token_ids": None})


def trajectory(
    n_tokens: int, layers: int = 8, top_k: int = 8, seed: int = 0, turns: int = 4
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    fields = A.pack_tokens(
        rng.integers(0, 151_000, n_tokens),
        -rng.exponential(1.0, n_tokens).astype(np.float32),
        rng.random(n_tokens) < 0.6,
        rng.integers(0, 128, (n_tokens, layers, top_k)),
    )
    span = max(n_tokens // max(turns, 1), 1)
    return {
        "run": "r1", "group_id": "g-1", "task_id": "t-1", "sample_index": seed, "group_size": 16,
        "policy_version": 3, "model": "moe", "worker_id": "w-1", "region": "us", **fields,
        "prompt_tokens": min(100, n_tokens), "completion": "déf fix():\n    return 42  # ✓\n" * (n_tokens // 8 + 1),
        "turns": [
            {"index": i, "token_start": i * span, "token_end": (i + 1) * span, "generated_tokens": span // 2}
            for i in range(turns)
        ],
        "outcome": {"status": "completed", "tool_calls": turns, "summarised": False},
        "timings": {"queued_ms": 1, "started_ms": 2, "finished_ms": 3, "generate_ms": 4, "env_ms": 5},
    }  # fmt: skip


def test_32k_token_moe_trajectory_round_trip_is_fast_and_fits() -> None:
    n, layers, top_k = 32_768, 8, 8
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 151_000, n)
    logprobs = -rng.exponential(1.0, n).astype(np.float32)
    mask = rng.random(n) < 0.6
    experts = rng.integers(0, 256, (n, layers, top_k))
    record = {**trajectory(8), "completion": "x" * 100_000}
    serialize, deserialize = E.serializer("trajectory"), E.deserializer(expect="trajectory")

    start = time.perf_counter()
    record.update(A.pack_tokens(tokens, logprobs, mask, experts))
    data = serialize(record, None)
    arrays = A.unpack_tokens(deserialize(data, None).record)
    elapsed = time.perf_counter() - start

    assert np.array_equal(arrays.token_ids, tokens)
    assert np.array_equal(arrays.logprobs, logprobs)
    assert np.array_equal(arrays.loss_mask, mask)
    assert np.array_equal(arrays.routed_experts, experts)
    assert arrays.routed_experts.shape == (n, layers, top_k)
    assert len(data) <= T.STREAMS["trajectories"].max_value_bytes
    assert len(data) <= A.message_size_bound(record)
    # typically ~5 ms; the bound only catches a per-token Python loop on a loaded shared machine
    assert elapsed < 0.5, f"32k-token round trip took {elapsed * 1e3:.1f} ms"


def _encoded(event: str, records: list[dict[str, Any]]) -> list[bytes]:
    serialize = E.serializer(event)
    return [serialize(r, None) for r in records]


def test_split_segments_fit_and_join_exactly() -> None:
    record = trajectory(4000, turns=9)
    whole = E.encode("trajectory", record)
    limit = 100_000
    segments = A.split_segments(record, limit)
    encoded = _encoded("trajectory", segments)
    assert len(segments) >= len(whole) // limit + 1
    assert all(len(data) <= limit for data in encoded)
    assert [s["segment_index"] for s in segments] == list(range(len(segments)))
    assert sum(len(s["turns"]) for s in segments) == 9
    decoded = [E.decode(d).record for d in encoded]
    shuffled = decoded + decoded[:2]  # duplicates from redelivery
    random.Random(3).shuffle(shuffled)
    assert E.encode("trajectory", A.join_segments(shuffled)) == whole


def test_small_trajectory_is_not_split() -> None:
    record = trajectory(10)
    assert A.split_segments(record, 1_000_000) == [record]
    assert A.join_segments([record]) == record


def test_join_segments_refuses_incomplete_or_mixed_input() -> None:
    segments = A.split_segments(trajectory(3000), 60_000)
    assert len(segments) >= 3
    with pytest.raises(A.ArrayError, match="incomplete"):
        A.join_segments(segments[:-1])
    other = A.split_segments(trajectory(3000, seed=1), 60_000)
    with pytest.raises(A.ArrayError, match="different items"):
        A.join_segments([other[0], *segments[1:]])
    with pytest.raises(A.ArrayError, match="already a segment"):
        A.split_segments({**segments[0], "completion": "y" * 100_000}, 60_000)


def sample(index: int, n_tokens: int, layers: int = 8, top_k: int = 8) -> dict[str, Any]:
    rng = np.random.default_rng(index)
    return {
        "sample_index": index, "policy_version": 7, "prompt_tokens": 10,
        **A.pack_tokens(rng.integers(0, 1000, n_tokens), rng.random(n_tokens, np.float32),
                        rng.random(n_tokens) < 0.5, rng.integers(0, 64, (n_tokens, layers, top_k))),
        "rewards": {"tests": float(index % 2)}, "reward": float(index % 2), "passed": bool(index % 2),
    }  # fmt: skip


def decision(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "run": "r1", "group_id": "g-9", "task_id": "t-9", "decision": "admitted", "source": "rollout",
        "learner_version": 9, "min_behaviour_version": 7, "max_behaviour_version": 7, "staleness": 2,
        "decided_ms": 5, "group_size": len(samples), "samples": samples,
    }  # fmt: skip


def test_split_group_fits_keeps_small_samples_whole_and_joins_exactly() -> None:
    lengths = [300, 50, 2500, 0, 700, 120, 900, 60]  # 2500 tokens x 73 B > one part
    record = decision([sample(i, n) for i, n in enumerate(lengths)])
    whole = E.encode("admission", record)
    limit = 80_000
    parts = A.split_group(record, limit)
    encoded = _encoded("admission", parts)
    assert all(len(data) <= limit for data in encoded)
    assert [p["part_index"] for p in parts] == list(range(len(parts)))
    sliced = {s["sample_index"] for p in parts for s in p["samples"] if s.get("token_offset", 0)}
    assert sliced == {2}, "only the sample larger than a part is sliced"
    decoded = [E.decode(d).record for d in reversed(encoded)]
    assert E.encode("admission", A.join_group(decoded)) == whole


def test_join_group_refuses_missing_parts() -> None:
    parts = A.split_group(decision([sample(i, 400) for i in range(6)]), 60_000)
    assert len(parts) > 2
    with pytest.raises(A.ArrayError, match="incomplete"):
        A.join_group(parts[1:])


def test_reassemblers_release_items_when_complete() -> None:
    reassembler = R.trajectory_reassembler()
    a = A.split_segments(trajectory(3000, seed=0), 60_000)
    b = A.split_segments(trajectory(3000, seed=1), 60_000)
    interleaved = [x for pair in zip(a, b, strict=True) for x in pair]
    done = [j for seg in [*interleaved, a[0]] if (j := reassembler.add(seg)) is not None]
    assert [j["sample_index"] for j in done] == [0, 1]
    # the late duplicate of a completed item starts it afresh (a re-read must complete again)
    assert reassembler.keys() == [("r1", "g-1", 0)]
    assert reassembler.stale(3600) == [] and reassembler.stale(-1) == [("r1", "g-1", 0)]
    assert reassembler.discard(("r1", "g-1", 0)) == 1 and len(reassembler) == 0
    assert reassembler.add(trajectory(5)) is not None  # unsplit records pass through
    assert len(reassembler) == 0
    groups = R.group_reassembler()
    parts = A.split_group(decision([sample(i, 400) for i in range(6)]), 60_000)
    results = [groups.add(p) for p in parts]
    assert results[:-1] == [None] * (len(parts) - 1) and results[-1] is not None


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 1500), min_size=1, max_size=6),
    limit=st.integers(20_000, 120_000),
    layers=st.integers(0, 4),
)
def test_split_join_group_property(lengths: list[int], limit: int, layers: int) -> None:
    record = decision([sample(i, n, layers, 2 if layers else 0) for i, n in enumerate(lengths)])
    parts = A.split_group(record, limit)
    assert all(len(d) <= limit for d in _encoded("admission", parts))
    assert E.encode("admission", A.join_group(parts)) == E.encode("admission", record)


@settings(max_examples=25, deadline=None)
@given(n_tokens=st.integers(0, 3000), limit=st.integers(30_000, 200_000), turns=st.integers(0, 12))
def test_split_join_segments_property(n_tokens: int, limit: int, turns: int) -> None:
    record = trajectory(n_tokens, layers=4, top_k=4, turns=turns)
    segments = A.split_segments(record, limit)
    assert all(len(d) <= limit for d in _encoded("trajectory", segments))
    assert E.encode("trajectory", A.join_segments(segments)) == E.encode("trajectory", record)


@pytest.mark.parametrize("n_tokens", [0, 1, 1000])
def test_size_bound_is_an_upper_bound(n_tokens: int) -> None:
    record = trajectory(n_tokens)
    assert len(E.encode("trajectory", record)) <= A.message_size_bound(record)
    group = decision([sample(0, n_tokens), sample(1, 3)])
    assert len(E.encode("admission", group)) <= A.message_size_bound(group)


# --- expert id width (expert_bytes) -------------------------------------------------------------

N_EXPERTS = 384  # Composer 2's base: ids do not fit uint8


def wide_trajectory(
    n_tokens: int, layers: int = 4, top_k: int = 8, seed: int = 0
) -> dict[str, Any]:
    """A trajectory of a 384-expert policy: routes recorded 2 bytes wide, ids up to 383."""
    rng = np.random.default_rng(seed)
    routes = rng.integers(0, N_EXPERTS, (n_tokens, layers, top_k))
    routes.reshape(-1)[: min(routes.size, 2)] = [N_EXPERTS - 1, 256]  # the edges that wrap in uint8
    record = trajectory(n_tokens, layers, top_k, seed)
    record.update(
        A.pack_tokens(
            A.unpack_tokens(record).token_ids,
            A.unpack_tokens(record).logprobs,
            A.unpack_tokens(record).loss_mask,
            routes,
            expert_bytes=A.expert_bytes_for(N_EXPERTS),
        )
    )
    return record


def test_expert_width_follows_the_policys_expert_count() -> None:
    assert [A.expert_bytes_for(n) for n in (2, 255, 256, 257, 384, 65_536)] == [1, 1, 1, 2, 2, 2]
    with pytest.raises(A.ArrayError, match="must fit 2 bytes"):
        A.expert_bytes_for(65_537)
    with pytest.raises(A.ArrayError, match="expert_bytes must be one of"):
        A.expert_dtype(3)


def test_384_expert_routes_round_trip_through_pack_and_unpack() -> None:
    rng = np.random.default_rng(4)
    routes = rng.integers(0, N_EXPERTS, (50, 3, 8))
    routes[0, 0, 0], routes[-1, -1, -1] = N_EXPERTS - 1, 256
    fields = A.pack_tokens(
        np.arange(50), np.zeros(50), np.ones(50, np.uint8), routes, expert_bytes=2
    )
    assert fields["expert_bytes"] == 2 and len(fields["routed_experts"]) == 50 * 3 * 8 * 2
    assert fields["routed_experts"] == routes.astype("<u2").tobytes()  # little-endian uint16
    got = A.unpack_tokens(fields)
    assert got.routed_experts.dtype == np.dtype("<u2") and got.expert_bytes == 2
    assert np.array_equal(got.routed_experts, routes)
    assert got.bytes_per_token == 9 + 3 * 8 * 2
    # a uint16 array (what the harness hands over) carries its width without being told
    assert (
        A.pack_tokens(np.arange(50), np.zeros(50), np.ones(50, np.uint8), routes.astype(np.uint16))
        == fields
    )
    # width 1 stays the default and keeps its exact old bytes
    narrow = A.pack_tokens([1], [0.0], [1], np.full((1, 1, 2), 255))
    assert (narrow["expert_bytes"], narrow["routed_experts"]) == (1, b"\xff\xff")


def test_ids_that_do_not_fit_the_width_are_refused() -> None:
    with pytest.raises(
        A.ArrayError, match=r"expert_bytes=1: values in \[0, 256\] do not fit uint8"
    ):
        A.pack_tokens([1], [0.0], [1], np.array([[[0, 256]]]))
    with pytest.raises(A.ArrayError, match=r"expert_bytes=1: .* do not fit uint8"):
        A.pack_tokens([1], [0.0], [1], np.array([[[383, 1]]], np.uint16), expert_bytes=1)
    with pytest.raises(A.ArrayError, match=r"expert_bytes=2: values in \[0, 65536\] do not fit"):
        A.pack_tokens([1], [0.0], [1], np.array([[[0, 65_536]]]), expert_bytes=2)
    with pytest.raises(A.ArrayError, match=r"values in \[-1, 3\] do not fit"):
        A.pack_tokens([1], [0.0], [1], np.array([[[-1, 3]]]), expert_bytes=2)
    with pytest.raises(A.ArrayError, match="expert_bytes must be one of"):
        A.pack_tokens([1], [0.0], [1], np.array([[[0, 1]]]), expert_bytes=4)
    with pytest.raises(A.ArrayError, match="do not fit uint8"):
        A.expert_ids(np.array([300]), 1)  # what the harness and the server call: never wraps


def test_unpack_tokens_refuses_a_width_the_bytes_do_not_match() -> None:
    fields = A.pack_tokens([1, 2], [0.0] * 2, [1] * 2, np.full((2, 2, 2), 300), expert_bytes=2)
    with pytest.raises(A.ArrayError, match="disagree"):
        A.unpack_tokens({**fields, "expert_bytes": 1})  # the width dropped by a careless copy
    with pytest.raises(A.ArrayError, match="expert_bytes must be one of"):
        A.unpack_tokens({**fields, "expert_bytes": 3})
    old = {k: v for k, v in fields.items() if k != "expert_bytes"}
    old.update(routed_experts=b"\x07" * 8)  # a record from before the field: uint8
    assert A.unpack_tokens(old).routed_experts.dtype == np.uint8
    assert A.unpack_tokens(old).expert_bytes == 1


def test_384_expert_trajectory_splits_and_joins_exactly() -> None:
    record = wide_trajectory(3000)
    whole = E.encode("trajectory", record)
    segments = A.split_segments(record, 60_000)
    encoded = _encoded("trajectory", segments)
    assert len(segments) > 2 and all(len(d) <= 60_000 for d in encoded)
    decoded = [E.decode(d).record for d in encoded]
    assert {d["expert_bytes"] for d in decoded} == {2}
    for piece in decoded:  # each segment is a valid record of its own token range
        assert A.unpack_tokens(piece).routed_experts.dtype == np.dtype("<u2")
    random.Random(5).shuffle(decoded)
    joined = A.join_segments(decoded)
    assert E.encode("trajectory", joined) == whole
    assert np.array_equal(
        A.unpack_tokens(joined).routed_experts, A.unpack_tokens(record).routed_experts
    )
    assert int(A.unpack_tokens(joined).routed_experts.max()) == N_EXPERTS - 1
    reassembler = R.trajectory_reassembler()
    done = [j for seg in decoded if (j := reassembler.add(seg)) is not None]
    assert len(done) == 1 and E.encode("trajectory", done[0]) == whole


def test_384_expert_group_splits_into_parts_and_joins_exactly() -> None:
    def wide_sample(index: int, n_tokens: int) -> dict[str, Any]:
        rec = wide_trajectory(n_tokens, seed=index)
        keep = ("sample_index", "policy_version", "prompt_tokens", *A.ARRAY_FIELDS)
        return {**{k: rec[k] for k in keep}, "rewards": {}, "reward": 0.5, "passed": True}

    record = decision([wide_sample(i, n) for i, n in enumerate([200, 1800, 40, 700])])
    whole = E.encode("admission", record)
    parts = A.split_group(record, 40_000)
    assert len(parts) > 2 and all(len(d) <= 40_000 for d in _encoded("admission", parts))
    sliced = [s for p in parts for s in p["samples"] if s.get("token_offset", 0)]
    assert sliced and all(s["expert_bytes"] == 2 for s in sliced)
    assert all(A.unpack_tokens(s).expert_bytes == 2 for p in parts for s in p["samples"])
    assert E.encode("admission", A.join_group(list(reversed(parts)))) == whole


def test_slices_of_different_widths_do_not_join() -> None:
    segments = A.split_segments(wide_trajectory(3000), 60_000)
    narrow = A.split_segments(trajectory(3000, layers=4, top_k=8), 60_000)
    mixed = [*segments[:-1], {**narrow[-1], "segment_count": len(segments)}]
    mixed[-1]["segment_index"] = len(segments) - 1
    with pytest.raises(A.ArrayError, match="expert_bytes"):
        A.join_segments(mixed)


def test_segment_bounds_survive_splitting_admission_and_parts() -> None:
    """A compacted sample's contexts reach the learner through every split and join: the
    trajectory split into segments, rejoined, admitted, the decision split into parts, rejoined."""
    from rlstream.consumers.admission_rules import AdmissionConfig, PendingGroup, admitted_samples

    record = {**trajectory(3000, layers=2, top_k=2, turns=3), "temperature": 1.0}
    want = [v for t in record["turns"] for v in (t["token_start"], t["token_end"])]
    pieces = A.split_segments(record, 8000)
    assert len(pieces) > 2
    joined = A.join_segments(reversed(pieces))
    group = PendingGroup("g-1", "t-1", 1, first_seen_ms=0)
    group.add_sample(joined)
    group.add_reward({"sample_index": joined["sample_index"], "judge": "tests", "score": 1.0})
    cfg = AdmissionConfig(judges={"tests": 1.0}, max_staleness=2, timeout_s=10)
    (sample,) = admitted_samples(group, cfg)
    assert sample["segment_bounds"] == want
    decision = {"run": "r1", "group_id": "g-1", "samples": [sample], "part_index": 0,
                "part_count": 1}  # fmt: skip
    parts = A.split_group(decision, 8000)
    assert len(parts) > 2 and all(p["samples"][0]["segment_bounds"] == want for p in parts)
    assert A.join_group(parts)["samples"][0]["segment_bounds"] == want

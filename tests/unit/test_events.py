"""The event codec: round trips, validation errors that name the field, and decode failures.

Properties asserted: every event type round-trips bit-exactly with realistic values; a bad record
raises EventError naming the offending field; any bytes that are not a decodable record raise
DecodeError (never another exception) with a dead-letter reason; the wire format is Avro's
single-object encoding, readable by plain fastavro with the schema published to rl.schemas.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import fastavro
import fastavro.schema
import numpy as np
import pytest

from rlstream.schemas import arrays as A
from rlstream.schemas import events as E

REF = {"topic": "rl.r1.trajectories", "partition": 3, "offset": 1207}


def _tokens(n: int, layers: int = 4, top_k: int = 2, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return A.pack_tokens(
        rng.integers(0, 151_000, n),
        -rng.exponential(1.0, n).astype(np.float32),
        np.arange(n) >= n // 4,
        rng.integers(0, 64, (n, layers, top_k)),
    )


def examples() -> dict[str, dict[str, Any]]:
    """One realistic record per event, every field given (so a round trip must be exact)."""
    spec = {
        "repo": "acme/api",
        "commit": "9f1c2e",
        "hidden_tests": ["tests/test_auth.py"],
        "seed": 77,
    }
    task = {
        "run": "r1",
        "task_id": "t-000042",
        "created_ms": 1_732_000_000_000,
        "family": "fix-failing-test",
        "prompt": "The login endpoint returns 500 on an empty password. Fix it.",
        "spec_json": json.dumps(spec),
        "group_size": 16,
        "max_turns": 24,
        "seed": 1234567,
        "max_tokens": 32768,
        "deadline_ms": 1_732_000_600_000,
        "released_version": 17,
        "attempt": 0,
        "tags": {"split": "train", "difficulty": "medium"},
        "checkpoint": None,
    }
    turns = [
        {
            "index": 0,
            "token_start": 0,
            "token_end": 180,
            "generated_tokens": 60,
            "tool": "read_file",
            "tool_ok": True,
            "generate_ms": 800,
            "env_ms": 35,
            "summarised": False,
        },
        {
            "index": 1,
            "token_start": 180,
            "token_end": 300,
            "generated_tokens": 120,
            "tool": None,
            "tool_ok": None,
            "generate_ms": 1500,
            "env_ms": 0,
            "summarised": True,
        },
    ]
    trajectory = {
        "run": "r1",
        "group_id": "t-000042/0",
        "task_id": "t-000042",
        "sample_index": 5,
        "group_size": 16,
        "segment_index": 0,
        "segment_count": 1,
        "token_offset": 0,
        "policy_version": 15,
        "model": "moe-tiny",
        "worker_id": "rollout-eu-7",
        "region": "eu",
        "engine": "vllm",
        "temperature": 1.0,
        "top_p": 0.95,
        **_tokens(300),
        "prompt_tokens": 75,
        "completion": "I'll read the handler first.\n<tool>read_file auth.py</tool>…fixed ✓",
        "turns": turns,
        "outcome": {
            "status": "completed",
            "tool_calls": 1,
            "tool_errors": 0,
            "summarised": True,
            "tests_passed": 12,
            "tests_total": 12,
            "exit_code": 0,
            "error": None,
            "details": {"files_changed": "auth.py"},
        },
        "timings": {
            "queued_ms": 1_732_000_000_100,
            "started_ms": 1_732_000_000_150,
            "finished_ms": 1_732_000_004_000,
            "generate_ms": 2300,
            "env_ms": 35,
            "weights_wait_ms": 12,
        },
        "version_spans": [],  # one version: policy_version (see the partial-rollout test)
        "routes_recorded": True,
        "learner_epoch": 2,
    }
    reward = {
        "run": "r1",
        "group_id": "t-000042/0",
        "task_id": "t-000042",
        "sample_index": 5,
        "judge": "tests",
        "judge_version": "2024-11-01",
        "score": 1.0,
        "passed": True,
        "rationale": "12/12 hidden tests pass",
        "latency_ms": 4100,
        "policy_version": 15,
        "trajectory": REF,
        "created_ms": 1_732_000_008_000,
        "error": None,
        "details": {"unit": 1.0, "lint": 0.5},
    }
    sample = {
        "sample_index": 5,
        "policy_version": 15,
        "token_offset": 0,
        "prompt_tokens": 75,
        **_tokens(300),
        "temperature": 1.0,
        "rewards": {"tests": 1.0, "style": 0.25},
        "reward": 1.25,
        "passed": True,
        "task_class": "fix-failing-test",
        "region": "eu",
        "trajectory": REF,
        "routes_recorded": True,
        "segment_bounds": [0, 180, 180, 300],
        "reward_refs": [{**REF, "topic": "rl.r1.rewards", "offset": 88}],
        "feedback": None,
    }
    admission = {
        "run": "r1",
        "group_id": "t-000042/0",
        "task_id": "t-000042",
        "decision": "admitted",
        "reason": None,
        "detail": None,
        "source": "rollout",
        "learner_version": 17,
        "min_behaviour_version": 15,
        "max_behaviour_version": 16,
        "staleness": 2,
        "decided_ms": 1_732_000_009_000,
        "group_size": 16,
        "task_class": "fix-failing-test",
        "part_index": 0,
        "part_count": 1,
        "samples": [
            sample,
            {
                **sample,
                "sample_index": 6,
                **_tokens(120, seed=1),
                "reward": -0.5,
                "passed": False,
                "trajectory": None,
            },
        ],
        "inputs": [REF, {**REF, "topic": "rl.r1.rewards", "offset": 88}],
        "task_ref": {**REF, "topic": "rl.r1.tasks", "offset": 7},
    }
    tensor = {
        "name": "layers.0.mlp.experts.w1",
        "dtype": "bfloat16",
        "shape": [64, 512, 128],
        "encoding": "sparse-xor",
        "changed": 41_221,
        "hash": "ab" * 16,
        "base_hash": "cd" * 16,
        "offset": 0,
        "nbytes": 180_442,
    }
    manifest = {
        "run": "r1",
        "model": "moe-tiny",
        "version": 17,
        "base_version": 16,
        "keyframe_version": 10,
        "kind": "delta",
        "created_ms": 1_732_000_010_000,
        "tensors": [tensor],
        "chunks": [
            {
                "index": 0,
                "nbytes": 180_442,
                "checksum": "0f" * 8,
                "ref": {"topic": "rl.r1.weights.chunks", "partition": 2, "offset": 9},
            }
        ],
        "chunk_topic": "rl.r1.weights.chunks",
        "state_hash": "ee" * 16,
        "base_state_hash": "dd" * 16,
        "raw_bytes": 8_388_608,
        "encoded_bytes": 180_442,
        "step_inputs": [{**REF, "topic": "rl.r1.admitted"}],
        "stats": {"loss": 0.0123, "kl": 1e-4, "mean_reward": 0.61},
        "codec_version": 1,
        "learner_epoch": 3,
        "hash_algorithm": "blake3",
    }
    chunk = {
        "run": "r1",
        "model": "moe-tiny",
        "version": 17,
        "index": 0,
        "count": 1,
        "checksum": "0f" * 8,
        "payload": bytes(range(256)) * 8,
    }
    feedback = {
        "feedback_id": "fb-9",
        "request_id": "req-1",
        "run": "r1",
        "policy_version": 17,
        "model": "moe-tiny",
        "action": "edited",
        "edit": "return 400",
        "prompt": "p",
        "completion": "c",
        **{k: v for k, v in _tokens(40).items()},
        "prompt_tokens": 10,
        "trajectory_ref": None,
        "task_class": "tab",
        "user_id_hash": "u" * 16,
        "client_created_ms": 1_732_000_011_000,
        "client_sent_ms": 1_732_000_011_020,
        "received_ms": 1_732_000_011_090,
        "metadata": {"editor": "1.2.3"},
    }
    run = {
        "run": "r1",
        "created_ms": 1_732_000_000_000,
        "updated_ms": 1_732_000_000_500,
        "status": "running",
        "config_json": json.dumps({"learner": {"lr": 1e-6}}),
        "seeds": {"scheduler": 1, "learner": 2},
        "code_version": "0.1.0+g9f1c2e",
        "model": "moe-tiny",
        "start_offsets": [{"topic": "rl.r1.admitted", "partition": 0, "offset": 0}],
        "topics": ["rl.r1.tasks", "rl.r1.admitted"],
        "regions": ["us", "eu"],
        "parent_run": None,
        "description": "smoke",
        "schemas": {"task": "a5" * 8},
        "weights_public_key": "ab" * 32,
        "weights_insecure": False,
        "excluded_records": [{**REF, "topic": "rl.r0.feedback", "offset": 3}],
        "excluded_user_hashes": ["9c" * 16],
        "recomputed_from": 4,
    }
    dead = {
        "source_topic": "rl.r1.trajectories", "partition": 3, "offset": 99, "key": b"g1",
        "value": b"\x00garbage", "headers": [{"key": "trace", "value": b"abc"}, {"key": "n", "value": None}],
        "timestamp_ms": 1_732_000_000_000, "reason": "bad_header", "error": "not an rlstream record",
        "failed_ms": 1_732_000_000_001, "consumer_group": "rlstream.r1.judge.tests",
        "fingerprint": None, "attempts": 1,
    }  # fmt: skip
    evaluation = {
        "run": "r1", "model": "policy", "version": 20, "task_set": "heldout-32-0123456789ab",
        "n_tasks": 32, "k": 4, "greedy_success": 0.4375, "pass_at_k": 0.65625,
        "sample_success": 0.3125, "by_family": {"fx": 0.4375}, "errors": 0, "released": True,
        "release_rule": "greedy_success 0.4375 >= v10 0.4062 - 0.05", "baseline_version": 10,
        "baseline_greedy_success": 0.40625, "evaluated_ms": 1_732_000_000_000,
        "duration_ms": 5400, "evaluator": "host:42",
    }  # fmt: skip
    audit = {
        "run": "r0", "new_run": "r1", "status": "finished", "user_hashes": ["9c" * 16],
        "requested_records": [], "excluded_records": [{**REF, "topic": "rl.r0.feedback"}],
        "first_affected_version": 4, "versions_differ": [4, 5, 6],
        "created_ms": 1_732_000_000_000,
    }  # fmt: skip
    capacity = {
        "run": "r1", "region": "eu", "published_ms": 1_732_000_000_000, "source": "trace:diurnal",
        "engines": 8, "dedicated": 2, "busy_engines": 2.5, "lent": 4, "headroom": 0.25,
        "slo_p99_ms": 2000.0, "serving_p99_ms": 850.0, "guard": "", "steady_ms": 95_000,
    }  # fmt: skip
    preempted = {
        "run": "r1", "group_id": "t-000042", "attempt": 0, "region": "eu", "worker_id": "eu-3",
        "policy_version": 17, "preempted_ms": 1_732_000_000_000, "generated_tokens": 640,
        "checkpoint": b"RLCK1\x28\xb5\x2f\xfd",
    }  # fmt: skip
    return {
        "task": task, "trajectory": trajectory, "reward": reward, "admission": admission,
        "weight_manifest": manifest, "weight_chunk": chunk, "feedback": feedback,
        "run_manifest": run, "dead_letter": dead, "eval": evaluation, "forget_audit": audit,
        "capacity": capacity, "preempted": preempted,
    }  # fmt: skip


EXAMPLES = examples()


def test_examples_cover_every_event() -> None:
    assert set(EXAMPLES) == set(E.EVENTS)


@pytest.mark.parametrize("event", sorted(E.EVENTS))
def test_round_trip_is_exact(event: str) -> None:
    record = EXAMPLES[event]
    data = E.serializer(event)(record, None)
    assert data[:2] == b"\xc3\x01"
    decoded = E.deserializer(expect=event)(data, None)
    assert decoded.event == event
    assert decoded.name == E.EVENTS[event]
    assert decoded.fingerprint == E.default_store().current(event)[0] == E.fingerprint_of(data)
    assert decoded.record == record
    assert E.encode(event, decoded.record) == data


def test_defaults_fill_omitted_fields() -> None:
    dropped = ("max_tokens", "attempt", "tags", "checkpoint")
    task = {k: v for k, v in EXAMPLES["task"].items() if k not in dropped}
    decoded = E.decode(E.encode("task", task)).record
    assert (decoded["max_tokens"], decoded["attempt"], decoded["tags"]) == (None, 0, {})


def test_arrays_survive_the_codec_zero_copy() -> None:
    record = E.decode(E.encode("trajectory", EXAMPLES["trajectory"])).record
    arrays = A.unpack_tokens(record)
    assert arrays.routed_experts.shape == (300, 4, 2)
    assert not arrays.token_ids.flags.writeable
    assert np.shares_memory(arrays.token_ids, np.frombuffer(record["token_ids"], np.uint8))


def _wide_tokens(n: int, layers: int = 3, top_k: int = 8, seed: int = 0) -> dict[str, Any]:
    """Token fields of a 384-expert policy: expert ids up to 383, 2 bytes wide."""
    rng = np.random.default_rng(seed)
    routes = rng.integers(0, 384, (n, layers, top_k))
    routes[0, 0, :2] = [383, 256]
    return A.pack_tokens(
        rng.integers(0, 151_000, n), np.zeros(n, np.float32), np.arange(n) >= 2, routes, 2
    )


@pytest.mark.parametrize("event", ["trajectory", "admission", "feedback"])
def test_384_expert_routes_survive_the_codec(event: str) -> None:
    record = dict(EXAMPLES[event])
    if event == "admission":
        samples = record["samples"]
        record["samples"] = [{**s, **_wide_tokens(40 + i, seed=i)} for i, s in enumerate(samples)]
        carriers = record["samples"]
    else:
        record.update(_wide_tokens(300))
        carriers = [record]
    decoded = E.decode(E.encode(event, record), expect=event).record
    assert decoded == record
    got = decoded["samples"] if event == "admission" else [decoded]
    for want, have in zip(carriers, got, strict=True):
        assert have["expert_bytes"] == 2
        routes = A.unpack_tokens(have).routed_experts
        assert routes.dtype == np.dtype("<u2") and int(routes.max()) == 383
        assert np.array_equal(routes, A.unpack_tokens(want).routed_experts)


def test_numpy_scalars_are_valid_values() -> None:
    reward = {
        **EXAMPLES["reward"],
        "score": np.float32(0.5),
        "sample_index": np.int64(5),
        "passed": np.bool_(True),
    }
    assert E.decode(E.encode("reward", reward)).record["sample_index"] == 5


BAD = [
    ("task", {"group_size": "16"}, "task.group_size: expected int"),
    ("task", {"seed": 2**63}, "task.seed: 9223372036854775808 is out of range"),
    ("task", {"max_turns": True}, "task.max_turns: expected int"),
    ("task", {"polciy_version": 3}, "unknown field(s) ['polciy_version']"),
    ("trajectory", {"token_ids": [1, 2, 3]}, "trajectory.token_ids: expected bytes"),
    ("trajectory", {"outcome": {"status": "done", "tool_calls": 0, "summarised": False}}, "trajectory.outcome.status: 'done' is not one of"),
    ("trajectory", {"turns": [{"index": 0}]}, "trajectory.turns[0].token_start: missing required field"),
    ("reward", {"trajectory": {"topic": "t", "partition": 0}}, "reward.trajectory.offset: missing required field"),
    ("admission", {"reason": "bored"}, "admission.reason: 'bored' is not one of"),
    ("admission", {"samples": [{}]}, "admission.samples[0].sample_index: missing required field"),
    ("weight_manifest", {"stats": {"loss": "low"}}, "weight_manifest.stats['loss']: expected double"),
    ("feedback", {"token_ids": 7}, "feedback.token_ids: expected bytes"),
    ("run_manifest", {"seeds": {1: 2}}, "run_manifest.seeds: expected a map with string keys"),
]  # fmt: skip


@pytest.mark.parametrize(("event", "change", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_record_names_the_field(event: str, change: dict[str, Any], message: str) -> None:
    record = {**EXAMPLES[event], **change}
    with pytest.raises(E.EventError, match="^invalid " + event) as info:
        E.serializer(event)(record, None)
    assert message in str(info.value)
    assert info.value.reason == "invalid_record"
    assert len(str(info.value)) < 400  # a clear message, not a dump of the record


def test_an_unvalidated_serializer_writes_the_same_bytes_and_still_refuses_wrong_types() -> None:
    record = EXAMPLES["feedback"]
    fast = E.serializer("feedback", validate=False)
    assert fast(record, None) == E.serializer("feedback")(record, None)
    with pytest.raises(E.EventError, match=r"^invalid feedback"):
        fast({**record, "token_ids": 7}, None)


def test_missing_top_level_field_and_non_mapping() -> None:
    record = {k: v for k, v in EXAMPLES["reward"].items() if k != "judge"}
    with pytest.raises(E.EventError, match=r"reward\.judge: missing required field"):
        E.encode("reward", record)
    with pytest.raises(E.EventError, match=r"expected a rlstream\.Reward record"):
        E.encode("reward", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(E.EventError, match="unknown event"):
        E.serializer("trajectories")


def _reason(data: Any, **kwargs: Any) -> str:
    with pytest.raises(E.DecodeError) as info:
        E.deserializer(**kwargs)(data, None)
    return info.value.reason


def test_decode_failures_are_decode_errors_with_reasons() -> None:
    good = E.encode("reward", EXAMPLES["reward"])
    assert _reason(None) == "bad_header"
    assert _reason(b"") == "bad_header"
    assert _reason(b'{"json": "is not avro"}') == "bad_header"
    assert _reason(b"\x00\x00\x00\x00\x01" + good[10:]) == "bad_header"  # Confluent framing
    assert _reason(E.MAGIC + b"\x01" * 8 + good[10:]) == "unknown_schema"
    assert _reason(good + b"\x00") == "corrupt_body"
    assert _reason(good, expect=["task", "trajectory"]) == "unexpected_event"
    with pytest.raises(E.EventError, match="unknown event"):
        E.deserializer(expect="rewards")


def test_every_truncation_is_a_decode_error() -> None:
    good = E.encode("reward", EXAMPLES["reward"])
    reasons = {_reason(good[:cut]) for cut in range(len(good))}
    assert reasons <= {"bad_header", "corrupt_body"}
    assert "corrupt_body" in reasons


def test_corrupted_bodies_never_raise_anything_else() -> None:
    good = E.encode("trajectory", {**EXAMPLES["trajectory"], **_tokens(8)})
    rng = np.random.default_rng(7)
    decode = E.deserializer()
    for _ in range(400):
        data = bytearray(good)
        for pos in rng.integers(E.HEADER_SIZE, len(data), rng.integers(1, 4)):
            data[pos] = int(rng.integers(0, 256))
        with contextlib.suppress(E.DecodeError):
            decode(bytes(data), None)


def test_fingerprint_of() -> None:
    data = E.encode("task", EXAMPLES["task"])
    assert E.fingerprint_of(data) == E.default_store().current("task")[0]
    assert E.fingerprint_of(b"\xc3\x01abc") is None
    assert E.fingerprint_of(b"\x00" * 20) is None
    assert E.fingerprint_of(None) is None


def test_wire_format_is_avro_single_object_encoding() -> None:
    """Any Avro library decodes our records with the schema published to rl.schemas."""
    store = E.default_store()
    published = dict(store.records())
    data = E.encode("weight_manifest", EXAMPLES["weight_manifest"])
    fp_hex = data[2:10].hex()
    canonical = published[fp_hex]
    assert fastavro.schema.fingerprint(canonical, "CRC-64-AVRO") == fp_hex
    plain = fastavro.schemaless_reader(
        io.BytesIO(data[10:]), fastavro.parse_schema(json.loads(canonical))
    )
    assert plain == EXAMPLES["weight_manifest"]


def test_avro_spec_fingerprint_vector() -> None:
    # from the Avro spec test suite: "int" -> 0x7275d51a3f395c8f, written little-endian
    assert E.fingerprint("int") == bytes.fromhex("8f5c393f1ad57572")


def test_store_round_trips_through_the_schemas_topic() -> None:
    source = E.default_store()
    rebuilt = E.SchemaStore(history=False)
    for key, value in source.records():
        assert rebuilt.add_record(key.encode(), value.encode()) == bytes.fromhex(key)
    assert source.fingerprints() <= rebuilt.fingerprints()
    data = E.encode("feedback", EXAMPLES["feedback"])
    assert E.deserializer(rebuilt)(data, None).record == EXAMPLES["feedback"]
    key, value = next(iter(source.records()))
    assert source.canonical(bytes.fromhex(key)) == value and source.canonical(b"\0" * 8) is None
    with pytest.raises(E.EventError, match="is not the fingerprint"):
        rebuilt.add_record("00" * 8, value)
    with pytest.raises(E.EventError, match="unusable Avro schema"):
        rebuilt.add("{not json")


def test_unknown_record_type_decodes_with_its_writer_schema() -> None:
    """A tool that learned a new event type from rl.schemas still decodes it."""
    store = E.SchemaStore(history=False)
    schema = {
        "type": "record",
        "name": "Future",
        "namespace": "rlstream",
        "fields": [{"name": "x", "type": "long"}],
    }
    fp = store.add(json.dumps(schema))
    out = io.BytesIO()
    out.write(E.MAGIC + fp)
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), {"x": 5})
    decoded = E.deserializer(store)(out.getvalue(), None)
    assert (decoded.event, decoded.name, decoded.record) == (
        "rlstream.Future",
        "rlstream.Future",
        {"x": 5},
    )


def test_schemas_layer_imports_nothing_of_ours() -> None:
    root = Path(E.__file__).resolve().parent
    allowed = {"numpy", "fastavro"}
    for name in ("events.py", "arrays.py", "topics.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: inside schemas/
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for module in names:
                top = module.split(".")[0]
                assert top in allowed or top == "__future__" or top in _stdlib(), (
                    f"{name} imports {module}"
                )


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)


def test_version_spans_survive_the_codec_and_splitting() -> None:
    """A sample generated across a swap (v15 wrote 200 tokens, v16 the rest): its spans read
    back exactly, from one record and from the segments it is split into (each carries them)."""
    spans = [
        {"version": 15, "token_start": 0, "token_end": 200},
        {"version": 16, "token_start": 200, "token_end": 300},
    ]
    record = {**EXAMPLES["trajectory"], "version_spans": spans, "routes_recorded": False}
    assert E.decode(E.encode("trajectory", record), expect="trajectory").record == record
    pieces = A.split_segments(record, 4_000)
    assert len(pieces) > 1 and all(p["version_spans"] == spans for p in pieces)
    decoded = [E.decode(E.encode("trajectory", p), expect="trajectory").record for p in pieces]
    assert A.join_segments(decoded) == record

"""The pure rules of lineage and forget: positions, request names, what a sample is built from."""

from __future__ import annotations

import pytest

from rlstream.ops.forensics.forget import hits, new_run_name
from rlstream.ops.forensics.lineage import Group, TracedSample, parse_position


def test_positions_parse_or_say_what_is_wrong() -> None:
    assert parse_position("rl.r1.feedback:2:42") == {
        "topic": "rl.r1.feedback",
        "partition": 2,
        "offset": 42,
    }
    assert parse_position("eu.rl.r1.trajectories:0:0")["topic"] == "eu.rl.r1.trajectories"
    for bad in ("rl.r1.feedback", "rl.r1.feedback:1", ":1:2", "t:x:2", "t:1:-2", "t:1:2:"):
        with pytest.raises(ValueError, match="TOPIC:PARTITION:OFFSET"):
            parse_position(bad)


def test_one_request_one_new_run_name() -> None:
    a = new_run_name("r1", ["h1", "h2"], [])
    assert a == new_run_name("r1", ["h2", "h1"], []) and a.startswith("r1-forget-")
    assert a != new_run_name("r1", ["h1"], [])
    assert len(new_run_name("r" * 64, ["h"], [])) <= 64


def _sample() -> TracedSample:
    ref = {"topic": "rl.r.served", "partition": 0, "offset": 5}
    feedback = {"topic": "rl.r.feedback", "partition": 0, "offset": 9}
    group = Group({"task_ref": None}, [("rl.r.admitted", 1, 3)])
    sample = {"trajectory": ref, "feedback": feedback, "reward_refs": []}
    return TracedSample(group, sample, feedback={"user_id_hash": "h-alice", "feedback_id": "f"})


def test_a_sample_is_hit_by_its_user_hash_or_any_position_it_names() -> None:
    s = _sample()
    assert hits(s, {"h-alice"}, set()) == {"h-alice"}
    assert hits(s, {"h-bob"}, set()) == set()
    assert hits(s, set(), {("rl.r.feedback", 0, 9)}) == {"rl.r.feedback:0:9"}
    assert hits(s, set(), {("rl.r.admitted", 1, 3)}) == {"rl.r.admitted:1:3"}
    assert hits(s, set(), {("rl.r.served", 0, 6)}) == set()

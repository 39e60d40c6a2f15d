"""The ACL planner: each role gets what its loop needs and nothing another role owns."""

from __future__ import annotations

import pytest

from rlstream.ops import acls
from rlstream.ops.roles import ROLES
from rlstream.schemas import topics

RUN = "r1"

#: Who may write each stream of a run: the one role (or two) whose output it is.
WRITERS = {
    "tasks": {"scheduler"},
    "trajectories": {"rollout"},
    "rewards": {"judge"},
    "admitted": {"admission", "feedback-rl"},
    "rejected": {"admission", "feedback-rl"},
    "weights.manifests": {"learner"},
    "weights.chunks": {"learner"},
    "feedback": set(),  # the feedback endpoint runs as admin, it is no role
    "served": set(),  # so does the policy server (`serve policy`)
    "evals": {"eval"},
    "dlq": {"rollout", "judge", "admission", "learner", "feedback-rl"},
}

#: The transactional id each role's code uses (see each role's module).
TXN_IDS = {
    "rollout": f"rlstream.{RUN}.rollout.trainer.0",
    "judge": f"rlstream.{RUN}.judge.tests.0",
    "admission": f"rlstream.{RUN}.admission.0",
    "learner": f"rlstream.{RUN}.learner.0",
    "feedback-rl": f"rlstream.{RUN}.feedback-rl.0",
    "eval": f"rlstream.{RUN}.eval",
}

#: The consumer group each role joins.
GROUPS = {
    "rollout": topics.group_id(RUN, "rollout"),
    "judge": topics.group_id(RUN, "judge", "tests"),
    "admission": topics.group_id(RUN, "admission"),
    "learner": topics.group_id(RUN, "learner"),
    "feedback-rl": topics.group_id(RUN, "feedback-rl"),
}


@pytest.fixture(scope="module")
def grants() -> list[acls.Grant]:
    return acls.plan(RUN)


def test_one_principal_per_role() -> None:
    assert set(acls.PRINCIPALS) == set(ROLES)


@pytest.mark.parametrize("stream", topics.RUN_STREAMS)
def test_only_the_owner_writes_a_stream(grants: list[acls.Grant], stream: str) -> None:
    name = topics.topic_name(RUN, stream)
    writers = {r for r in acls.PRINCIPALS if acls.allowed(grants, r, "topic", name, "write")}
    assert writers == WRITERS[stream]


def test_roles_read_what_their_loop_reads(grants: list[acls.Grant]) -> None:
    def reads(role: str, stream: str) -> bool:
        return acls.allowed(grants, role, "topic", topics.topic_name(RUN, stream), "read")

    assert reads("learner", "admitted") and reads("rollout", "tasks")
    assert reads("judge", "trajectories") and reads("admission", "rewards")
    assert not reads("rollout", "admitted") and not reads("judge", "admitted")
    assert not reads("learner", "trajectories")  # the learner sees admitted groups only
    assert reads("feedback-rl", "served")  # feedback naming a request id is looked up there
    for role in acls.PRINCIPALS:  # every decoder reads the writer schemas
        assert acls.allowed(grants, role, "topic", topics.SCHEMAS_TOPIC, "read")


def test_each_role_joins_its_own_group_only(grants: list[acls.Grant]) -> None:
    for role, group in GROUPS.items():
        assert acls.allowed(grants, role, "group", group, "read")
        for other, other_group in GROUPS.items():
            if other != role:
                assert not acls.allowed(grants, role, "group", other_group, "read"), (role, other)


def test_each_role_owns_its_transactional_ids_only(grants: list[acls.Grant]) -> None:
    assert not acls.allowed(grants, "scheduler", "transactional_id", TXN_IDS["rollout"], "write")
    for role, txn in TXN_IDS.items():
        assert acls.allowed(grants, role, "transactional_id", txn, "write")
        for other, other_txn in TXN_IDS.items():
            if other != role:
                assert not acls.allowed(grants, role, "transactional_id", other_txn, "write")


def test_a_run_grants_nothing_in_another_run(grants: list[acls.Grant]) -> None:
    for other_run in ("r2", "r10", "r1x"):  # "r1" is a prefix of the last two
        for role in acls.PRINCIPALS:
            for stream in topics.RUN_STREAMS:
                name = topics.topic_name(other_run, stream)
                for op in ("read", "write", "describe"):
                    assert not acls.allowed(grants, role, "topic", name, op)
            group = topics.group_id(other_run, "learner")
            assert not acls.allowed(grants, role, "group", group, "read")
            txn = f"rlstream.{other_run}.{role}.0"
            assert not acls.allowed(grants, role, "transactional_id", txn, "write")


def test_no_role_may_administer(grants: list[acls.Grant]) -> None:
    """Roles never create, alter or reach the cluster resource: only admin does. The one
    DELETE is the learner's on its weight chunks, which it prunes by keyframe count."""
    deletes = [g for g in grants if g.operation == "delete"]
    chunks = topics.topic_name(RUN, "weights.chunks")
    assert deletes == [acls.Grant("learner", "topic", "literal", chunks, "delete")]
    allowed = {"read", "write", "delete", "describe", "describe_configs"}
    assert {g.operation for g in grants} <= allowed
    assert {g.resource for g in grants} <= {"topic", "group", "transactional_id"}
    assert all(g.principal in acls.PRINCIPALS for g in grants)


def test_plan_is_sorted_and_deduplicated(grants: list[acls.Grant]) -> None:
    assert grants == sorted(set(grants)) == acls.plan(RUN)
    assert set(grants) == {g for r in acls.PRINCIPALS for g in acls.role_grants(RUN, r)}


def test_prefixes_end_at_a_separator(grants: list[acls.Grant]) -> None:
    """A prefixed grant ends with "." (or is the ``rlstream.`` group lookup), so it never
    reaches a longer run or role name."""
    assert all(g.name.endswith(".") for g in grants if g.pattern == "prefixed")


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown role"):
        acls.role_grants(RUN, "root")
    with pytest.raises(ValueError, match="invalid run name"):
        acls.plan("a.b")


def test_summary_lists_topics_group_and_ids() -> None:
    rollout = acls.summary(RUN)["rollout"]
    assert rollout["writes"] == ["rl.r1.trajectories", "rl.r1.dlq"]
    assert rollout["group"] == ["rlstream.r1.rollout"]
    assert rollout["transactional_ids"] == ["rlstream.r1.rollout", "rlstream.r1.rollout.*"]

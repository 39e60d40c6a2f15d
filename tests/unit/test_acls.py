"""The ACL planner: each role gets what its loop needs and nothing another role owns."""

from __future__ import annotations

import pytest

from rlstream.ops.run import acls
from rlstream.ops.run.roles import ROLES
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
    "feedback": {"feedback-ingest"},  # `serve feedback`, a service with its own user
    "served": {"policy-server"},  # `serve policy`, likewise
    "evals": {"eval"},
    "capacity": {"capacity"},
    "preempted": {"rollout"},
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


def test_one_principal_per_role_and_service() -> None:
    assert set(acls.PRINCIPALS) == set(ROLES) | {"feedback-ingest", "policy-server"}
    assert set(acls.SERVICES) == {"feedback-ingest", "policy-server", "vllm-follower"}


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
    assert rollout["writes"] == ["rl.r1.trajectories", "rl.r1.preempted", "rl.r1.dlq"]
    assert rollout["group"] == ["rlstream.r1.rollout"]
    assert rollout["transactional_ids"] == ["rlstream.r1.rollout", "rlstream.r1.rollout.*"]


EU = topics.Regions("trainer", ("eu",))
GEO = topics.Regions("trainer", ("eu", "us"))


def test_only_roles_whose_output_flows_home_run_in_a_rollout_region() -> None:
    assert acls.roles_in(EU, "eu") == ("rollout", "judge", "capacity")
    assert acls.roles_in(EU, "trainer") == acls.PRINCIPALS == acls.roles_in()
    here = {g.principal for g in acls.plan(RUN, regions=EU, here="eu")}
    assert here == {"rollout", "judge", "capacity"}
    for role in ("scheduler", "learner", "admission", "eval", "policy-server"):
        with pytest.raises(ValueError, match="does not run in rollout region"):
            acls.role_grants(RUN, role, EU, "eu")
    with pytest.raises(ValueError, match="not one of the run's regions"):
        acls.plan(RUN, regions=EU, here="us")


def test_a_rollout_worker_in_a_rollout_region_reads_the_trainer_regions_copies() -> None:
    """In eu the worker reads ``trainer.rl.RUN.tasks`` and the weight copies, never the local
    topic of an outward stream (nothing writes it there), and writes its trajectories locally,
    where MirrorMaker takes them home."""
    grants = acls.plan(RUN, regions=EU, here="eu")

    def may(op: str, name: str) -> bool:
        return acls.allowed(grants, "rollout", "topic", name, op)

    for stream in ("tasks", "weights.manifests", "weights.chunks"):
        name = topics.topic_name(RUN, stream)
        assert may("read", f"trainer.{name}") and not may("read", name), stream
    trajectories = topics.topic_name(RUN, "trajectories")
    assert may("write", trajectories) and not may("write", f"trainer.{trajectories}")
    assert not may("read", f"trainer.{topics.topic_name(RUN, 'evals')}")
    assert not any(may("write", f"trainer.{topics.topic_name(RUN, s)}") for s in topics.STREAMS)
    assert may("read", "trainer.rl.schemas") and may("write", "rl.schemas")
    assert not may("read", "trainer.rl.runs") and may("describe", "trainer.rl.runs")
    assert acls.allowed(grants, "rollout", "group", topics.group_id(RUN, "rollout"), "read")
    txn = f"rlstream.{RUN}.rollout.eu.0"
    assert acls.allowed(grants, "rollout", "transactional_id", txn, "write")


@pytest.mark.parametrize("here", GEO.names)
@pytest.mark.parametrize("stream", topics.RUN_STREAMS)
def test_a_role_reads_exactly_the_copies_its_region_accepts(here: str, stream: str) -> None:
    """Per region and stream: every role that reads the stream may read each copy
    ``Regions.sources`` names and no other copy of it; no role reads a copy of a stream it does
    not read; a copy is never written."""
    grants = acls.plan(RUN, regions=GEO, here=here)
    name = topics.topic_name(RUN, stream)
    every_copy = {name, *(f"{r}.{name}" for r in GEO.names)}
    accepted = {topics.remote_topic(s, name) for s in GEO.sources(stream, here)}
    for role in acls.roles_in(GEO, here):
        read = {t for t in every_copy if acls.allowed(grants, role, "topic", t, "read")}
        assert read == (accepted if stream in acls.ACCESS[role].reads else set()), role
        written = {t for t in every_copy if acls.allowed(grants, role, "topic", t, "write")}
        assert written <= {name}, role


def test_at_home_roles_read_every_rollout_regions_copies_of_the_inward_streams() -> None:
    grants = acls.plan(RUN, regions=GEO, here="trainer")
    for region in ("eu", "us"):
        for stream in ("trajectories", "rewards"):
            copy = f"{region}.{topics.topic_name(RUN, stream)}"
            assert acls.allowed(grants, "admission", "topic", copy, "read"), copy
            assert acls.allowed(grants, "learner", "topic", copy, "describe"), copy
            assert not acls.allowed(grants, "learner", "topic", copy, "read"), copy
        assert acls.allowed(grants, "judge", "topic", f"{region}.rl.{RUN}.trajectories", "read")
    assert not any(g.name.startswith("trainer.") for g in grants)  # nothing copied home from home


def test_a_region_describes_exactly_the_copies_it_receives() -> None:
    """So ``ensure_run_topics(..., regions, here)`` finds every copy it checks and creates
    none; no copy of another run, no other region's."""
    for here in GEO.names:
        grants = acls.plan(RUN, regions=GEO, here=here)
        copies = {topics.remote_topic(s, topics.topic_name(RUN, c)) for s, c in GEO.copies(here)}
        described = {
            g.name
            for g in grants
            if g.resource == "topic" and g.operation == "describe" and not g.name.startswith("rl.")
        }
        assert described == copies, here


def test_the_services_are_least_privileged(grants: list[acls.Grant]) -> None:
    """``serve feedback`` writes the feedback stream and reads it back (its durable dedupe);
    ``serve policy`` reads weights and releases and records what it served; neither joins a
    group or writes in a transaction."""

    def streams(user: str, op: str) -> set[str]:
        return {
            s
            for s in topics.RUN_STREAMS
            if acls.allowed(grants, user, "topic", topics.topic_name(RUN, s), op)
        }

    assert streams("feedback-ingest", "read") == streams("feedback-ingest", "write") == {"feedback"}
    assert streams("policy-server", "write") == {"served"}
    assert streams("policy-server", "read") == {"weights.manifests", "weights.chunks", "evals"}
    assert streams("vllm-follower", "write") == set()  # `serve vllm` only reads the weights
    assert streams("vllm-follower", "read") == {"weights.manifests", "weights.chunks"}
    for service in acls.SERVICES:
        writes = service != "vllm-follower"  # a writer announces its schemas
        assert acls.allowed(grants, service, "topic", "rl.schemas", "write") == writes
        assert not [g for g in grants if g.principal == service and g.operation == "delete"]
        assert not [
            g
            for g in grants
            if g.principal == service and g.resource != "topic" and g.operation != "describe"
        ]


def _link(run: str | None = RUN) -> dict[str, list[acls.Grant]]:
    """The grants of the link trainer <-> eu on each of its two clusters (fixed and run's)."""
    return {
        on: acls.mirror_grants("trainer", "eu", on) + acls.mirror_grants("trainer", "eu", on, run)
        for on in ("trainer", "eu")
    }


@pytest.mark.parametrize("stream", topics.RUN_STREAMS)
def test_a_link_reads_exactly_the_streams_that_flow(stream: str) -> None:
    """On the trainer region it reads the outward streams, in the rollout region the inward
    ones, and it writes each as the copy ``SRC.TOPIC`` on the other side only."""
    user, name, link = acls.mirror_user("eu"), topics.topic_name(RUN, stream), _link()
    direction = topics.STREAMS[stream].mirror
    assert acls.allowed(link["trainer"], user, "topic", name, "read") == (direction == "outward")
    assert acls.allowed(link["eu"], user, "topic", name, "read") == (direction == "inward")
    copy_in_eu = acls.allowed(link["eu"], user, "topic", f"trainer.{name}", "write")
    copy_home = acls.allowed(link["trainer"], user, "topic", f"eu.{name}", "write")
    assert copy_in_eu == (direction == "outward") and copy_home == (direction == "inward")
    for on in ("trainer", "eu"):  # never a local stream, never created by it
        assert not acls.allowed(link[on], user, "topic", name, "write")
        assert not acls.allowed(link[on], user, "topic", name, "create")


def test_a_link_writes_only_copies_and_its_own_internal_topics() -> None:
    for on, grants in _link().items():
        src = "eu" if on == "trainer" else "trainer"
        for g in grants:
            assert g.principal == acls.mirror_user("eu")
            if g.resource == "topic" and g.operation in ("write", "create", "alter"):
                own = g.name.startswith(f"{src}.") or g.name == acls.HEARTBEATS
                own |= g.name.startswith("mm2-") and g.name.endswith(".internal")
                assert own and g.pattern == "literal", g
    created = {g.name for g in _link()["eu"] if g.operation == "create"}
    assert {"trainer.rl.schemas", "trainer.rl.runs"} <= created  # the cluster topics flow out


def test_a_link_owns_its_worker_group_and_transactional_ids() -> None:
    """Exactly-once MirrorMaker 2: the tasks' ids ``SRC-mm2-CONNECTOR-TASK`` and the worker's
    ``connect-cluster-SRC-mm2`` (Connect's defaults for the herder group ``SRC-mm2``)."""
    user, link = acls.mirror_user("eu"), _link()
    eu, home = link["eu"], link["trainer"]
    assert acls.allowed(eu, user, "group", "trainer-mm2", "read")
    assert acls.allowed(
        eu, user, "transactional_id", "trainer-mm2-MirrorSourceConnector-0", "write"
    )
    assert acls.allowed(eu, user, "transactional_id", "connect-cluster-trainer-mm2", "write")
    assert acls.allowed(home, user, "transactional_id", "eu-mm2-MirrorSourceConnector-1", "write")
    assert not acls.allowed(home, user, "group", "us-mm2", "read")  # another link's worker
    assert not acls.allowed(
        home, user, "transactional_id", "us-mm2-MirrorSourceConnector-0", "write"
    )
    for grants in link.values():  # nothing of the roles'
        assert not any(g.name.startswith(topics.GROUP_PREFIX) for g in grants)
        assert not any(g.resource == "topic" and g.operation == "delete" for g in grants)


def test_two_links_share_no_copy() -> None:
    eu = acls.mirror_grants("trainer", "eu", "trainer", RUN)
    us = acls.mirror_grants("trainer", "us", "trainer", RUN)
    written = {(g.name, g.operation) for g in eu if g.operation == "write"}
    assert written and not written & {(g.name, g.operation) for g in us}
    assert acls.mirror_user("us") == "mirrormaker-us"


def test_a_link_joins_the_trainer_region_and_another() -> None:
    with pytest.raises(ValueError, match="link"):
        acls.mirror_grants("trainer", "eu", "us")
    with pytest.raises(ValueError, match="link"):
        acls.mirror_grants("trainer", "trainer", "trainer")
    with pytest.raises(ValueError, match="invalid region"):
        acls.mirror_user("e.u")

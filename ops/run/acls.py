"""Least-privilege ACLs per role, planned from the stream catalog: pure, no broker needed.

Every role and every ``rlstream serve`` service is its own principal; ``ACCESS`` states the
streams each reads and writes, and ``plan`` turns it into Kafka ACL grants for one run in one
region's cluster. Each MirrorMaker link runs as its own principal (``mirror_user``), and
``mirror_grants`` plans what it needs on both clusters of its link.

Rules a maintainer must keep:
- nothing but what the plan grants: no topic creation or deletion, no ACL or configuration
  change, no other role's groups or transactional ids; a MirrorMaker reads only what flows;
- in a rollout region only principals whose every output flows home get anything;
- ``plan`` is deterministic and names only the run's own topics, groups and transactional ids;
- a stream in ``ACCESS`` that the catalog does not declare is refused at import time.

Details: docs/security.md (The ACL plan).
"""

from __future__ import annotations

from collections.abc import Iterable

from rlstream.ops.cluster.link_acls import HEARTBEATS as HEARTBEATS
from rlstream.ops.cluster.link_acls import MIRROR_USER_PREFIX as MIRROR_USER_PREFIX
from rlstream.ops.cluster.link_acls import Grant as Grant
from rlstream.ops.cluster.link_acls import Operation as Operation
from rlstream.ops.cluster.link_acls import Pattern as Pattern
from rlstream.ops.cluster.link_acls import Resource as Resource
from rlstream.ops.cluster.link_acls import allowed as allowed
from rlstream.ops.cluster.link_acls import mirror_grants as mirror_grants
from rlstream.ops.cluster.link_acls import mirror_user as mirror_user
from rlstream.ops.run.roles import ROLES, RoleAccess
from rlstream.ops.run.roles import SERVICES as SERVED
from rlstream.schemas import topics

#: What each role and service reads and writes, from its declaration (``ops.run.roles``).
ACCESS: dict[str, RoleAccess] = {name: role.access for name, role in ROLES.items()}

SERVICES: tuple[str, ...] = tuple(SERVED.values())
"""The principals of ``rlstream serve feedback`` and ``rlstream serve policy``."""

PRINCIPALS: tuple[str, ...] = tuple(ACCESS)
"""The SCRAM user names of the roles and services (one each)."""


def _check_access() -> None:
    for role, access in ACCESS.items():
        unknown = set(access.reads) | set(access.writes) | set(access.prunes)
        unknown -= set(topics.RUN_STREAMS)
        if unknown:
            raise ValueError(f"role {role!r}: streams {sorted(unknown)} are not in the catalog")
    if not set(SERVICES) <= set(ACCESS):
        raise ValueError(f"services {SERVICES} must each have an ACCESS entry")


_check_access()

SINGLE_REGION = topics.Regions()
"""The default topology: one region, ``trainer``, where every stream is local."""


def _runs_remotely(access: RoleAccess) -> bool:
    """Whether a role may run in a rollout region: everything it writes flows home (or is the
    region's own dead letters)."""
    outputs = [s for s in access.writes if s != "dlq"]
    return bool(outputs) and all(topics.STREAMS[s].mirror == "inward" for s in outputs)


def roles_in(regions: topics.Regions = SINGLE_REGION, here: str | None = None) -> tuple[str, ...]:
    """The principals that may run in region ``here`` (default the trainer region): all of them
    in the trainer region, in a rollout region those whose output flows home."""
    here = regions.check(here or regions.trainer)
    if here == regions.trainer:
        return PRINCIPALS
    return tuple(r for r in PRINCIPALS if _runs_remotely(ACCESS[r]))


def _read_topics(run: str, stream: str, regions: topics.Regions, here: str) -> list[str]:
    """The topics of ``stream`` a role in ``here`` reads: local, or MirrorMaker's copies."""
    name = topics.topic_name(run, stream)
    return [topics.remote_topic(source, name) for source in regions.sources(stream, here)]


def _topic_grants(
    user: str, run: str, access: RoleAccess, regions: topics.Regions, here: str
) -> Iterable[Grant]:
    for stream in access.reads:
        for name in _read_topics(run, stream, regions, here):
            yield Grant(user, "topic", "literal", name, "read")
    for stream in access.writes:
        yield Grant(user, "topic", "literal", topics.topic_name(run, stream), "write")
    for stream in access.prunes:
        yield Grant(user, "topic", "literal", topics.topic_name(run, stream), "delete")
    run_prefix = f"{topics.PREFIX}.{topics.validate_name(run)}."
    copies = [topics.remote_topic(s, topics.topic_name(run, c)) for s, c in regions.copies(here)]
    for op in ("describe", "describe_configs"):
        yield Grant(user, "topic", "prefixed", run_prefix, op)
        for name in (topics.SCHEMAS_TOPIC, topics.RUNS_TOPIC, topics.AUDIT_TOPIC, *copies):
            yield Grant(user, "topic", "literal", name, op)
    for name in _read_topics(run, "schemas", regions, here):  # the copies of rl.schemas
        yield Grant(user, "topic", "literal", name, "read")
    yield Grant(user, "topic", "literal", topics.SCHEMAS_TOPIC, "read")  # and the local one
    if access.writes:
        yield Grant(user, "topic", "literal", topics.SCHEMAS_TOPIC, "write")


def _group_grants(user: str, run: str, role: str, access: RoleAccess) -> Iterable[Grant]:
    yield Grant(user, "group", "prefixed", f"{topics.GROUP_PREFIX}.", "describe")
    if access.group is not None:
        name = f"{topics.GROUP_PREFIX}.{topics.validate_name(run)}.{access.group}"
        yield Grant(user, "group", "prefixed" if access.group_prefix else "literal", name, "read")
    if access.transactional:
        txn = topics.group_id(run, role)
        yield Grant(user, "transactional_id", "literal", txn, "write")
        yield Grant(user, "transactional_id", "prefixed", f"{txn}.", "write")


def role_grants(
    run: str, role: str, regions: topics.Regions = SINGLE_REGION, here: str | None = None
) -> list[Grant]:
    """The ACLs of ``role`` in ``run`` on the cluster of region ``here`` (default the trainer
    region) of ``regions`` (see the module rules), sorted."""
    if role not in ACCESS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ACCESS)}")
    here = regions.check(here or regions.trainer)
    if role not in roles_in(regions, here):
        raise ValueError(
            f"role {role!r} does not run in rollout region {here!r} (only {roles_in(regions, here)}"
            ": what it writes would not flow home)"
        )
    access = ACCESS[role]
    grants = {
        *_topic_grants(role, run, access, regions, here),
        *_group_grants(role, run, role, access),
    }
    return sorted(grants)


def plan(
    run: str,
    roles: Iterable[str] | None = None,
    regions: topics.Regions = SINGLE_REGION,
    here: str | None = None,
) -> list[Grant]:
    """The ACLs, sorted and without duplicates, of ``roles`` (default every principal that runs
    in ``here``: ``roles_in``) for ``run`` on the cluster of region ``here`` of ``regions``."""
    chosen = roles_in(regions, here) if roles is None else tuple(roles)
    return sorted({g for role in chosen for g in role_grants(run, role, regions, here)})


def summary(
    run: str, regions: topics.Regions = SINGLE_REGION, here: str | None = None
) -> dict[str, dict[str, list[str]]]:
    """Per principal that runs in ``here``: the topics it reads and writes there, its group and
    its transactional ids."""
    out: dict[str, dict[str, list[str]]] = {}
    here = regions.check(here or regions.trainer)
    for role in roles_in(regions, here):
        access, grants = ACCESS[role], role_grants(run, role, regions, here)
        out[role] = {
            "reads": [t for s in access.reads for t in _read_topics(run, s, regions, here)],
            "writes": [topics.topic_name(run, s) for s in access.writes],
            "group": [
                g.shown_name for g in grants if g.resource == "group" and g.operation == "read"
            ],
            "transactional_ids": [g.shown_name for g in grants if g.resource == "transactional_id"],
        }
    return out

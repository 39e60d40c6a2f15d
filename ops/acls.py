"""Least-privilege ACLs per role, planned from the stream catalog: pure, no broker needed.

Every role of ``ops.roles.ROLES`` is its own principal (``User:ROLE``). ``ACCESS`` states, per
role, the streams it reads and writes; ``plan`` turns it into Kafka ACL grants for one run:

- read a stream: READ on its topic ``rl.RUN.STREAM`` (literal);
- write a stream: WRITE on its topic (literal);
- prune a stream (the learner's weight chunks, deleted by keyframe count): DELETE on its topic
  (literal), which DeleteRecords needs; Kafka has no narrower grant, so it would also let that
  role delete that one topic;
- every role: DESCRIBE and DESCRIBE_CONFIGS on the run's topics (prefix ``rl.RUN.``) and the
  cluster topics, so a starting role can check the topics exist (``ensure_run_topics``), READ
  on ``rl.schemas`` (decoders) and, if it writes anything, WRITE on it (writers announce their
  schema there);
- its consumer group ``rlstream.RUN.ROLE`` (the judge's ``rlstream.RUN.judge.NAME``, a prefix):
  READ, which lets it join, commit and commit offsets inside a transaction;
- its transactional ids ``rlstream.RUN.ROLE`` and ``rlstream.RUN.ROLE.*``: WRITE (which implies
  DESCRIBE);
- DESCRIBE on every group named ``rlstream.*``: a log reader (``consumers.read_to_end``) labels
  itself with such a group, joins none, but must find its coordinator. DESCRIBE lets a role
  look a group up and read its committed offsets; it cannot join one or commit to it.

Nothing else is allowed: no topic creation or deletion, no ACL or configuration change, no
other role's group or transactional ids. Topics are created by ``admin`` (``acl apply``).

Guarantees:
- ``plan`` is deterministic (sorted, no duplicates) and names only the run's own topics, groups
  and transactional ids (plus the two cluster topics and the ``rlstream.`` group lookups);
- a stream in ``ACCESS`` that the catalog does not declare is refused at import time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rlstream.schemas import topics

Resource = Literal["topic", "group", "transactional_id"]
Pattern = Literal["literal", "prefixed"]
Operation = Literal["read", "write", "delete", "describe", "describe_configs"]


@dataclass(frozen=True, slots=True)
class RoleAccess:
    """What one role does with Kafka, in the catalog's terms."""

    reads: tuple[str, ...]
    """Streams it consumes or reads to the end."""
    writes: tuple[str, ...]
    """Streams it produces to."""
    group: str | None
    """Suffix of its consumer group ``rlstream.RUN.<group>``; None: it joins no group."""
    group_prefix: bool = False
    """True when several groups share the suffix as a prefix (one judge group per rubric)."""
    transactional: bool = True
    """Whether it writes in transactions (ids ``rlstream.RUN.<role>`` or ``...<role>.*``)."""
    prunes: tuple[str, ...] = ()
    """Streams whose old records it deletes (``DeleteRecords``)."""


#: What each role reads and writes (see each role's module); keep in step with the roles.
ACCESS: dict[str, RoleAccess] = {
    "scheduler": RoleAccess(
        reads=("tasks", "weights.manifests", "admitted", "rejected"),
        writes=("tasks",),
        group=None,
        transactional=False,
    ),
    "rollout": RoleAccess(
        reads=("tasks", "weights.manifests", "weights.chunks"),
        writes=("trajectories", "dlq"),
        group="rollout",
    ),
    "judge": RoleAccess(
        reads=("trajectories",),
        writes=("rewards", "dlq"),
        group="judge.",
        group_prefix=True,
    ),
    "admission": RoleAccess(
        reads=("trajectories", "rewards", "weights.manifests", "admitted", "rejected"),
        writes=("admitted", "rejected", "dlq"),
        group="admission",
    ),
    "learner": RoleAccess(
        reads=("admitted", "weights.manifests", "weights.chunks"),
        writes=("weights.manifests", "weights.chunks", "dlq"),
        group="learner",
        prunes=("weights.chunks",),  # chunks no kept keyframe needs (producers.weight_retention)
    ),
    "feedback-rl": RoleAccess(
        reads=("feedback", "served", "trajectories", "weights.manifests", "admitted", "rejected"),
        writes=("admitted", "rejected", "dlq"),
        group="feedback-rl",
    ),
    "eval": RoleAccess(
        reads=("weights.manifests", "weights.chunks", "evals"),
        writes=("evals",),
        group=None,
    ),
}

PRINCIPALS: tuple[str, ...] = tuple(ACCESS)
"""The SCRAM user names of the roles (one per role)."""


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    """One ALLOW ACL: ``principal`` may do ``operation`` on the resource ``name``."""

    principal: str
    resource: Resource
    pattern: Pattern
    name: str
    operation: Operation

    @property
    def shown_name(self) -> str:
        """The resource name, with ``*`` after a prefix."""
        return self.name + ("*" if self.pattern == "prefixed" else "")

    def __str__(self) -> str:
        return f"User:{self.principal} {self.operation} {self.resource} {self.shown_name}"


def _check_access() -> None:
    for role, access in ACCESS.items():
        unknown = set(access.reads) | set(access.writes) | set(access.prunes)
        unknown -= set(topics.RUN_STREAMS)
        if unknown:
            raise ValueError(f"role {role!r}: streams {sorted(unknown)} are not in the catalog")


_check_access()


def _topic_grants(user: str, run: str, access: RoleAccess) -> Iterable[Grant]:
    for stream in access.reads:
        yield Grant(user, "topic", "literal", topics.topic_name(run, stream), "read")
    for stream in access.writes:
        yield Grant(user, "topic", "literal", topics.topic_name(run, stream), "write")
    for stream in access.prunes:
        yield Grant(user, "topic", "literal", topics.topic_name(run, stream), "delete")
    run_prefix = f"{topics.PREFIX}.{topics.validate_name(run)}."
    for op in ("describe", "describe_configs"):
        yield Grant(user, "topic", "prefixed", run_prefix, op)
        yield Grant(user, "topic", "literal", topics.SCHEMAS_TOPIC, op)
        yield Grant(user, "topic", "literal", topics.RUNS_TOPIC, op)
    yield Grant(user, "topic", "literal", topics.SCHEMAS_TOPIC, "read")
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


def role_grants(run: str, role: str) -> list[Grant]:
    """The ACLs of ``role`` in ``run`` (see the module rules), sorted."""
    if role not in ACCESS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ACCESS)}")
    access = ACCESS[role]
    grants = {*_topic_grants(role, run, access), *_group_grants(role, run, role, access)}
    return sorted(grants)


def plan(run: str, roles: Iterable[str] = PRINCIPALS) -> list[Grant]:
    """Every role's ACLs for ``run``, sorted and without duplicates."""
    return sorted({g for role in roles for g in role_grants(run, role)})


def allowed(grants: Iterable[Grant], user: str, resource: Resource, name: str, op: str) -> bool:
    """Whether ``grants`` let ``user`` do ``op`` on ``name``, as Kafka decides it: a literal
    grant matches the name, a prefixed one its start; READ and WRITE imply DESCRIBE."""
    implied = {op, "read", "write"} if op == "describe" else {op}
    for g in grants:
        if g.principal != user or g.resource != resource or g.operation not in implied:
            continue
        if g.name == name or (g.pattern == "prefixed" and name.startswith(g.name)):
            return True
    return False


def summary(run: str) -> dict[str, dict[str, list[str]]]:
    """Per role: the topics it reads and writes, its group and its transactional ids."""
    out: dict[str, dict[str, list[str]]] = {}
    for role, access in ACCESS.items():
        grants = role_grants(run, role)
        out[role] = {
            "reads": [topics.topic_name(run, s) for s in access.reads],
            "writes": [topics.topic_name(run, s) for s in access.writes],
            "group": [
                g.shown_name for g in grants if g.resource == "group" and g.operation == "read"
            ],
            "transactional_ids": [g.shown_name for g in grants if g.resource == "transactional_id"],
        }
    return out

"""The ACL value type (``Grant``, ``allowed``) and the ACLs of a MirrorMaker 2 link: what the
cluster writes when it secures a link, apart from any role (the roles' own grants and the rules
of both are in :mod:`rlstream.ops.run.acls`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rlstream.schemas import topics

Resource = Literal["topic", "group", "transactional_id"]
Pattern = Literal["literal", "prefixed"]
Operation = Literal[
    "read", "write", "create", "delete", "alter", "alter_configs", "describe", "describe_configs"
]


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


MIRROR_USER_PREFIX = "mirrormaker"
HEARTBEATS = "heartbeats"
"""MirrorMaker 2's heartbeats topic (on every cluster of a link; copied as ``SRC.heartbeats``)."""


def mirror_user(region: str) -> str:
    """The principal of the MirrorMaker 2 of the link between the trainer region and ``region``."""
    return f"{MIRROR_USER_PREFIX}-{topics.validate_name(region, 'region')}"


def mirror_grants(trainer: str, region: str, on: str, run: str | None = None) -> list[Grant]:
    """The ACLs, on the cluster of region ``on`` (``trainer`` or ``region``), of the MirrorMaker
    of the link between ``trainer`` and rollout region ``region``: the run-independent ones when
    ``run`` is None, else those of the run's streams (see the module rules), sorted."""
    topics.validate_name(trainer, "region")
    if trainer == region or on not in (trainer, region):
        raise ValueError(
            f"a link joins the trainer region {trainer!r} and another region; "
            f"{on!r} is not one of ({trainer!r}, {region!r})"
        )
    user = mirror_user(region)
    other = region if on == trainer else trainer
    outgoing: topics.Mirror = "outward" if on == trainer else "inward"
    incoming: topics.Mirror = "inward" if on == trainer else "outward"
    grants = {
        *_mirror_source_grants(user, other, _flowing(outgoing, run), run is None),
        *_mirror_target_grants(user, other, _flowing(incoming, run), run is None),
    }
    return sorted(grants)


def _flowing(direction: topics.Mirror, run: str | None) -> list[str]:
    """The topics of the streams that flow ``direction``: the run's, or the cluster-wide ones."""
    specs = [s for s in topics.STREAMS.values() if s.mirror == direction]
    if run is None:
        return [topics.cluster_topic(s.stream) for s in specs if s.cluster_wide]
    return [topics.topic_name(run, s.stream) for s in specs if not s.cluster_wide]


def _mirror_source_grants(user: str, dst: str, flowing: list[str], fixed: bool) -> Iterable[Grant]:
    """On a flow's source cluster: read what flows to ``dst``, keep its offset syncs."""
    copied = [*flowing, HEARTBEATS] if fixed else flowing
    for name in copied:
        yield Grant(user, "topic", "literal", name, "read")
        yield Grant(user, "topic", "literal", name, "describe_configs")
    if fixed:
        syncs = f"mm2-offset-syncs.{dst}.internal"
        for op in ("create", "read", "write"):
            yield Grant(user, "topic", "literal", syncs, op)


_COPY_OPS: tuple[Operation, ...] = ("create", "write", "alter", "alter_configs", "describe_configs")
"""On a remote copy: create it, write it, keep its partitions and configs in step."""
_INTERNAL_OPS: tuple[Operation, ...] = ("create", "read", "write", "describe_configs")
"""On a Connect internal topic: create it, read it back, write it, check its cleanup policy."""


def _mirror_target_grants(user: str, src: str, flowing: list[str], fixed: bool) -> Iterable[Grant]:
    """On a flow's target cluster: create and write the copies from ``src``; when ``fixed``,
    also the heartbeats, the Connect worker's topics, group and transactional ids."""
    copies = [topics.remote_topic(src, t) for t in flowing]
    if fixed:
        copies.append(f"{src}.{HEARTBEATS}")
    for name in copies:
        for op in _COPY_OPS:
            yield Grant(user, "topic", "literal", name, op)
    if not fixed:
        return
    yield Grant(user, "topic", "literal", HEARTBEATS, "create")
    yield Grant(user, "topic", "literal", HEARTBEATS, "write")
    for name in _connect_topics(src):
        for op in _INTERNAL_OPS:
            yield Grant(user, "topic", "literal", name, op)
    worker_group = f"{src}-mm2"  # MirrorMakerConfig's default group.id of the herder
    yield Grant(user, "group", "literal", worker_group, "read")
    yield Grant(user, "transactional_id", "prefixed", f"{worker_group}-", "write")
    yield Grant(user, "transactional_id", "literal", f"connect-cluster-{worker_group}", "write")


def _connect_topics(src: str) -> tuple[str, ...]:
    """The internal topics of the Connect worker that writes the copies from ``src``."""
    return tuple(f"mm2-{kind}.{src}.internal" for kind in ("offsets", "status", "configs"))


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

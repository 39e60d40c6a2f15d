"""Topic administration: create a run's topics from the catalog idempotently, report drift.

``apply_topics`` creates missing topics with the catalog's partitions and configs, and compares
existing ones: a partition count or config that differs is *drift*, reported, never silently
changed (repartitioning a keyed stream would break per-group ordering and co-partitioning).

In a multi-region run each region's cluster gets the run's topics plus the MirrorMaker 2 copies
it receives (``topics.Regions.copies``: ``trainer.rl.RUN.tasks`` in a rollout region,
``eu.rl.RUN.trajectories`` at home), created with the catalog's partitions and configs before
MirrorMaker's topic refresh would create them: a role subscribes to a copy from its first poll,
and a copy keeps its source's partitioning (MirrorMaker keeps each record's partition).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas.errors import SetupError

if TYPE_CHECKING:
    from rlstream.schemas.topics import Regions


@dataclass(frozen=True)
class TopicWant:
    """A topic as it should be: name, partitions and topic-level configs."""

    name: str
    partitions: int
    configs: Mapping[str, str] = field(default_factory=dict)


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    drift: dict[str, list[str]] = field(default_factory=dict)


def admin_client(settings: KafkaSettings) -> AdminClient:
    conf: dict[str, Any] = {**settings.librdkafka()}
    return AdminClient(conf)


_UNREACHABLE = {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN}
_UNAUTHENTICATED = {
    KafkaError._AUTHENTICATION,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._SSL,
}
_REFUSED = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.POLICY_VIOLATION,
    KafkaError.INVALID_CONFIG,
    KafkaError.INVALID_REPLICATION_FACTOR,
}


def setup_error(exc: KafkaException, where: str, doing: str) -> SetupError | KafkaException:
    """A cluster that cannot be reached, logged into or asked this, as one line with the cause
    and the fix (``SetupError``); any other error as it was."""
    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    if err is None:
        return exc
    code, said = err.code(), err.str()
    if code in _UNREACHABLE:
        return SetupError(
            f"no Kafka answers at {where} ({doing}: {said}): is the cluster up "
            "(`rlstream cluster status` for the local one)? For an existing cluster check "
            "--bootstrap / RLSTREAM_BOOTSTRAP and that this host reaches it"
        )
    if code in _UNAUTHENTICATED:
        return SetupError(
            f"Kafka at {where} refused this client's login ({said}): check the credentials "
            "(RLSTREAM_KAFKA_* or the recipe's [regions.clusters] entry and its password "
            "variable) and the CA bundle"
        )
    if code in _REFUSED:
        return SetupError(
            f"Kafka at {where} refused {doing} ({said}): this user may not create or describe "
            "the run's topics, or the cluster's limits refuse their settings; see "
            "docs/launch.md (what the cluster must allow) and `rlstream acl show`"
        )
    return exc


def apply_topics(
    admin: AdminClient, wants: list[TopicWant], timeout: float = 30.0, where: str | None = None
) -> ApplyReport:
    """Create the missing topics of ``wants`` and report drift on the existing ones; a cluster
    that cannot be reached or refuses is a ``SetupError`` saying so (``setup_error``)."""
    report = ApplyReport()
    try:
        return _apply(admin, wants, report, timeout)
    except KafkaException as exc:
        raise setup_error(exc, where or "the cluster", "making the run's topics") from exc


def _apply(
    admin: AdminClient, wants: list[TopicWant], report: ApplyReport, timeout: float
) -> ApplyReport:
    # replication_factor=-1 takes the cluster's default.replication.factor.
    existing = admin.list_topics(timeout=timeout).topics
    missing = [w for w in wants if w.name not in existing]
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(w.name, w.partitions, replication_factor=-1, config=dict(w.configs))
                for w in missing
            ],
            operation_timeout=timeout,
        )
        for name, future in futures.items():
            try:
                future.result()
                report.created.append(name)
            except KafkaException as exc:
                if exc.args[0].code() != 36:  # TOPIC_ALREADY_EXISTS: a concurrent apply won
                    raise
                report.unchanged.append(name)
        _wait_visible(admin, report.created, timeout)
    present = [w for w in wants if w.name in existing]
    for want, problems in zip(present, _drift(admin, present, existing, timeout), strict=True):
        if problems:
            report.drift[want.name] = problems
        else:
            report.unchanged.append(want.name)
    return report


def _wait_visible(admin: AdminClient, names: list[str], timeout: float) -> None:
    """Return once every topic of ``names`` is in the cluster's metadata with a leader for each
    partition. The controller answers a creation before the brokers' metadata holds the topic:
    a reader started right after took the new topic for missing and followed nothing (a
    feedback replica's dedupe, seen on a loaded machine). Past ``timeout`` it returns anyway:
    readers still retry a passing metadata error themselves."""
    deadline, pause = time.monotonic() + timeout, 0.05
    waiting = set(names)
    while waiting and time.monotonic() < deadline:
        topics = admin.list_topics(timeout=timeout).topics
        for name in list(waiting):
            meta = topics.get(name)
            if meta is None or meta.error is not None or not meta.partitions:
                continue
            if all(p.leader >= 0 for p in meta.partitions.values()):
                waiting.discard(name)
        if waiting:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


def _drift(
    admin: AdminClient, wants: list[TopicWant], existing: Mapping[str, Any], timeout: float
) -> list[list[str]]:
    if not wants:
        return []
    resources = [ConfigResource(ConfigResource.Type.TOPIC, w.name) for w in wants]
    described = admin.describe_configs(resources, request_timeout=timeout)
    results = []
    for want, resource in zip(wants, resources, strict=True):
        problems = []
        have_parts = len(existing[want.name].partitions)
        if have_parts != want.partitions:
            problems.append(f"partitions: have {have_parts}, catalog says {want.partitions}")
        configs = described[resource].result()
        for key, value in want.configs.items():
            have = configs[key].value if key in configs else None
            if have != value:
                problems.append(f"{key}: have {have}, catalog says {value}")
        results.append(problems)
    return results


def delete_topics(admin: AdminClient, names: list[str], timeout: float = 30.0) -> None:
    if not names:
        return
    for future in admin.delete_topics(names, operation_timeout=timeout).values():
        future.result()


def group_lag(admin: AdminClient, group: str, timeout: float = 10.0) -> dict[str, int]:
    """Per-topic lag of a consumer group: end offsets minus committed offsets, summed."""
    request = [ConsumerGroupTopicPartitions(group)]
    result = admin.list_consumer_group_offsets(request, request_timeout=timeout)
    committed = result[group].result().topic_partitions or []
    if not committed:
        return {}
    from confluent_kafka.admin import OffsetSpec

    ends = admin.list_offsets(
        {TopicPartition(tp.topic, tp.partition): OffsetSpec.latest() for tp in committed},
        request_timeout=timeout,
    )
    lag: dict[str, int] = {}
    for tp in committed:
        end = ends[TopicPartition(tp.topic, tp.partition)].result().offset
        lag[tp.topic] = lag.get(tp.topic, 0) + max(0, end - max(tp.offset, 0))
    return lag


def run_topic_wants(
    run: str,
    specs: Mapping[str, Any] | None = None,
    copies: Iterable[tuple[str | None, str]] = (),
) -> list[TopicWant]:
    """The catalog's topics for ``run`` plus the cluster-wide ``rl.schemas`` and ``rl.runs``,
    and the mirrored copies named by ``copies`` (source region, stream)."""
    from rlstream.schemas import topics

    specs = specs or topics.STREAMS
    wants = [
        TopicWant(topics.topic_name(run, name), spec.partitions, topics.topic_configs(spec))
        for name, spec in specs.items()
    ]
    for source, stream in copies:
        spec = specs[stream]
        name = topics.remote_topic(source, topics.topic_name(run, stream))
        wants.append(TopicWant(name, spec.partitions, topics.topic_configs(spec)))
    return wants


def ensure_run_topics(
    settings: KafkaSettings,
    run: str,
    partitions: int | None = None,
    *,
    regions: Regions | None = None,
    here: str | None = None,
) -> ApplyReport:
    """Create or check every topic of ``run`` (``partitions`` for the group-keyed streams) in
    one cluster; with ``regions`` (a ``topics.Regions``) and ``here``, also the copies that
    region ``here`` receives."""
    from rlstream.schemas import topics

    specs = topics.catalog(group_partitions=partitions) if partitions else topics.STREAMS
    copies = regions.copies(here) if regions is not None and here is not None else []
    wants = run_topic_wants(run, specs, copies)
    return apply_topics(admin_client(settings), wants, where=settings.bootstrap_servers)


def ensure_cluster_topics(settings: KafkaSettings) -> ApplyReport:
    """Create or check the cluster-wide topics ``rl.schemas`` and ``rl.runs``."""
    from rlstream.schemas import topics

    wants = [
        TopicWant(topics.cluster_topic(name), spec.partitions, topics.topic_configs(spec))
        for name, spec in topics.STREAMS.items()
        if spec.cluster_wide
    ]
    return apply_topics(admin_client(settings), wants, where=settings.bootstrap_servers)

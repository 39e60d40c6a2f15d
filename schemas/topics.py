"""The topic catalog: every stream of a run, its key, partitions, retention and size limits.

Names: ``rl.RUN.STREAM`` per run, ``rl.schemas`` and ``rl.runs`` cluster-wide, remote copies
prefixed with their source region; consumer groups ``rlstream.RUN.ROLE[.NAME]``. A stream's
``mirror`` direction decides where it flows, and ``Regions.sources`` which copies a role reads.

Guarantees:
- names are validated (``[A-Za-z0-9_-]``, no dots), so derived names parse back unambiguously;
- trajectories, rewards, admitted and rejected share one partition count and the group-id key;
  feedback and served share the request-id key and one partition count;
- no mirrored copy can ever feed the learner;
- every stream's ``max_message_bytes`` fits its largest record (producers and consumers must
  raise ``message.max.bytes`` and ``fetch.max.bytes`` to match).

Details: docs/streams.md (The topic catalog).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

PREFIX = "rl"
GROUP_PREFIX = "rlstream"
SCHEMAS_TOPIC = "rl.schemas"
RUNS_TOPIC = "rl.runs"
AUDIT_TOPIC = "rl.audit"
"""Forget audit records (``rlstream forget``), kept forever."""
MIB = 1024 * 1024
DAY_MS = 24 * 3600 * 1000
FOREVER = -1
CHUNK_PAYLOAD_BYTES = 1 * MIB
"""Largest payload the learner puts in one WeightChunk."""
VALUE_HEADROOM = 64 * 1024
"""Room left under max.message.bytes for key, headers and batch overhead."""
DEFAULT_GROUP_PARTITIONS = 6
DEFAULT_TASK_PARTITIONS = 12
MAX_NAME_LENGTH = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_GROUP_STREAMS = ("trajectories", "rewards", "admitted", "rejected")

Cleanup = Literal["delete", "compact"]
Mirror = Literal["outward", "inward", "none"]


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One stream of the design and the Kafka settings of its topic."""

    stream: str
    """Stream name: the STREAM of rl.RUN.STREAM, or the cluster topic's suffix."""
    key_doc: str
    """What the Kafka key is (it decides partitioning and ordering)."""
    partitions: int
    retention_ms: int
    """Time retention; -1 keeps records forever (the run's record)."""
    cleanup_policy: Cleanup
    max_message_bytes: int
    event: str
    """Short event name of the values (a key of ``EVENTS``); "" for rl.schemas (schema JSON)."""
    key_fields: tuple[str, ...] = ()
    """Record fields whose values, joined by "/", form the key (see ``record_key``)."""
    cluster_wide: bool = False
    """True for rl.schemas and rl.runs, which belong to no run."""
    mirror: Mirror = "none"
    """MirrorMaker 2 direction: outward from the trainer region, inward to it, or none."""

    @property
    def max_value_bytes(self) -> int:
        """Largest record value to produce: ``max_message_bytes`` minus ``VALUE_HEADROOM``."""
        return self.max_message_bytes - VALUE_HEADROOM


def catalog(
    group_partitions: int = DEFAULT_GROUP_PARTITIONS, task_partitions: int = DEFAULT_TASK_PARTITIONS
) -> Mapping[str, StreamSpec]:
    """Every stream by name. Rule: the group-keyed streams all get ``group_partitions``."""
    if group_partitions < 1 or task_partitions < 1:
        raise ValueError("partition counts must be >= 1")
    g, spec = group_partitions, StreamSpec
    specs = [
        spec("tasks", "task id", task_partitions, 7 * DAY_MS, "delete", 4 * MIB, "task", ("task_id",), mirror="outward"),
        spec("trajectories", "group id", g, 7 * DAY_MS, "delete", 8 * MIB, "trajectory", ("group_id",), mirror="inward"),
        spec("rewards", "group id", g, 7 * DAY_MS, "delete", 1 * MIB, "reward", ("group_id",), mirror="inward"),
        spec("admitted", "group id", g, FOREVER, "delete", 8 * MIB, "admission", ("group_id",)),
        spec("rejected", "group id", g, 30 * DAY_MS, "delete", 8 * MIB, "admission", ("group_id",)),
        spec("weights.manifests", "model name", 1, FOREVER, "delete", 4 * MIB, "weight_manifest", ("model",), mirror="outward"),
        spec("weights.chunks", "MODEL/VERSION/INDEX", 6, FOREVER, "delete", CHUNK_PAYLOAD_BYTES + 256 * 1024, "weight_chunk", ("model", "version", "index"), mirror="outward"),
        spec("feedback", "request id", 6, 30 * DAY_MS, "delete", 4 * MIB, "feedback", ("request_id",)),
        spec("served", "request id", 6, 30 * DAY_MS, "delete", 8 * MIB, "trajectory", ("group_id",)),
        spec("evals", "MODEL/VERSION", 1, FOREVER, "delete", 1 * MIB, "eval", ("model", "version"), mirror="outward"),
        spec("capacity", "region", 1, 7 * DAY_MS, "delete", 1 * MIB, "capacity", ("region",), mirror="inward"),
        spec("preempted", "group id", g, 7 * DAY_MS, "delete", 8 * MIB, "preempted", ("group_id",), mirror="inward"),
        spec("dlq", "original topic", 1, 30 * DAY_MS, "delete", 16 * MIB, "dead_letter", ("source_topic",)),
        spec("schemas", "schema fingerprint (hex)", 1, FOREVER, "compact", 1 * MIB, "", cluster_wide=True, mirror="outward"),
        spec("runs", "run name", 1, FOREVER, "compact", 4 * MIB, "run_manifest", ("run",), cluster_wide=True, mirror="outward"),
        spec("audit", "run name", 1, FOREVER, "delete", 4 * MIB, "forget_audit", ("run",), cluster_wide=True, mirror="outward"),
    ]  # fmt: skip
    return MappingProxyType({s.stream: s for s in specs})


STREAMS: Mapping[str, StreamSpec] = catalog()
"""The default catalog."""
RUN_STREAMS = tuple(name for name, s in STREAMS.items() if not s.cluster_wide)
CO_PARTITIONED = _GROUP_STREAMS
REQUEST_STREAMS = ("feedback", "served")
"""Streams keyed by the served request id, with one partition count."""


def with_partitions(spec: StreamSpec, partitions: int) -> StreamSpec:
    """A copy of ``spec`` with another partition count (use ``catalog`` for group streams)."""
    return replace(spec, partitions=partitions)


def check_copartitioned(specs: Mapping[str, StreamSpec]) -> None:
    """Raise ``ValueError`` unless the group-keyed streams share one partition count."""
    counts = {name: specs[name].partitions for name in _GROUP_STREAMS if name in specs}
    if len(set(counts.values())) > 1:
        raise ValueError(f"group-keyed streams must be co-partitioned, got {counts}")


def validate_name(name: str, what: str = "run") -> str:
    """Return ``name`` if it is a legal run/role/region name, else raise ``ValueError``.

    Rule: 1-64 characters from [A-Za-z0-9_-], starting with a letter or digit; no dots, since
    dots separate the parts of topic and group names.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"invalid {what} name {name!r}: use 1-{MAX_NAME_LENGTH} characters from "
            "[A-Za-z0-9_-], starting with a letter or digit"
        )
    return name


def _spec(stream: str, specs: Mapping[str, StreamSpec] | None = None) -> StreamSpec:
    specs = STREAMS if specs is None else specs
    if stream not in specs:
        raise ValueError(f"unknown stream {stream!r}; known: {sorted(specs)}")
    return specs[stream]


def topic_name(run: str, stream: str) -> str:
    """``rl.RUN.STREAM`` for a per-run stream; the fixed name for ``schemas`` and ``runs``."""
    if _spec(stream).cluster_wide:
        return f"{PREFIX}.{stream}"
    return f"{PREFIX}.{validate_name(run)}.{stream}"


def cluster_topic(stream: str) -> str:
    """Name of a cluster-wide topic: ``rl.schemas`` or ``rl.runs``."""
    if not _spec(stream).cluster_wide:
        raise ValueError(f"{stream!r} is a per-run stream; use topic_name(run, stream)")
    return f"{PREFIX}.{stream}"


def run_topics(run: str) -> dict[str, str]:
    """Topic name of every per-run stream of ``run``, by stream."""
    return {stream: topic_name(run, stream) for stream in RUN_STREAMS}


@dataclass(frozen=True, slots=True)
class TopicName:
    """A parsed topic name: ``region`` is set for a MirrorMaker 2 remote copy."""

    region: str | None
    run: str | None
    stream: str


def parse_topic(topic: str) -> TopicName:
    """Inverse of ``topic_name``, also for remote copies ``REGION.rl.RUN.STREAM``.

    Raises ``ValueError`` for a topic that is not an rlstream topic.
    """
    parts = topic.split(".")
    region = None
    if parts and parts[0] != PREFIX:
        region, parts = parts[0], parts[1:]
    if (
        len(parts) == 2
        and parts[0] == PREFIX
        and parts[1] in STREAMS
        and STREAMS[parts[1]].cluster_wide
    ):
        return TopicName(region, None, parts[1])
    if len(parts) >= 3 and parts[0] == PREFIX:
        stream = ".".join(parts[2:])
        if stream in STREAMS and not STREAMS[stream].cluster_wide and _NAME.fullmatch(parts[1]):
            return TopicName(region, parts[1], stream)
    raise ValueError(f"{topic!r} is not an rlstream topic (rl.RUN.STREAM or REGION.rl.RUN.STREAM)")


def remote_topic(source: str | None, topic: str) -> str:
    """``topic`` as seen where MirrorMaker 2 copies it from region ``source`` (the default
    replication policy's ``SOURCE.TOPIC``); ``topic`` itself for a local one (``source`` None)."""
    return topic if source is None else f"{validate_name(source, 'region')}.{topic}"


def topic_pattern(run: str, stream: str, sources: Iterable[str | None] = (None,)) -> str:
    """Regex subscription (leading ``^``, as librdkafka requires) for a stream of a run.

    It matches the copies of the stream written in ``sources``: None is the local topic, a
    region name its MirrorMaker 2 copy (``Regions.sources`` says which a role accepts). The
    default is the local topic only.
    """
    local = re.escape(topic_name(run, stream))
    wanted = list(dict.fromkeys(sources))
    if not wanted:
        raise ValueError(f"no source region for {stream!r}")
    prefixes = [re.escape(validate_name(s, "region")) + r"\." for s in wanted if s is not None]
    if not prefixes:
        return f"^{local}$"
    optional = "?" if None in wanted else ""
    # librdkafka's regex engine has plain groups only (no ``(?:``)
    return f"^({'|'.join(prefixes)}){optional}{local}$"


def streams_pattern(run: str, streams: Iterable[str] = RUN_STREAMS) -> str:
    """One regex subscription for several streams of a run and their remote copies from any
    region: for taps and dashboards, which read everything and write nothing."""
    alternatives = "|".join(re.escape(topic_name(run, s)) for s in streams)
    return f"^([A-Za-z0-9_-]+\\.)?({alternatives})$"


def mirror_regex(direction: Mirror, specs: Mapping[str, StreamSpec] | None = None) -> str:
    """MirrorMaker 2's topic filter for the streams of ``direction``, for every run: local names
    only (``rl.RUN.STREAM``, ``rl.schemas``), never a copy that came from elsewhere."""
    specs = STREAMS if specs is None else specs
    run_streams = [
        re.escape(s.stream) for s in specs.values() if s.mirror == direction and not s.cluster_wide
    ]
    wide = [
        re.escape(cluster_topic(s.stream))
        for s in specs.values()
        if s.mirror == direction and s.cluster_wide
    ]
    parts = [f"rl\\.{_NAME.pattern}\\.(?:{'|'.join(run_streams)})"] if run_streams else []
    if not parts and not wide:
        raise ValueError(f"no stream flows {direction}")
    return "|".join(parts + wide)


@dataclass(frozen=True, slots=True)
class Regions:
    """Where a run's roles run: the trainer region and the rollout regions (see the module rules).

    The trainer region hosts scheduler, admission, judges and learner (and may host rollout
    workers too); rollout regions host rollout workers. A run with no rollout region is the
    single-region case: every stream is local.
    """

    trainer: str = "trainer"
    rollout: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        validate_name(self.trainer, "region")
        for name in self.rollout:
            validate_name(name, "region")
        if self.trainer in self.rollout or len(set(self.rollout)) != len(self.rollout):
            raise ValueError(
                f"regions must be distinct: trainer {self.trainer!r}, rollout {self.rollout}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """Every region, the trainer region first."""
        return (self.trainer, *self.rollout)

    def check(self, region: str) -> str:
        if region not in self.names:
            raise ValueError(f"region {region!r} is not one of the run's regions {self.names}")
        return region

    def sources(self, stream: str, here: str) -> tuple[str | None, ...]:
        """Which copies of ``stream`` a role in region ``here`` reads: None for the local topic,
        a region name for its mirrored copy (only regions that may write the stream)."""
        direction = _spec(stream).mirror
        if self.check(here) != self.trainer and direction == "outward":
            return (self.trainer,)
        if here == self.trainer and direction == "inward":
            return (None, *self.rollout)
        return (None,)

    def pattern(self, run: str, stream: str, here: str) -> str:
        """The subscription of a role in ``here`` to ``stream`` (``topic_pattern`` of ``sources``)."""
        return topic_pattern(run, stream, self.sources(stream, here))

    def topic(self, run: str, stream: str, here: str) -> str:
        """The one topic of ``stream`` a role in ``here`` reads when it reads a single copy (the
        weight manifests and chunks in a rollout region: the trainer region's copy)."""
        first = self.sources(stream, here)[0]
        return remote_topic(first, topic_name(run, stream))

    def copies(self, here: str) -> list[tuple[str | None, str]]:
        """(source, stream) of every mirrored copy region ``here`` receives."""
        return [(s, stream) for stream in STREAMS for s in self.sources(stream, here) if s]

    def origin(self, topic: str, here: str) -> str:
        """The region whose roles wrote a record of ``topic`` read in ``here``."""
        prefix = parse_topic(topic).region
        return self.check(here) if prefix is None else self.check(prefix)


def role_of_group(run: str, group: str) -> str | None:
    """``ROLE[.NAME]`` of a group id ``rlstream.RUN.ROLE[.NAME]`` (see ``group_id``); None for
    any other group."""
    head = f"{GROUP_PREFIX}.{run}."
    return group[len(head) :] if group.startswith(head) and len(group) > len(head) else None


def group_id(run: str, role: str, name: str | None = None) -> str:
    """Consumer group id ``rlstream.RUN.ROLE[.NAME]`` (e.g. ``rlstream.r1.judge.tests``)."""
    parts = [GROUP_PREFIX, validate_name(run), validate_name(role, "role")]
    if name is not None:
        parts.append(validate_name(name, "name"))
    return ".".join(parts)


def record_key(stream: str, record: Mapping[str, Any]) -> bytes:
    """The Kafka key of ``record`` on ``stream``: its key fields joined by "/", UTF-8.

    Rule: the key is derived from the record, never chosen by the producer, so every writer of a
    stream partitions the same way (rl.schemas records are keyed by ``SchemaStore.records``).
    """
    spec = _spec(stream)
    if not spec.key_fields:
        raise ValueError(f"the key of {stream!r} records is not a record field ({spec.key_doc})")
    try:
        return "/".join(str(record[f]) for f in spec.key_fields).encode("utf-8")
    except KeyError as exc:
        raise ValueError(f"{stream} record lacks key field {exc.args[0]!r}") from exc


def topic_configs(spec: StreamSpec, min_insync_replicas: int | None = None) -> dict[str, str]:
    """Kafka topic configs (``kafka-topics --config`` / AdminClient ``NewTopic.config``).

    Rule: compacted topics keep their latest record per key forever; time-retained topics delete
    whole segments after ``retention_ms``; producers' timestamps are kept (CreateTime).
    """
    configs = {
        "cleanup.policy": spec.cleanup_policy,
        "retention.ms": str(FOREVER if spec.cleanup_policy == "compact" else spec.retention_ms),
        "max.message.bytes": str(spec.max_message_bytes),
        "message.timestamp.type": "CreateTime",
    }
    if spec.cleanup_policy == "compact":
        # keep tombstones a day so a slow consumer still sees a deletion
        configs["delete.retention.ms"] = str(DAY_MS)
    if min_insync_replicas is not None:
        configs["min.insync.replicas"] = str(min_insync_replicas)
    return configs

"""MirrorMaker 2 in dedicated mode: the processes of each link between the trainer region and a
rollout region, their flows derived from the stream catalog.

A flow ``SRC->DST:REGEX`` copies topics of region SRC whose names match REGEX to region DST.
``link_flows`` derives a link's two flows from ``schemas.topics``: the outward streams (tasks,
weights, runs, schemas) from the trainer region to the rollout region, the inward streams
(trajectories, rewards) home. The default replication policy names the copy ``SRC.TOPIC`` on DST,
and ``topics.Regions`` says which copies each role reads.

Guarantees:
- only committed data crosses: MirrorMaker's consumers read ``read_committed`` on every cluster,
  so records of an aborted transaction (a rolled-back weight publish, an aborted rollout) are
  never copied; and it writes with Kafka's exactly-once support for source connectors
  (``exactly.once.source.support``, Kafka 3.5+ in dedicated mode), so a MirrorMaker that dies
  mid-copy neither loses nor duplicates what it copied when it restarts;
- processes per link: a rollout region going dark (its broker and its MirrorMaker) leaves the
  other links running. Across a WAN a link has two, each in the region it writes to (``targets``:
  remote fetch, local exactly-once produce): the outward flow's in the rollout region, the flow
  home's in the trainer region (``cluster._link_processes``);
- on a secured cluster it connects to each cluster as its link's user (``acls.mirror_user``)
  over SASL_SSL (``security.mirror_client_properties``), within the ACLs ``acls.mirror_grants``
  plans; its properties file then holds that user's password and is 0600;
- topic lists are refreshed every two seconds (the MirrorMaker default is ten minutes) so the
  topics a run creates are mirrored promptly; the task restart this causes may take up to 30 s
  to stop the old tasks before the new ones start.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlstream.ops.cluster import artifacts, procs, security
from rlstream.ops.cluster.broker import LOG4J2, Region
from rlstream.schemas.errors import SetupError

MARKER = "org.apache.kafka.connect.mirror.MirrorMaker"
FLOW = re.compile(r"^(?P<src>[A-Za-z0-9_-]+)->(?P<dst>[A-Za-z0-9_-]+):(?P<regex>.+)$")


@dataclass(frozen=True)
class Flow:
    src: str
    dst: str
    regex: str

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}:{self.regex}"


def parse_flow(text: str) -> Flow:
    match = FLOW.match(text.strip())
    if not match:
        raise ValueError(
            f"bad mirror flow {text!r}: expected SRC->DST:REGEX, e.g. "
            r"'trainer->eu:rl\..*\.tasks'"
        )
    try:
        re.compile(match["regex"])
    except re.error as exc:
        raise ValueError(f"bad topic regex in mirror flow {text!r}: {exc}") from exc
    return Flow(match["src"], match["dst"], match["regex"])


def link_flows(trainer: str, region: str) -> list[Flow]:
    """The two flows of the link between the trainer region and rollout region ``region``."""
    from rlstream.schemas import topics

    return [
        Flow(trainer, region, topics.mirror_regex("outward")),
        Flow(region, trainer, topics.mirror_regex("inward")),
    ]


@dataclass
class Mirror:
    """One MirrorMaker 2 process (a link); persisted in the cluster state file."""

    home: str
    name: str = "mirror"
    flows: list[str] = field(default_factory=list)
    pid: int | None = None
    targets: list[str] = field(default_factory=list)
    """The clusters it writes to (MirrorMaker's ``--clusters``); empty: every flow's target."""

    @property
    def dir(self) -> Path:
        return Path(self.home) / "mirror" / self.name

    @property
    def properties(self) -> Path:
        return self.dir / "mm2.properties"

    @property
    def log(self) -> Path:
        return self.dir / "logs" / "mirror.log"

    def running(self) -> bool:
        return procs.alive(self.pid, str(self.properties))

    def to_dict(self) -> dict:
        return asdict(self)


def mm2_properties(
    flows: list[Flow],
    regions: dict[str, Region],
    user: str | None = None,
    via: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> str:
    """The MirrorMaker 2 config: one replication per (src, dst), its topic regexes or-ed; a
    secured region is reached as ``user``; a region named in ``via`` through that bootstrap
    (a WAN link's, ``ops.cluster.wan``) instead of its own; ``extra`` settings come last and
    win (``cluster up --mirror-set``)."""
    via = via or {}
    names = sorted({f.src for f in flows} | {f.dst for f in flows})
    missing = [n for n in names if n not in regions]
    if missing:
        raise ValueError(
            f"mirror flow names unknown region(s) {missing}; started: {sorted(regions)}"
        )
    lines = [f"clusters = {', '.join(names)}"]
    lines += [f"{n}.bootstrap.servers = {via.get(n, regions[n].bootstrap)}" for n in names]
    # Connectors and converters come from their ServiceLoader manifests only: the reflective
    # classpath scan costs seconds per herder at start-up. Each herder takes its worker settings
    # from its target cluster's properties, so the setting is given per cluster too.
    lines += ["plugin.discovery = service_load"]
    lines += [f"{n}.plugin.discovery = service_load" for n in names]
    for n in names:
        if regions[n].secure:
            if user is None:
                raise ValueError(f"region {n} is secured: MirrorMaker 2 needs a user")
            lines += security.mirror_client_properties(Path(regions[n].home), n, user)
    pairs: dict[tuple[str, str], list[str]] = {}
    for flow in flows:
        pairs.setdefault((flow.src, flow.dst), []).append(flow.regex)
    for (src, dst), regexes in sorted(pairs.items()):
        lines += [
            f"{src}->{dst}.enabled = true",
            f"{src}->{dst}.topics = {'|'.join(f'(?:{r})' for r in regexes)}",
        ]
    for name in names:
        # Only committed records cross; written with exactly-once support on every target.
        lines += [
            f"{name}.consumer.isolation.level = read_committed",
            f"{name}.exactly.once.source.support = enabled",
        ]
    lines += [
        "replication.factor = 1",
        "checkpoints.topic.replication.factor = 1",
        "heartbeats.topic.replication.factor = 1",
        "offset-syncs.topic.replication.factor = 1",
        "offset.storage.replication.factor = 1",
        "status.storage.replication.factor = 1",
        "config.storage.replication.factor = 1",
        "sync.topic.acls.enabled = false",
        "refresh.topics.interval.seconds = 2",
        "refresh.groups.interval.seconds = 5",
        # No consumer group is translated across regions (every role reads its own region).
        "emit.checkpoints.enabled = false",
        "sync.group.offsets.enabled = false",
        "tasks.max = 2",
        # A new run's topics restart the tasks. A task still starting can take longer than the
        # default 5 s to stop (seen in the geo tests) and is then abandoned, still running,
        # beside its successor; dedicated mode has no API to restart a task that fails.
        "task.shutdown.graceful.timeout.ms = 30000",
        # Weight chunks and long trajectories exceed the 1 MB client defaults.
        "producer.max.request.size = 16777216",
        "consumer.max.partition.fetch.bytes = 16777216",
        "consumer.fetch.max.bytes = 33554432",
        # A link without a WAN runs both flows in one process, one of them producing to the
        # other region: each produce request carries one batch per partition, so the 16 KiB
        # default batch held a 1.1 MiB group to ~70 requests (3.0 s at 40 ms RTT, measured
        # before a WAN link split its flows; docs/kafka.md, "A WAN between regions").
        "producer.batch.size = 1048576",
        "producer.linger.ms = 5",
    ]
    lines += [f"{key} = {value}" for key, value in (extra or {}).items()]
    return "\n".join(lines) + "\n"


def start(
    home: Path,
    flows: list[Flow],
    regions: dict[str, Region],
    heap: str = "384m",
    timeout: float = 120.0,
    name: str = "mirror",
    user: str | None = None,
    via: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
    targets: list[str] | None = None,
) -> Mirror:
    """Start one MirrorMaker 2 process for ``flows`` (``targets``: only the herders writing to
    those clusters run in it, MirrorMaker's ``--clusters``); returns once it has started."""
    mirror = Mirror(
        home=str(home), name=name, flows=[str(f) for f in flows], targets=list(targets or [])
    )
    mirror.dir.mkdir(parents=True, exist_ok=True)
    mirror.log.parent.mkdir(parents=True, exist_ok=True)
    text = mm2_properties(flows, regions, user, via, extra)
    if user is not None:  # it holds the user's password
        security.write_private(mirror.properties, text.encode())
    else:
        mirror.properties.write_text(text)
    (mirror.dir / "log4j2.properties").write_text(
        LOG4J2.format(log=mirror.log).replace(
            "logger.apache.level = warn", "logger.apache.level = info"
        )
    )
    cmd = [
        artifacts.java_binary(),
        "-Xms128m",
        f"-Xmx{heap}",
        *artifacts.jvm_performance_options(),
        f"-Dlog4j2.configurationFile={mirror.dir / 'log4j2.properties'}",
        "-cp",
        artifacts.classpath(),
        MARKER,
        str(mirror.properties),
        *(["--clusters", *mirror.targets] if mirror.targets else []),
    ]
    proc = procs.spawn(cmd, mirror.dir / "logs" / "stdout.log", cwd=mirror.dir)
    mirror.pid = proc.pid
    try:
        _wait_started(mirror, proc, timeout)
    except BaseException:
        stop(mirror)  # never leave a half-started MirrorMaker behind
        raise
    return mirror


def _wait_started(mirror: Mirror, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SetupError(
                f"MirrorMaker 2 exited during start-up (status {proc.returncode}). Last lines "
                f"of {mirror.log}:\n{procs.tail(mirror.log)}\n"
                f"{procs.tail(mirror.dir / 'logs' / 'stdout.log', 10)}"
            )
        text = mirror.log.read_text(errors="replace") if mirror.log.exists() else ""
        if "Kafka MirrorMaker started" in text:
            return
        time.sleep(0.5)
    raise SetupError(
        f"MirrorMaker 2 did not start within {timeout:.0f}s. Last lines of {mirror.log}:\n"
        f"{procs.tail(mirror.log)}"
    )


def stop(mirror: Mirror) -> None:
    if mirror.pid:
        procs.stop(mirror.pid, str(mirror.properties))
    mirror.pid = None

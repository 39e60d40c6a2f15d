"""One region's Kafka on loopback: one KRaft node, or a replicated region of several.

Every node runs in combined mode (broker and controller in one JVM): a 3-node region is 3 JVMs
where split roles would be 6 (3 controllers, 3 brokers), and on a small machine each JVM's fixed
cost (heap floor, JIT and GC threads) matters more than isolating the quorum from the data path.
The quorum is static (``controller.quorum.voters`` names every node).

Rules:
- a region of ``n`` nodes keeps ``min(n, 3)`` copies of every topic it creates (the broker's
  ``default.replication.factor``; run topics are created with it), the offsets topic and the
  transaction state log included, and ``min.insync.replicas`` 2 when it has 3 copies: with
  producers at ``acks=all`` a write is on two brokers before it is acknowledged, so one broker
  can die at any moment without losing an acknowledged record or stopping writes;
- each node has its own rack id (``REGION-rN``), so replicas spread over them;
- clients bootstrap from every node of the region: a dead node is not a dead bootstrap;
- storage is formatted on first start only; later starts reuse the data (topics survive `down`);
- ports are chosen free at first start and kept, so clients and MirrorMaker configs stay valid
  and reconnect by themselves after a restart; a restart waits a while for a kept port to be
  released, and only if it stays taken are new ones chosen (the static quorum allows it);
- the broker is ready when the admin client lists topics through the advertised listener;
- a secured region (``secure``, chosen at its first start and kept) gets the listeners, the
  authorizer and the admin credential of ``ops.cluster.security``; its properties file is 0600.
"""

from __future__ import annotations

import base64
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlstream.ops.cluster import artifacts, procs, security, wan
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime.ports import free_port
from rlstream.schemas.derive import derive
from rlstream.schemas.errors import SetupError

MARKER = "kafka.Kafka"  # with the properties path, identifies our broker process
PORT_WAIT_S = 30.0
MAX_BROKERS = 5  # a replicated region on one machine: 3 is the point, 5 the most that fits  # how long a restart waits for its kept ports before it takes new ones

LOG4J2 = """\
status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = warn
logger.apache.name = org.apache.kafka
logger.apache.level = warn
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = info
"""


@dataclass
class Node:
    """One KRaft node (broker and controller) of a region."""

    node_id: int
    broker_port: int
    controller_port: int
    pid: int | None = None


@dataclass
class Region:
    """What we know about one region's brokers; persisted in the cluster state file. Node 1's
    ports and pid are the region's own fields (a one-broker region is just that); the nodes
    of a replicated region past the first are ``peers``."""

    name: str
    home: str
    broker_port: int
    controller_port: int
    pid: int | None = None
    cluster_id: str = ""
    secure: bool = False
    peers: list[Node] = field(default_factory=list)
    # WAN links into this (the trainer) region, by rollout region: per node, in ``nodes()``
    # order, [the broker's listener port for the link, the link's proxy port] (``ops.cluster.wan``)
    links: dict[str, list[list[int]]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: dict) -> Region:
        peers = [Node(**n) for n in doc.get("peers") or []]
        return cls(**{**doc, "peers": peers})

    @property
    def brokers(self) -> int:
        return 1 + len(self.peers)

    def nodes(self) -> list[Node]:
        """Every node, node 1 first (a copy of it: change its pid with ``set_pid``)."""
        return [Node(1, self.broker_port, self.controller_port, self.pid), *self.peers]

    def node(self, node_id: int) -> Node:
        for n in self.nodes():
            if n.node_id == node_id:
                return n
        raise ValueError(f"region {self.name} has no node {node_id} (it has {self.brokers})")

    def set_pid(self, node_id: int, pid: int | None) -> None:
        if node_id == 1:
            self.pid = pid
        else:
            next(p for p in self.peers if p.node_id == node_id).pid = pid

    def node_dir(self, node_id: int) -> Path:
        return self.dir if node_id == 1 else self.dir / f"node-{node_id}"

    def node_properties(self, node_id: int) -> Path:
        return self.node_dir(node_id) / "server.properties"

    def node_log(self, node_id: int) -> Path:
        return self.node_dir(node_id) / "logs" / "server.log"

    def node_running(self, node_id: int) -> bool:
        return procs.alive(self.node(node_id).pid, str(self.node_properties(node_id)))

    def node_settings(self, node_id: int) -> KafkaSettings:
        """Admin settings that reach ``node_id`` alone (its readiness, its own view)."""
        port = self.node(node_id).broker_port
        return derive(self.settings(), bootstrap_servers=f"127.0.0.1:{port}")

    def add_link(self, region: str) -> bool:
        """Ports for ``region``'s WAN link into this region; True if new (the brokers take the
        link's listener at their next start)."""
        if region in self.links:
            return False
        if self.secure:
            raise SetupError(
                f"a WAN link into the secured region {self.name} is not supported: its link "
                "listener would need TLS and SASL too"
            )
        self.links[region] = [[free_port(), free_port()] for _ in self.nodes()]
        return True

    def link_bootstrap(self, region: str) -> str:
        """How a client in rollout region ``region`` reaches this region: through the link."""
        return ",".join(f"127.0.0.1:{proxy}" for _, proxy in self.links[region])

    def settings(self, user: str = security.ADMIN) -> KafkaSettings:
        """How ``user`` (``admin`` or a role's user when secured) reaches this region."""
        if not self.secure:
            return KafkaSettings(bootstrap_servers=self.bootstrap)
        return security.client_settings(Path(self.home), self.bootstrap, user)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.broker_port}" for n in self.nodes())

    @property
    def dir(self) -> Path:
        return Path(self.home) / self.name

    @property
    def properties(self) -> Path:
        return self.dir / "server.properties"

    @property
    def log(self) -> Path:
        return self.dir / "logs" / "server.log"

    @property
    def stdout_log(self) -> Path:
        return self.dir / "logs" / "stdout.log"

    def running(self) -> bool:
        """Every node of the region runs."""
        return all(self.node_running(n.node_id) for n in self.nodes())

    def serving(self) -> bool:
        """A majority of the region's nodes runs (its quorum can elect leaders)."""
        alive = sum(self.node_running(n.node_id) for n in self.nodes())
        return alive > self.brokers // 2

    def to_dict(self) -> dict:
        return asdict(self)


def new_region(name: str, home: Path, secure: bool = False, brokers: int = 1) -> Region:
    if secure:
        security.ensure_secrets(home)
    if not 1 <= brokers <= MAX_BROKERS:
        raise ValueError(f"a region runs 1 to {MAX_BROKERS} brokers, not {brokers}")
    peers = [Node(i, free_port(), free_port()) for i in range(2, brokers + 1)]
    return Region(
        name=name,
        home=str(home),
        broker_port=free_port(),
        controller_port=free_port(),
        secure=secure,
        peers=peers,
    )


def default_heap(brokers: int) -> str:
    """The JVM heap of one broker of a region of ``brokers`` nodes when none is asked for: 1g
    alone; 512m each when replicated (two regions of 3 stay within a small machine's memory;
    measured in docs/kafka.md)."""
    return "1g" if brokers == 1 else "512m"


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of a region of ``brokers`` nodes: up to 3
    copies; 2 must acknowledge once there are 3 (one broker may die, writes go on)."""
    factor = min(brokers, 3)
    return factor, 2 if factor >= 3 else 1


def _properties(region: Region, node: Node) -> str:
    data = region.node_dir(node.node_id) / "data"
    factor, min_isr = replication(region.brokers)
    voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in region.nodes())
    index = [n.node_id for n in region.nodes()].index(node.node_id)
    # one listener per WAN link, advertising the link's proxy (ops.cluster.wan)
    links = [(wan.listener_name(r), ports[index]) for r, ports in sorted(region.links.items())]
    lines = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        "listeners": ",".join(
            [
                f"PLAINTEXT://127.0.0.1:{node.broker_port}",
                f"CONTROLLER://127.0.0.1:{node.controller_port}",
                *(f"{name}://127.0.0.1:{listen}" for name, (listen, _) in links),
            ]
        ),
        "advertised.listeners": ",".join(
            [
                f"PLAINTEXT://127.0.0.1:{node.broker_port}",
                *(f"{name}://127.0.0.1:{proxy}" for name, (_, proxy) in links),
            ]
        ),
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": ",".join(
            ["CONTROLLER:PLAINTEXT", "PLAINTEXT:PLAINTEXT", *(f"{n}:PLAINTEXT" for n, _ in links)]
        ),
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data),
        "num.partitions": "1",
        "broker.rack": f"{region.name}-r{node.node_id}",
        "default.replication.factor": str(factor),
        "min.insync.replicas": str(min_isr),
        "offsets.topic.replication.factor": str(factor),
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(factor),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        # An out-of-sync replica never becomes leader: that would drop acknowledged records.
        "unclean.leader.election.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "message.max.bytes": str(16 * 1024 * 1024),
        "log.segment.bytes": str(256 * 1024 * 1024),
        # Transactions abort quickly after a producer dies, so tests of crashes stay short.
        "transaction.max.timeout.ms": str(15 * 60 * 1000),
    }
    if region.secure:
        lines.update(
            security.broker_properties(Path(region.home), node.broker_port, node.controller_port)
        )
    return "".join(f"{key}={value}\n" for key, value in lines.items())


def _ports_free(node: Node, wait: float) -> bool:
    """Whether the node's kept ports are free, waiting up to ``wait`` seconds for a broker
    that just died to release them: clients and MirrorMaker reconnect only to the same port."""
    deadline = time.monotonic() + wait
    while True:
        if not (procs.port_in_use(node.broker_port) or procs.port_in_use(node.controller_port)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def _write_config(region: Region, node: Node) -> None:
    folder = region.node_dir(node.node_id)
    folder.mkdir(parents=True, exist_ok=True)
    region.node_log(node.node_id).parent.mkdir(parents=True, exist_ok=True)
    props, text = region.node_properties(node.node_id), _properties(region, node)
    if region.secure:  # it holds the admin password of the inter-broker link
        security.write_private(props, text.encode())
    else:
        props.write_text(text)
    (folder / "log4j2.properties").write_text(LOG4J2.format(log=region.node_log(node.node_id)))


def _java(folder: Path, heap: str) -> list[str]:
    return [
        artifacts.java_binary(),
        f"-Xms{min(256, _megabytes(heap))}m",
        f"-Xmx{heap}",
        *artifacts.jvm_performance_options(),
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={folder / 'log4j2.properties'}",
        "-cp",
        artifacts.classpath(),
    ]


def _megabytes(heap: str) -> int:
    """The size of a JVM heap setting (``768m``, ``1g``) in MiB."""
    units = {"k": 1 / 1024, "m": 1, "g": 1024}
    unit = heap[-1].lower()
    return int(float(heap[:-1]) * units[unit]) if unit in units else int(heap) // 2**20


def _cluster_id() -> str:
    """A Kafka cluster id (base64 of a UUID) that does not start with "-": the storage tool
    would read one that does as an option and refuse to format."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _format(region: Region, node: Node, heap: str) -> None:
    folder = region.node_dir(node.node_id)
    if (folder / "data" / "meta.properties").exists():
        return
    formatted = [region.node_dir(n.node_id) / "data" / "meta.properties" for n in region.nodes()]
    if not region.cluster_id or not any(f.exists() for f in formatted):
        region.cluster_id = _cluster_id()  # a new region; its other nodes join this id
    cmd = [
        *_java(folder, heap),
        "kafka.tools.StorageTool",
        "format",
        "-t",
        region.cluster_id,
        "-c",
        str(region.node_properties(node.node_id)),
        *(security.format_args(Path(region.home)) if region.secure else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(
            f"formatting Kafka storage for region {region.name} failed:\n{proc.stdout}{proc.stderr}"
        )


def start(
    region: Region, heap: str = "1g", timeout: float = 120.0, only: list[int] | None = None
) -> Region:
    """Start the region's nodes that are not running (``only``: just those), formatting
    storage the first time, and wait until each serves. The nodes of a replicated region start
    side by side: none serves before a majority of the quorum runs."""
    wanted = [n for n in region.nodes() if only is None or n.node_id in only]
    started: dict[int, subprocess.Popen] = {}
    try:
        for node in wanted:
            if not region.node_running(node.node_id):
                started[node.node_id] = _spawn(region, node, heap)
        for node_id, proc in started.items():
            wait_ready(region, timeout, proc, node_id)
    except BaseException:
        for node_id in started:  # never leave a broker that did not come up running
            stop(region, only=[node_id])
        raise
    return region


def _spawn(region: Region, node: Node, heap: str) -> subprocess.Popen:
    if not _ports_free(node, wait=PORT_WAIT_S):
        if region.brokers > 1:  # the other nodes' quorum and clients name these ports
            raise SetupError(
                f"the ports of node {node.node_id} of region {region.name} "
                f"({node.broker_port}, {node.controller_port}) stay taken; free them first"
            )
        region.broker_port, region.controller_port = free_port(), free_port()
        node = region.node(1)
    _write_config(region, node)
    _format(region, node, heap)
    folder = region.node_dir(node.node_id)
    cmd = [*_java(folder, heap), MARKER, str(region.node_properties(node.node_id))]
    proc = procs.spawn(cmd, folder / "logs" / "stdout.log", cwd=folder)
    region.set_pid(node.node_id, proc.pid)
    return proc


def wait_ready(
    region: Region, timeout: float, proc: subprocess.Popen | None = None, node_id: int = 1
) -> None:
    """Wait until node ``node_id`` of the region answers a metadata request on its own port."""
    from confluent_kafka.admin import AdminClient

    settings = region.node_settings(node_id)
    conf = {**settings.librdkafka(), "log_level": 0, "logger": _silent_logger()}
    admin = AdminClient(conf)
    log = region.node_log(node_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (proc.poll() is not None) if proc else not region.node_running(node_id):
            stdout = region.node_dir(node_id) / "logs" / "stdout.log"
            raise SetupError(
                f"the Kafka broker of region {region.name} (node {node_id}) exited during "
                f"start-up. Last lines of {log}:\n{procs.tail(log)}\n{procs.tail(stdout, 10)}"
            )
        try:
            admin.list_topics(timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    raise SetupError(
        f"the Kafka broker of region {region.name} (node {node_id}) did not answer on "
        f"{settings.bootstrap_servers} within {timeout:.0f}s. Last lines of {log}:\n"
        f"{procs.tail(log)}"
    )


def _silent_logger():
    import logging

    logger = logging.getLogger("rlstream.cluster.admin")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger


def stop(region: Region, only: list[int] | None = None) -> None:
    """Stop the region's nodes (``only``: just those), side by side."""
    nodes = [n for n in region.nodes() if only is None or n.node_id in only]
    procs.stop_all(targets(region, nodes))
    for node in nodes:
        region.set_pid(node.node_id, None)


def targets(region: Region, nodes: list[Node] | None = None) -> list[tuple[int, str]]:
    """``(pid, marker)`` of the region's running nodes, for ``procs.stop_all``."""
    nodes = region.nodes() if nodes is None else nodes
    return [(n.pid, str(region.node_properties(n.node_id))) for n in nodes if n.pid]

"""One region's Kafka: a single KRaft node in combined mode (broker + controller) on loopback.

Rules:
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
from dataclasses import asdict, dataclass
from pathlib import Path

from rlstream.ops.cluster import artifacts, procs, security
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas.errors import SetupError

MARKER = "kafka.Kafka"  # with the properties path, identifies our broker process
PORT_WAIT_S = 30.0  # how long a restart waits for its kept ports before it takes new ones

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
class Region:
    """What we know about one region's broker; persisted in the cluster state file."""

    name: str
    home: str
    broker_port: int
    controller_port: int
    pid: int | None = None
    cluster_id: str = ""
    secure: bool = False

    def settings(self, user: str = security.ADMIN) -> KafkaSettings:
        """How ``user`` (``admin`` or a role's user when secured) reaches this region."""
        if not self.secure:
            return KafkaSettings(bootstrap_servers=self.bootstrap)
        return security.client_settings(Path(self.home), self.bootstrap, user)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

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
        return procs.alive(self.pid, str(self.properties))

    def to_dict(self) -> dict:
        return asdict(self)


def new_region(name: str, home: Path, secure: bool = False) -> Region:
    if secure:
        security.ensure_secrets(home)
    return Region(
        name=name,
        home=str(home),
        broker_port=procs.free_port(),
        controller_port=procs.free_port(),
        secure=secure,
    )


def _properties(region: Region) -> str:
    data = region.dir / "data"
    lines = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{region.controller_port}",
        "listeners": (
            f"PLAINTEXT://127.0.0.1:{region.broker_port},"
            f"CONTROLLER://127.0.0.1:{region.controller_port}"
        ),
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{region.broker_port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data),
        "num.partitions": "1",
        # A single node can only hold one replica of the internal topics.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "message.max.bytes": str(16 * 1024 * 1024),
        "log.segment.bytes": str(256 * 1024 * 1024),
        # Transactions abort quickly after a producer dies, so tests of crashes stay short.
        "transaction.max.timeout.ms": str(15 * 60 * 1000),
    }
    if region.secure:
        lines.update(
            security.broker_properties(
                Path(region.home), region.broker_port, region.controller_port
            )
        )
    return "".join(f"{key}={value}\n" for key, value in lines.items())


def _ports_free(region: Region, wait: float) -> bool:
    """Whether the region's kept ports are free, waiting up to ``wait`` seconds for a broker
    that just died to release them: clients and MirrorMaker reconnect only to the same port."""
    deadline = time.monotonic() + wait
    while True:
        if not (procs.port_in_use(region.broker_port) or procs.port_in_use(region.controller_port)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def _write_config(region: Region) -> None:
    region.dir.mkdir(parents=True, exist_ok=True)
    region.log.parent.mkdir(parents=True, exist_ok=True)
    if region.secure:  # it holds the admin password of the inter-broker link
        security.write_private(region.properties, _properties(region).encode())
    else:
        region.properties.write_text(_properties(region))
    (region.dir / "log4j2.properties").write_text(LOG4J2.format(log=region.log))


def _java(region: Region, heap: str) -> list[str]:
    return [
        artifacts.java_binary(),
        "-Xms256m",
        f"-Xmx{heap}",
        "-XX:+UseG1GC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={region.dir / 'log4j2.properties'}",
        "-cp",
        artifacts.classpath(),
    ]


def _cluster_id() -> str:
    """A Kafka cluster id (base64 of a UUID) that does not start with "-": the storage tool
    would read one that does as an option and refuse to format."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _format(region: Region, heap: str) -> None:
    if (region.dir / "data" / "meta.properties").exists():
        return
    region.cluster_id = _cluster_id()
    cmd = [
        *_java(region, heap),
        "kafka.tools.StorageTool",
        "format",
        "-t",
        region.cluster_id,
        "-c",
        str(region.properties),
        *(security.format_args(Path(region.home)) if region.secure else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(
            f"formatting Kafka storage for region {region.name} failed:\n{proc.stdout}{proc.stderr}"
        )


def start(region: Region, heap: str = "1g", timeout: float = 120.0) -> Region:
    """Start the region's broker (formatting storage the first time) and wait until it serves."""
    if not _ports_free(region, wait=PORT_WAIT_S):
        region.broker_port, region.controller_port = procs.free_port(), procs.free_port()
    _write_config(region)
    _format(region, heap)
    cmd = [*_java(region, heap), MARKER, str(region.properties)]
    proc = procs.spawn(cmd, region.stdout_log, cwd=region.dir)
    region.pid = proc.pid
    try:
        wait_ready(region, timeout, proc)
    except BaseException:
        stop(region)  # never leave a broker that did not come up running
        raise
    return region


def wait_ready(region: Region, timeout: float, proc: subprocess.Popen | None = None) -> None:
    from confluent_kafka.admin import AdminClient

    conf = {**region.settings().librdkafka(), "log_level": 0, "logger": _silent_logger()}
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (proc.poll() is not None) if proc else not region.running():
            raise SetupError(
                f"the Kafka broker of region {region.name} exited during start-up. Last lines "
                f"of {region.log}:\n{procs.tail(region.log)}\n{procs.tail(region.stdout_log, 10)}"
            )
        try:
            admin.list_topics(timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    raise SetupError(
        f"the Kafka broker of region {region.name} did not answer on {region.bootstrap} within "
        f"{timeout:.0f}s. Last lines of {region.log}:\n{procs.tail(region.log)}"
    )


def _silent_logger():
    import logging

    logger = logging.getLogger("rlstream.cluster.admin")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger


def stop(region: Region) -> None:
    if region.pid:
        procs.stop(region.pid, str(region.properties))
    region.pid = None

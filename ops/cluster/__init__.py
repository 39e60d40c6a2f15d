"""The embedded default: real Apache Kafka on loopback, one KRaft node per region, MirrorMaker 2.

``up`` is idempotent: a region whose broker still runs is reused, a stopped one is restarted on
its data. ``down`` stops exactly the processes ``up`` recorded, by pid. All state lives in one
directory (``--home``, ``$RLSTREAM_HOME``, default ``~/.local/state/rlstream/cluster``) holding
``cluster.json``, each region's config, data and logs, and MirrorMaker's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.ops.cluster import broker, mirror
from rlstream.ops.cluster.artifacts import SetupError
from rlstream.ops.cluster.broker import Region
from rlstream.ops.cluster.mirror import Flow, Mirror, parse_flow

__all__ = ["Cluster", "Flow", "SetupError", "default_home", "down", "load", "parse_flow", "up"]

DEFAULT_REGION = "trainer"


def default_home() -> Path:
    env = os.environ.get("RLSTREAM_HOME")
    return Path(env) if env else Path.home() / ".local" / "state" / "rlstream" / "cluster"


@dataclass
class Cluster:
    home: Path
    regions: dict[str, Region] = field(default_factory=dict)
    mirror: Mirror | None = None

    @property
    def state_file(self) -> Path:
        return self.home / "cluster.json"

    def save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        doc = {
            "regions": {n: r.to_dict() for n, r in self.regions.items()},
            "mirror": self.mirror.to_dict() if self.mirror else None,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(self.state_file)

    def bootstrap(self, region: str = DEFAULT_REGION) -> str:
        if region not in self.regions:
            raise SetupError(
                f"region {region!r} is not in the local cluster at {self.home} "
                f"(regions: {sorted(self.regions) or 'none'}); "
                f"start it with `rlstream cluster up --regions {region}`"
            )
        return self.regions[region].bootstrap

    def running_regions(self) -> list[str]:
        return [n for n, r in self.regions.items() if r.running()]


def load(home: Path | None = None) -> Cluster:
    home = Path(home or default_home())
    cluster = Cluster(home=home)
    if cluster.state_file.exists():
        doc = json.loads(cluster.state_file.read_text())
        cluster.regions = {n: Region(**r) for n, r in doc.get("regions", {}).items()}
        if doc.get("mirror"):
            cluster.mirror = Mirror(**doc["mirror"])
    return cluster


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def up(
    regions: list[str] | None = None,
    flows: list[Flow] | None = None,
    home: Path | None = None,
    heap: str = "1g",
    log=print,
) -> Cluster:
    """Start (or reuse) a broker per region, then MirrorMaker 2 for ``flows`` if any."""
    home = Path(home or default_home())
    with _locked(home):
        cluster = load(home)
        for name in regions or [DEFAULT_REGION]:
            region = cluster.regions.get(name) or broker.new_region(name, home)
            cluster.regions[name] = region
            if region.running():
                log(f"region {name}: running at {region.bootstrap} (pid {region.pid})")
                continue
            log(f"region {name}: starting Kafka ...")
            broker.start(region, heap=heap)
            cluster.save()
            log(f"region {name}: ready at {region.bootstrap} (pid {region.pid}, log {region.log})")
        _create_cluster_topics(cluster, regions or [DEFAULT_REGION])
        _ensure_mirror(cluster, flows or [], log)
        cluster.save()
        return cluster


def _create_cluster_topics(cluster: Cluster, regions: list[str]) -> None:
    """Every region gets ``rl.schemas`` and ``rl.runs`` so any consumer there can decode."""
    from rlstream.producers.admin import ensure_cluster_topics
    from rlstream.producers.settings import KafkaSettings

    for name in regions:
        ensure_cluster_topics(KafkaSettings(bootstrap_servers=cluster.bootstrap(name)))


def _ensure_mirror(cluster: Cluster, flows: list[Flow], log) -> None:
    wanted = sorted(str(f) for f in flows)
    current = cluster.mirror
    if current and current.running() and (not wanted or sorted(current.flows) == wanted):
        log(f"mirror: running (pid {current.pid}) for {', '.join(current.flows)}")
        return
    if not wanted and current:
        wanted = sorted(current.flows)  # restart the flows recorded before
        flows = [parse_flow(f) for f in wanted]
    if current:
        mirror.stop(current)
    if not wanted:
        cluster.mirror = None
        return
    log(f"mirror: starting MirrorMaker 2 for {', '.join(wanted)} ...")
    cluster.mirror = mirror.start(cluster.home, flows, cluster.regions)
    log(f"mirror: running (pid {cluster.mirror.pid}, log {cluster.mirror.log})")


def down(home: Path | None = None, purge: bool = False, log=print) -> None:
    """Stop what ``up`` started (MirrorMaker first, then brokers); ``purge`` deletes the data."""
    home = Path(home or default_home())
    with _locked(home):
        cluster = load(home)
        if cluster.mirror:
            mirror.stop(cluster.mirror)
            log("mirror: stopped")
        for name, region in cluster.regions.items():
            was = region.pid
            broker.stop(region)
            log(f"region {name}: stopped" + (f" (pid {was})" if was else ""))
        cluster.save()
        if purge:
            for name in cluster.regions:
                shutil.rmtree(home / name, ignore_errors=True)
            shutil.rmtree(home / "mirror", ignore_errors=True)
            cluster.state_file.unlink(missing_ok=True)
            log(f"purged {home}")

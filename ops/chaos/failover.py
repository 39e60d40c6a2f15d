"""Broker faults of a replicated region (``cluster up --brokers 3``), for failover tests and
``bench chaos --brokers 3``: find which node leads what, kill it, bring it back, roll them all.

Rules:

- a node is killed only by the pid the cluster state recorded for it (``procs``), never by name;
- ``leader_of`` is the node a partition's writes go to; ``coordinator_of`` the node whose
  ``__transaction_state`` partition holds a transactional id (where its commits are decided);
  ``controller_of`` the active KRaft controller: each read from the region's own metadata;
- a killed node comes back on its own data and ports (``restart_node``), as a service manager
  would restart it; a rolling restart stops one node cleanly at a time and waits until no
  partition is under-replicated before the next, so a region of 3 never has fewer than 2 copies
  of a record in sync (``min.insync.replicas``) and writes never stop;
- ``stalls`` measures the time from each fault to the next version the learner committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from rlstream.ops.run.services import kill9
from rlstream.producers.client.settings import KafkaSettings

#: The partitions of ``__transaction_state`` (the broker's default, which we keep).
TRANSACTION_LOG_PARTITIONS = 50


def java_hash(text: str) -> int:
    """Java's ``String.hashCode`` of ``text`` (UTF-16 code units), as a signed 32-bit int."""
    raw, h = text.encode("utf-16-be"), 0
    for i in range(0, len(raw), 2):
        h = (31 * h + int.from_bytes(raw[i : i + 2], "big")) & 0xFFFFFFFF
    return h - 2**32 if h >= 2**31 else h


def transaction_partition(transactional_id: str) -> int:
    """The ``__transaction_state`` partition of ``transactional_id`` (Kafka's
    ``Utils.abs(hashCode) % partitions``)."""
    h = java_hash(transactional_id)
    return (0 if h == -(2**31) else abs(h)) % TRANSACTION_LOG_PARTITIONS


def _metadata(settings: KafkaSettings, topic: str | None = None, timeout: float = 10.0):
    from rlstream.producers.client.admin import admin_client

    return admin_client(settings).list_topics(topic, timeout=timeout)


def leader_of(settings: KafkaSettings, topic: str, partition: int = 0) -> int:
    """The node that leads ``topic``'s ``partition`` now (-1 while it has none)."""
    return int(_metadata(settings, topic).topics[topic].partitions[partition].leader)


def coordinator_of(settings: KafkaSettings, transactional_id: str) -> int:
    """The node coordinating the transactions of ``transactional_id``."""
    return leader_of(settings, "__transaction_state", transaction_partition(transactional_id))


def controller_of(settings: KafkaSettings) -> int:
    """The active KRaft controller."""
    return int(_metadata(settings).controller_id)


def under_replicated(settings: KafkaSettings) -> list[str]:
    """``topic/partition`` of every partition with fewer replicas in sync than it has."""
    meta = _metadata(settings)
    return [
        f"{t}/{p}"
        for t, m in meta.topics.items()
        for p, part in m.partitions.items()
        if len(part.isrs) < len(part.replicas)
    ]


def kill_node(home: Path, region: str, node_id: int) -> float:
    """SIGKILL node ``node_id`` of ``region``; returns when it died (``time.time()``)."""
    from rlstream.ops import cluster

    reg = cluster.load(home).regions[region]
    pid = reg.node(node_id).pid
    if pid is None or not reg.node_running(node_id):
        raise RuntimeError(f"node {node_id} of region {region} is not running")
    kill9(pid)
    return time.time()


def restart_node(home: Path, region: str, node_id: int, heap: str) -> None:
    """Start node ``node_id`` of ``region`` again on its data and ports, and record its pid."""
    from rlstream.ops import cluster
    from rlstream.ops.cluster import broker

    state = cluster.load(home)
    broker.start(state.regions[region], heap=heap, only=[node_id])
    state.save()


def wait_in_sync(settings: KafkaSettings, timeout: float = 120.0) -> float:
    """Wait until no partition of the region is under-replicated; returns the seconds taken."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if not under_replicated(settings):
                return time.monotonic() - started
        except Exception:
            pass  # a metadata request that failed while a node restarts: ask again
        time.sleep(0.5)
    raise TimeoutError(f"partitions still under-replicated after {timeout:.0f}s")


def rolling_restart(home: Path, region: str, heap: str, timeout: float = 180.0) -> list[float]:
    """Stop (SIGTERM, clean) and restart every node of ``region`` one at a time, each after the
    region is fully in sync again; returns per node the seconds until it was back in sync."""
    from rlstream.ops import cluster
    from rlstream.ops.cluster import broker

    state = cluster.load(home)
    reg = state.regions[region]
    settings = reg.settings()
    took = []
    for node in reg.nodes():
        wait_in_sync(settings, timeout)
        started = time.monotonic()
        broker.stop(reg, only=[node.node_id])
        broker.start(reg, heap=heap, only=[node.node_id])
        state.save()
        wait_in_sync(settings, timeout)
        took.append(time.monotonic() - started)
    return took


def commit_times(settings: KafkaSettings, run: str) -> list[tuple[int, float]]:
    """(version, when its manifest was made, ``time.time()`` seconds) of every accepted
    version, in log order: a version made after a fault was committed after it."""
    from rlstream.ops.observe.ledger import accepted_manifests

    return [
        (int(r["version"]), int(r["created_ms"]) / 1000)
        for r in accepted_manifests(settings, run, timeout=30)
    ]


def stalls(commits: list[tuple[int, float]], faults: list[float]) -> list[float | None]:
    """Per fault time, the seconds to the first version made after it (None: none was)."""
    out: list[float | None] = []
    for fault in faults:
        after = [at for _, at in commits if at > fault]
        out.append(round(min(after) - fault, 2) if after else None)
    return out


def version_gap_p50(commits: list[tuple[int, float]]) -> float | None:
    """The median seconds between consecutive versions of the run: what a stall is read
    against (a fault at a random point of a gap waits half of one even without a fault)."""
    gaps = sorted(b[1] - a[1] for a, b in pairwise(commits))
    return round(gaps[len(gaps) // 2], 2) if gaps else None


def learner_transactional_id(run: str) -> str:
    """The transactional id of the learner's rank 0 (its manifests and offsets)."""
    from rlstream.schemas import topics

    return f"{topics.group_id(run, 'learner')}.0"


KINDS = ("leader", "coordinator", "controller", "roll")


@dataclass
class BrokerFaults:
    """The broker faults of one run on a replicated region, and when each struck (for
    ``stalls``): ``leader`` kills the leader of the manifest partition the learner commits to,
    ``coordinator`` the learner's transaction coordinator, ``controller`` the active controller
    (each SIGKILL, restarted after ``down_s``), ``roll`` restarts every node in turn."""

    home: Path
    region: str
    run: str
    heap: str
    down_s: float = 5.0
    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    times: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # of each fault in ``times``
    # whether work was left when each fault struck (tasks not yet all decided): a fault after
    # the run's work ended is followed by no version, and that is no stall
    work_left: list[bool] = field(default_factory=list)

    def inject(self, kind: str, work_left: bool = True) -> str:
        from rlstream.ops import cluster
        from rlstream.schemas import topics

        settings = cluster.load(self.home).settings(self.region)
        self.kinds.append(kind)
        self.work_left.append(work_left)
        if kind == "roll":
            self.times.append(time.time())
            took = rolling_restart(self.home, self.region, self.heap)
            self.done[kind] += 1
            return f"rolled every broker ({', '.join(f'{t:.0f}s' for t in took)} each)"
        node = {
            "leader": lambda: leader_of(settings, topics.topic_name(self.run, "weights.manifests")),
            "coordinator": lambda: coordinator_of(settings, learner_transactional_id(self.run)),
            "controller": lambda: controller_of(settings),
        }[kind]()
        self.times.append(kill_node(self.home, self.region, node))
        time.sleep(self.down_s)
        restart_node(self.home, self.region, node, self.heap)
        self.done[kind] += 1
        return f"killed the {kind} (node {node}) with SIGKILL; restarted after {self.down_s:.0f}s"

    def figures(self, settings: KafkaSettings, brokers: int) -> dict[str, Any]:
        from rlstream.ops.cluster.broker import replication

        commits = commit_times(settings, self.run)
        measured = stalls(commits, self.times)
        known = [s for s in measured if s is not None]
        after_work = [s is None and not w for s, w in zip(measured, self.work_left, strict=True)]
        return {
            "brokers": brokers,
            "replication_factor": replication(brokers)[0],
            "leader_kills": self.done["leader"],
            "coordinator_kills": self.done["coordinator"],
            "controller_kills": self.done["controller"],
            "rolling_restarts": self.done["roll"],
            "stalls_s": measured,
            "stall_kinds": self.kinds,
            "stall_work_left": self.work_left,
            "max_stall_s": max(known) if known else None,
            # no version after them: struck once the work was done (no stall), or while work
            # was left (the run never recovered)
            "faults_after_the_work": sum(after_work),
            "faults_never_recovered": sum(s is None for s in measured) - sum(after_work),
            "version_gap_p50_s": version_gap_p50(commits),
            "broker_rss_mb": broker_rss_mb(self.home, self.region),
        }


def broker_rss_mb(home: Path, region: str) -> dict[str, int | None]:
    """Resident memory of each node of ``region`` now, in MiB (None: not running)."""
    from rlstream.ops import cluster

    reg = cluster.load(home).regions[region]
    out: dict[str, int | None] = {}
    for node in reg.nodes():
        out[str(node.node_id)] = None
        try:
            status = Path(f"/proc/{node.pid}/status").read_text().splitlines()
            kb = next(ln for ln in status if ln.startswith("VmRSS")).split()[1]
            out[str(node.node_id)] = int(kb) // 1024
        except (OSError, StopIteration):
            pass
    return out

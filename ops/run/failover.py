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
- ``stall_after`` measures the time from a fault to the next version the learner committed.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlstream.ops.run.faults import kill9
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


def stall_after(
    settings: KafkaSettings, run: str, fault_at: float, after_version: int, timeout: float
) -> tuple[int, float]:
    """Wait for the first accepted version past ``after_version``; returns it and the seconds
    from ``fault_at`` (a ``time.time()``) to when it was committed (its record's timestamp)."""
    from rlstream.ops.observe.ledger import accepted_manifests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in accepted_manifests(settings, run, timeout=30):
            if int(rec["version"]) > after_version:
                return int(rec["version"]), int(rec["created_ms"]) / 1000 - fault_at
        time.sleep(1.0)
    raise TimeoutError(f"no version past {after_version} within {timeout:.0f}s of the fault")

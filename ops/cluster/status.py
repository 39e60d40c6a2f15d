"""What `rlstream cluster status` reports: per region, health, its brokers, topics with each
partition's leader and in-sync replicas, under-replicated partitions, groups and their lag;
with a WAN, each link's round trip measured now and whether it is cut.

A partition is under-replicated when fewer of its replicas are in sync than it has: with
``min.insync.replicas`` 2 of 3 it still takes writes, but one more broker lost would stop them.
"""

from __future__ import annotations

from typing import Any

from rlstream.ops.cluster import Cluster
from rlstream.ops.cluster.broker import Region


def describe(cluster: Cluster, timeout: float = 5.0, run: str | None = None) -> dict[str, Any]:
    """The report (module docstring); with ``run``, each region's capacity signals of that run
    too (``capacity``: its newest and the lent engines of the last ``CAPACITY_SHOWN``)."""
    from rlstream.producers.client.admin import admin_client, group_lag

    report: dict[str, Any] = {"home": str(cluster.home), "trainer": cluster.trainer, "regions": {}}
    for name, region in cluster.regions.items():
        entry: dict[str, Any] = {
            "bootstrap": region.bootstrap,
            "pid": region.pid,
            "log": str(region.log),
            "brokers": _brokers(region),
        }
        report["regions"][name] = entry
        if not any(b["running"] for b in entry["brokers"]):
            entry["health"] = "stopped"
            continue
        admin = admin_client(region.settings())
        try:
            meta = admin.list_topics(timeout=timeout)
        except Exception as exc:
            entry["health"] = f"unreachable: {exc}"
            continue
        entry["health"] = "ok" if region.running() else "degraded"
        entry["controller"] = meta.controller_id
        shown = {t: m for t, m in meta.topics.items() if not t.startswith("__")}
        entry["topics"] = {t: len(m.partitions) for t, m in shown.items()}
        entry["partitions"] = partitions(meta.topics)
        entry["under_replicated"] = [
            f"{t}/{p['partition']}"
            for t, ps in entry["partitions"].items()
            for p in ps
            if p["under_replicated"]
        ]
        groups = admin.list_consumer_groups(request_timeout=timeout).result().valid
        entry["groups"] = {g.group_id: group_lag(admin, g.group_id, timeout) for g in groups}
        if run is not None:
            entry["capacity"] = capacity_of(region.settings(), run)
    report["mirrors"] = {
        name: {
            "pid": m.pid,
            "flows": m.flows,
            "targets": m.targets,
            "running": m.running(),
            "log": str(m.log),
        }
        for name, m in cluster.mirrors.items()
    }
    if cluster.wan is not None:
        report["wan"] = _wan(cluster)
    return report


#: Capacity signals a region's line shows (the newest ones).
CAPACITY_SHOWN = 60
_BLOCKS = " ▁▂▃▄▅▆▇█"


def capacity_of(settings: Any, run: str) -> dict[str, Any] | None:
    """The newest capacity signal ``run`` published in this region, and the engines it lent in
    its last ``CAPACITY_SHOWN`` signals (oldest first); None when it has published none."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.schemas import events, topics

    topic = topics.topic_name(run, "capacity")
    signals = [
        events.decode(m.value() or b"").record
        for m in read_topic(settings, topic, name="cluster-status")
    ]
    if not signals:
        return None
    signals.sort(key=lambda r: int(r["published_ms"]))
    newest = signals[-1]
    return {
        "lent": newest["lent"],
        "engines": newest["engines"],
        "busy_engines": newest["busy_engines"],
        "serving_p99_ms": newest.get("serving_p99_ms"),
        "guard": newest.get("guard") or "",
        "published_ms": newest["published_ms"],
        "lent_history": [int(r["lent"]) for r in signals[-CAPACITY_SHOWN:]],
    }


def sparkline(values: list[int], top: int) -> str:
    """``values`` (0..``top``) as one line of block characters."""
    if top <= 0:
        return "".join(_BLOCKS[0] for _ in values)
    return "".join(_BLOCKS[round(min(max(v, 0), top) / top * (len(_BLOCKS) - 1))] for v in values)


def _wan(cluster: Cluster) -> dict[str, Any]:
    from rlstream.ops.cluster import wan

    assert cluster.wan is not None
    running = cluster.wan.running()
    links: dict[str, Any] = {}
    trainer = cluster.regions[cluster.trainer]
    for name, ports in trainer.links.items():
        link: dict[str, Any] = {"bootstrap": trainer.link_bootstrap(name), "cut": None}
        if running:
            link["cut"] = wan.is_cut(cluster.wan, name)
            if not link["cut"] and trainer.running():
                try:
                    link["measured_rtt_ms"] = wan.measure_rtt_ms(ports[0][1], samples=5)
                except OSError:
                    link["measured_rtt_ms"] = None
        links[name] = link
    return {
        "pid": cluster.wan.pid,
        "running": running,
        "rtt_ms": cluster.wan.rtt_ms,
        "mbit": cluster.wan.mbit,
        "links": links,
    }


def _brokers(region: Region) -> list[dict[str, Any]]:
    return [
        {
            "id": n.node_id,
            "address": f"127.0.0.1:{n.broker_port}",
            "pid": n.pid,
            "rack": f"{region.name}-r{n.node_id}",
            "running": region.node_running(n.node_id),
        }
        for n in region.nodes()
    ]


def partitions(topics: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per topic (internal ones included: the offsets and transaction logs matter most), each
    partition's leader, replicas and in-sync replicas, from a metadata answer."""
    out: dict[str, list[dict[str, Any]]] = {}
    for topic, meta in sorted(topics.items()):
        out[topic] = [
            {
                "partition": pid,
                "leader": p.leader,
                "replicas": list(p.replicas),
                "isr": list(p.isrs),
                "under_replicated": len(p.isrs) < len(p.replicas),
            }
            for pid, p in sorted(meta.partitions.items())
        ]
    return out

"""What `rlstream cluster status` reports: per region, health, topics, groups and their lag."""

from __future__ import annotations

from typing import Any

from rlstream.ops.cluster import Cluster


def describe(cluster: Cluster, timeout: float = 5.0) -> dict[str, Any]:
    from rlstream.producers.client.admin import admin_client, group_lag

    report: dict[str, Any] = {"home": str(cluster.home), "trainer": cluster.trainer, "regions": {}}
    for name, region in cluster.regions.items():
        entry: dict[str, Any] = {
            "bootstrap": region.bootstrap,
            "pid": region.pid,
            "log": str(region.log),
        }
        report["regions"][name] = entry
        if not region.running():
            entry["health"] = "stopped"
            continue
        admin = admin_client(region.settings())
        try:
            meta = admin.list_topics(timeout=timeout)
        except Exception as exc:
            entry["health"] = f"unreachable: {exc}"
            continue
        entry["health"] = "ok"
        entry["topics"] = {
            t: len(m.partitions) for t, m in meta.topics.items() if not t.startswith("__")
        }
        groups = admin.list_consumer_groups(request_timeout=timeout).result().valid
        entry["groups"] = {g.group_id: group_lag(admin, g.group_id, timeout) for g in groups}
    report["mirrors"] = {
        name: {"pid": m.pid, "flows": m.flows, "running": m.running(), "log": str(m.log)}
        for name, m in cluster.mirrors.items()
    }
    return report

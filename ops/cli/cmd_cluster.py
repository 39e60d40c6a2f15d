"""``rlstream cluster up | down | status | fetch | link``: the embedded local Kafka."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlstream.schemas.errors import SetupError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("cluster", help="start, stop or inspect the local Kafka cluster")
    parser.add_argument(
        "--home",
        type=Path,
        default=None,
        help="state directory (default $RLSTREAM_HOME or ~/.local/state/rlstream/cluster)",
    )
    csub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    up = csub.add_parser("up", help="start one Kafka per region (reuses running ones)")
    up.add_argument(
        "--regions",
        default="trainer",
        help="comma-separated region names, one cluster each (default: trainer); with several, "
        "each rollout region gets a MirrorMaker 2 link to the trainer region whose flows the "
        "stream catalog derives (tasks, weights, runs, schemas out; trajectories, rewards home)",
    )
    up.add_argument(
        "--trainer",
        default=None,
        help="the trainer region (default: 'trainer' if listed, else the first region)",
    )
    up.add_argument(
        "--no-mirror", action="store_true", help="start the brokers only, no MirrorMaker 2"
    )
    up.add_argument(
        "--heap",
        default=None,
        help="JVM heap of each broker (default 1g for a region of one broker, 512m each of 3)",
    )
    up.add_argument(
        "--brokers",
        type=int,
        default=None,
        help="KRaft nodes per region (a new region: default 1; a region keeps its count, "
        "another is refused); 3 replicates every topic 3 times with "
        "min.insync.replicas=2, so a region survives one broker's death (see docs/kafka.md)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        default=None,
        help="secured regions: SASL/SCRAM-SHA-512 over TLS, ACLs enforced, each MirrorMaker 2 link "
        "as its own user with least-privilege ACLs (then `rlstream acl apply --run RUN` for the "
        "role users, their ACLs and the run's streams on the links); kept by later starts",
    )
    up.add_argument(
        "--rtt-ms",
        type=float,
        default=None,
        help="put a WAN between the trainer region and each rollout region: this round trip "
        "(Toxiproxy, built once with Go); a later `up` with another value changes it in place",
    )
    up.add_argument(
        "--mbit",
        type=float,
        default=None,
        help="with --rtt-ms: each link connection's rate in Mbit/s (default unlimited)",
    )
    up.add_argument(
        "--mirror-set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a MirrorMaker 2 setting every link gets last (repeatable; kept by later starts; "
        "a link whose settings change restarts)",
    )
    up.set_defaults(func=_up)

    link = csub.add_parser("link", help="cut or heal a rollout region's WAN link")
    link.add_argument("change", choices=["cut", "heal"])
    link.add_argument("region", help="the rollout region")
    link.set_defaults(func=_link)

    down = csub.add_parser("down", help="stop exactly what `up` started")
    down.add_argument("--purge", action="store_true", help="also delete the data and logs")
    down.set_defaults(func=_down)

    status = csub.add_parser("status", help="bootstrap, health, topics, groups and lag per region")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--run", default=None, help="also each region's capacity lent to this run (tidal)"
    )
    status.set_defaults(func=_status)

    fetch = csub.add_parser("fetch", help="fetch the Kafka jars from Maven Central (once)")
    fetch.set_defaults(func=_fetch)


def _up(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster

    try:
        regions = [r.strip() for r in args.regions.split(",") if r.strip()]
        if args.mbit is not None and args.rtt_ms is None:
            raise ValueError("--mbit sets the WAN link's rate: give --rtt-ms too")
        spec = cluster.LinkSpec(args.rtt_ms, args.mbit) if args.rtt_ms is not None else None
        state = cluster.up(
            regions,
            not args.no_mirror,
            home=args.home,
            heap=args.heap,
            trainer=args.trainer,
            secure=args.secure,
            brokers=args.brokers,
            link=spec,
            mirror_settings=_pairs(args.mirror_set) if args.mirror_set is not None else None,
        )
    except (SetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, region in state.regions.items():
        if name in regions:
            role = "trainer" if name == state.trainer else "rollout"
            secured = "\tsecured (SASL_SSL, SCRAM-SHA-512)" if region.secure else ""
            print(f"{name}\t{region.bootstrap}\t{role}{secured}")
    if any(r.secure for r in state.regions.values()):
        print(
            "credentials (0600, user admin, one per role and one per link): "
            f"{state.home / 'secrets'}"
        )
    print(f"state and logs: {state.home}")
    return 0


def _pairs(items: list[str]) -> dict[str, str]:
    bad = [item for item in items if "=" not in item]
    if bad:
        raise ValueError(f"--mirror-set takes KEY=VALUE, not {bad}")
    return dict(item.split("=", 1) for item in items)


def _link(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster

    try:
        (cluster.cut_link if args.change == "cut" else cluster.heal_link)(args.region, args.home)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"link {args.region}: {'cut' if args.change == 'cut' else 'healed'}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster

    cluster.down(home=args.home, purge=args.purge)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from rlstream.ops.cluster import artifacts

    try:
        print(artifacts.libs_dir())
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster
    from rlstream.ops.cluster.status import describe, sparkline

    state = cluster.load(args.home)
    if not state.regions:
        print(f"no local cluster recorded at {state.home}; start one with `rlstream cluster up`")
        return 1
    report = describe(state, run=args.run)
    if args.json:
        print(json.dumps(report))
        return 0
    for name, region in report["regions"].items():
        role = "trainer" if name == report["trainer"] else "rollout"
        print(f"region {name} ({role}): {region['bootstrap']}  {region['health']}")
        for b in region["brokers"]:
            up = "running" if b["running"] else "stopped"
            lead = "  (active controller)" if region.get("controller") == b["id"] else ""
            print(f"  broker {b['id']} {b['address']} rack {b['rack']} pid {b['pid']} {up}{lead}")
        for topic, parts in sorted(region.get("partitions", {}).items()):
            if topic.startswith("__") and len(region["brokers"]) == 1:
                continue  # one broker: nothing to say about the internal topics' replicas
            for p in parts:
                flag = "  UNDER-REPLICATED" if p["under_replicated"] else ""
                print(
                    f"  {topic}/{p['partition']}  leader={p['leader']} "
                    f"replicas={p['replicas']} isr={p['isr']}{flag}"
                )
        if region.get("under_replicated"):
            print(f"  under-replicated partitions: {len(region['under_replicated'])}")
        for group, lag in sorted(region.get("groups", {}).items()):
            print(f"  group {group}  lag={lag}")
        cap = region.get("capacity")
        if cap is not None:
            p99 = cap["serving_p99_ms"]
            seen = f", serving p99 {p99:.0f} ms" if p99 is not None else ""
            why = f"; {cap['guard']}" if cap["guard"] else ""
            print(
                f"  capacity ({args.run}): lends {cap['lent']}/{cap['engines']} engines, serving "
                f"busy {cap['busy_engines']:.1f}{seen}{why}"
            )
            print(f"    lent, last {len(cap['lent_history'])} signals: "
                  f"{sparkline(cap['lent_history'], cap['engines'])}")  # fmt: skip
        elif args.run is not None and region["health"] == "ok":
            print(f"  capacity ({args.run}): no signal published here")
    if report.get("wan"):
        w = report["wan"]
        rate = f", {w['mbit']:g} Mbit/s per connection" if w["mbit"] else ""
        print(
            f"wan: {'running' if w['running'] else 'stopped'} pid {w['pid']}, {w['rtt_ms']:g} ms RTT{rate}"
        )
        for name, link in w["links"].items():
            measured = link.get("measured_rtt_ms")
            seen = f", measured {measured:.1f} ms" if measured is not None else ""
            print(f"  link {name}: {'CUT' if link['cut'] else 'up'} via {link['bootstrap']}{seen}")
    for name, m in report["mirrors"].items():
        state_word = "running" if m["running"] else "stopped"
        where = f" in {', '.join(m['targets'])}" if m.get("targets") else ""
        print(f"mirror {name}: {state_word}{where} pid {m['pid']} flows {m['flows']}")
    return 0 if all(r["health"] == "ok" for r in report["regions"].values()) else 1

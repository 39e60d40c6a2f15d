"""``rlstream cluster up | down | status | fetch``: the embedded local Kafka."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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
        help="comma-separated region names, one cluster each (default: trainer)",
    )
    up.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="SRC->DST:REGEX",
        help="MirrorMaker 2 flow, repeatable, e.g. 'trainer->eu:rl\\..*\\.tasks'",
    )
    up.add_argument("--heap", default="1g", help="broker JVM heap (default 1g)")
    up.set_defaults(func=_up)

    down = csub.add_parser("down", help="stop exactly what `up` started")
    down.add_argument("--purge", action="store_true", help="also delete the data and logs")
    down.set_defaults(func=_down)

    status = csub.add_parser("status", help="bootstrap, health, topics, groups and lag per region")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_status)

    fetch = csub.add_parser("fetch", help="fetch the Kafka jars from Maven Central (once)")
    fetch.set_defaults(func=_fetch)


def _up(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster

    try:
        flows = [cluster.parse_flow(f) for f in args.mirror]
        regions = [r.strip() for r in args.regions.split(",") if r.strip()]
        state = cluster.up(regions, flows, home=args.home, heap=args.heap)
    except (cluster.SetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, region in state.regions.items():
        if name in regions:
            print(f"{name}\t{region.bootstrap}")
    print(f"state and logs: {state.home}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster

    cluster.down(home=args.home, purge=args.purge)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from rlstream.ops.cluster import artifacts

    try:
        print(artifacts.libs_dir())
    except artifacts.SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster
    from rlstream.ops.cluster.status import describe

    state = cluster.load(args.home)
    if not state.regions:
        print(f"no local cluster recorded at {state.home}; start one with `rlstream cluster up`")
        return 1
    report = describe(state)
    if args.json:
        print(json.dumps(report))
        return 0
    for name, region in report["regions"].items():
        print(f"region {name}: {region['bootstrap']}  {region['health']}  pid {region['pid']}")
        for topic, parts in sorted(region.get("topics", {}).items()):
            print(f"  topic {topic}  partitions={parts}")
        for group, lag in sorted(region.get("groups", {}).items()):
            print(f"  group {group}  lag={lag}")
    if report.get("mirror"):
        m = report["mirror"]
        print(
            f"mirror: {'running' if m['running'] else 'stopped'} pid {m['pid']} flows {m['flows']}"
        )
    return 0 if all(r["health"] == "ok" for r in report["regions"].values()) else 1

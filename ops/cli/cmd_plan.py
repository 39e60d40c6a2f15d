"""``rlstream plan``: what a deployment needs to land each weight version in time, from the rates
``rlstream bench plan`` measured (``--rates``, default its kept result) and the deployment's own
figures (every field of ``ops.plan.model.Deployment`` is a flag). The model and its terms:
``ops.plan.model``; how it was checked: docs/sizing.md."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

HELP = {
    "snapshot_gb": "raw weights of one version, GB (bf16)",
    "delta_gb": "one version's chunks on the wire, GB",
    "every_s": "seconds between versions",
    "land_s": "goal: seconds from the step to every engine holding the version",
    "pause_s": "goal: longest generation pause per swap, seconds",
    "ranks": "learner ranks (each encodes its shard)",
    "cores_per_rank": "codec threads per learner rank",
    "brokers": "brokers per region",
    "broker_gb_s": "GB/s per broker, in and out (its NIC or disk, the lower) [assumed]",
    "replication": "copies of every chunk in a region",
    "partitions": "partitions of the chunk topic",
    "partition_gb_s": "GB/s one partition takes on a replicated cluster [assumed]",
    "producers": "chunk producers writing at once (one per rank)",
    "regions": "rollout regions, each behind a WAN link",
    "link_gbit_s": "Gbit/s per WAN link [assumed]",
    "rtt_ms": "WAN round trip, ms [assumed]",
    "link_round_trips": "round trips a version costs across a link [assumed]",
    "hosts": "engine hosts per region (each follows the whole version today)",
    "fetchers_per_host": "subscribers per host splitting a version's chunks (today: 1)",
    "host_cores": "codec threads per engine host",
    "gpus_per_engine": "GPUs one engine spans (each loads its share)",
    "changed_fraction": "share of weights whose bits change per version [assumed]",
    "h2d_gb_s": "host-to-device GB/s per GPU [assumed]",
}


def register(sub: argparse._SubParsersAction) -> None:
    from rlstream.ops.plan.model import Deployment

    p = sub.add_parser("plan", help="size a deployment from measured rates (weights landing)")
    p.add_argument("--rates", default=None, help="bench plan's result (default: the kept one)")
    for f in fields(Deployment):
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=type(f.default), default=f.default, help=HELP[f.name])
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.set_defaults(func=_plan)


def rates_file(given: str | None) -> Path:
    """The kept ``bench plan`` result to read rates from: ``given``, else ``results/`` here,
    else the one shipped with the package."""
    if given:
        return Path(given)
    here = Path("results") / "bench-plan.json"
    shipped = Path(__file__).resolve().parents[2] / "results" / "bench-plan.json"
    return here if here.exists() else shipped


def load_rates(path: Path) -> Any:
    """``Rates`` from a kept result (``result.rates``) or a bare rates object."""
    from rlstream.ops.plan.model import Rates

    data = json.loads(path.read_text())
    data = data.get("result", data)
    return Rates.from_dict(data.get("rates", data))


def _plan(args: argparse.Namespace) -> int:
    from rlstream.ops.plan.model import Deployment, plan

    path = rates_file(args.rates)
    try:
        rates = load_rates(path)
    except FileNotFoundError:
        print(f"error: no rates at {path}: run `rlstream bench plan --save` first", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as exc:
        print(f"error: {path} holds no bench plan rates ({exc!r})", file=sys.stderr)
        return 2
    try:
        deployment = Deployment(**{f.name: getattr(args, f.name) for f in fields(Deployment)})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    answer = {**plan(deployment, rates), "rates_from": str(path)}
    if args.json:
        print(json.dumps(answer))
        return 0
    for line in lines(answer):
        print(line)
    return 0


def lines(a: dict[str, Any]) -> list[str]:
    d = a["deployment"]
    out = [
        f"a version of {d['snapshot_gb']:g} GB raw, {d['delta_gb']:g} GB on the wire, every "
        f"{d['every_s']:g} s, to {d['regions']} regions x {d['hosts']} engine hosts "
        f"(rates: {a['rates_from']})",
    ]
    total = a["land_s"] or 1.0
    for stage, s in a["stages_s"].items():
        out.append(f"  {stage:<7} {s:9.2f} s  {s / total:6.1%}")
    out.append(
        f"lands in {a['land_s']} s (goal {d['land_s']:g} s: "
        f"{'met' if a['land_goal_met'] else 'NOT met'}); pause {a['stages_s']['pause']} s "
        f"(goal {d['pause_s']:g} s: {'met' if a['pause_goal_met'] else 'NOT met'}); "
        f"dominant: {a['dominant']} ({a['dominant_share']:.0%})"
    )
    sized = a["sized"]
    if sized["changed"]:
        grown = ", ".join(f"{k} {v:g}" for k, v in sized["changed"].items())
        verdict = "meets the goals" if sized["met"] else "still misses them"
        out.append(f"grown to {grown}: lands in {sized['land_s']} s, {verdict}")
        out.append(f"  by: {'; '.join(sized['doublings'])}")
    out.append(
        f"a keyframe (a new engine, a version too far behind) lands in {a['keyframe_land_s']} s; "
        f"a link carries {a['link_avg_gbit_s']} Gbit/s on average"
    )
    out.append(f"assumed, not measured here: {', '.join(a['assumed'])}")
    return out

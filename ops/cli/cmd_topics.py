"""``rlstream topics apply --run RUN``: create or check a run's topics from the catalog.

With a recipe naming several regions (``[regions]``), every region's cluster gets the run's
topics and the MirrorMaker 2 copies it receives (``topics.Regions.copies``); ``--region`` limits
it to one region, ``--bootstrap`` to one given cluster (as ``--region``, default the trainer).
"""

from __future__ import annotations

import argparse
import json

from rlstream.ops.run.kafka_env import add_kafka_args


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("topics", help="create or check a run's topics")
    tsub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    apply = tsub.add_parser("apply", help="create missing topics, report drift (idempotent)")
    apply.add_argument("--run", required=True, help="run name")
    apply.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="partitions of the group-keyed streams (default: catalog)",
    )
    apply.add_argument("--config", default=None, help="TOML recipe naming the run's regions")
    apply.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    apply.add_argument("--json", action="store_true", help="print one JSON object")
    add_kafka_args(apply)
    apply.set_defaults(func=_apply)


def _apply(args: argparse.Namespace) -> int:
    from rlstream.ops.run.config import load_run_config
    from rlstream.producers.client.admin import ensure_run_topics
    from rlstream.producers.client.settings import KafkaSettings

    cfg = load_run_config(args.config, args.set).regions
    regions = cfg.topology()
    chosen = [args.region] if args.region or args.bootstrap else list(regions.names)
    reports = {}
    for region in [r or regions.trainer for r in chosen]:
        try:
            regions.check(region)
        except ValueError as exc:
            raise SystemExit(f"error: --region: {exc}") from None
        settings = KafkaSettings.from_env(args.bootstrap) or cfg.settings(region, args.home)
        reports[region] = ensure_run_topics(
            settings, args.run, args.partitions, regions=regions, here=region
        )
    if args.json:
        doc = {
            r: {"created": x.created, "unchanged": x.unchanged, "drift": x.drift}
            for r, x in reports.items()
        }
        print(json.dumps(doc if len(doc) > 1 else next(iter(doc.values()))))
        return 1 if any(x.drift for x in reports.values()) else 0
    for region, report in reports.items():
        where = f"[{region}] " if len(reports) > 1 else ""
        for name in report.created:
            print(f"{where}created   {name}")
        for name in report.unchanged:
            print(f"{where}ok        {name}")
        for name, problems in report.drift.items():
            print(f"{where}DRIFT     {name}: {'; '.join(problems)}")
    return 1 if any(x.drift for x in reports.values()) else 0

"""``rlstream topics apply --run RUN``: create or check a run's topics from the catalog."""

from __future__ import annotations

import argparse
import json

from rlstream.ops.kafka_env import add_kafka_args, settings_from_args


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
    apply.add_argument("--json", action="store_true", help="print one JSON object")
    add_kafka_args(apply)
    apply.set_defaults(func=_apply)


def _apply(args: argparse.Namespace) -> int:
    from rlstream.producers.admin import ensure_run_topics

    report = ensure_run_topics(settings_from_args(args), args.run, args.partitions)
    if args.json:
        print(
            json.dumps(
                {"created": report.created, "unchanged": report.unchanged, "drift": report.drift}
            )
        )
    else:
        for name in report.created:
            print(f"created   {name}")
        for name in report.unchanged:
            print(f"ok        {name}")
        for name, problems in report.drift.items():
            print(f"DRIFT     {name}: {'; '.join(problems)}")
    return 1 if report.drift else 0

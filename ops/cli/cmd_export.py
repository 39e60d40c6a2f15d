"""``rlstream export --run R --version V --out DIR``: a committed version as an HF folder,
rebuilt from the run's weight log and checked against the learner's state hash
(``ops.forensics.export``)."""

from __future__ import annotations

import argparse
import json
import sys

from rlstream.ops.run.kafka_env import add_kafka_args, settings_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's version as a Hugging Face model folder")
    p.add_argument("--run", required=True, help="the run")
    p.add_argument("--version", type=int, default=None, help="the version (default: the newest)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist)")
    p.add_argument("--config", default=None, help="the run's recipe, when it recorded none")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE over the recipe")
    p.add_argument("--timeout", type=float, default=300.0, help="longest wait for the chunks")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    add_kafka_args(p)
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from rlstream.ops.forensics.export import ExportError, export_version, run_policy

    settings = settings_from_args(args)
    try:
        config = run_policy(settings, args.run, args.config, args.set)
        note = export_version(settings, args.run, args.version, args.out, config, args.timeout)
    except (ExportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(note))
    else:
        print(f"run {note['run']} version {note['version']} -> {note['folder']}")
    return 0

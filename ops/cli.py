"""The ``rlstream`` command: one entry point, one subcommand module per concern.

Each module in ``COMMANDS`` exposes ``register(subparsers)``; it adds its parser(s) and sets
``func`` to a handler taking the parsed ``argparse.Namespace`` and returning an exit code.
Command modules import only the standard library at import time: heavy modules (torch,
confluent_kafka, aiohttp) are imported inside handlers, so ``rlstream --help`` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = (
    "rlstream.ops.cmd_cluster",
    "rlstream.ops.cmd_topics",
    "rlstream.ops.cmd_run",
    "rlstream.ops.cmd_events",
    "rlstream.ops.cmd_delta",
    "rlstream.ops.cmd_bench",
    "rlstream.ops.cmd_demo",
    "rlstream.ops.cmd_replay",
    "rlstream.ops.cmd_serve",
    "rlstream.ops.cmd_dashboard",
    "rlstream.ops.cmd_env",
    "rlstream.ops.cmd_acl",
)
# Command modules added as the features land are appended here.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlstream",
        description="Kafka event backbone for asynchronous distributed RL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

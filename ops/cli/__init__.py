"""The ``rlstream`` command: one entry point, one subcommand module per concern.

Each module in ``COMMANDS`` exposes ``register(subparsers)``; it adds its parser(s) and sets
``func`` to a handler taking the parsed ``argparse.Namespace`` and returning an exit code.
Command modules import only the standard library at import time: heavy modules (torch,
confluent_kafka, aiohttp) are imported inside handlers, so ``rlstream --help`` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = (
    "rlstream.ops.cli.cmd_cluster",
    "rlstream.ops.cli.cmd_topics",
    "rlstream.ops.cli.cmd_run",
    "rlstream.ops.cli.cmd_events",
    "rlstream.ops.cli.cmd_delta",
    "rlstream.ops.cli.cmd_bench",
    "rlstream.ops.cli.cmd_demo",
    "rlstream.ops.cli.cmd_launch",
    "rlstream.ops.cli.cmd_replay",
    "rlstream.ops.cli.cmd_serve",
    "rlstream.ops.cli.cmd_dashboard",
    "rlstream.ops.cli.cmd_env",
    "rlstream.ops.cli.cmd_acl",
    "rlstream.ops.cli.cmd_lineage",
    "rlstream.ops.cli.cmd_model",
    "rlstream.ops.cli.cmd_export",
    "rlstream.ops.cli.cmd_config",
    "rlstream.ops.cli.cmd_trust",
    "rlstream.ops.cli.cmd_plan",
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
    from rlstream.schemas.errors import CONFIG_EXIT, ConfigInvalid, SetupError

    try:
        return int(args.func(args) or 0)
    except ConfigInvalid as exc:  # one line per problem, no traceback
        print(f"error: {exc.source}:", file=sys.stderr)
        for line in exc.problems:
            print(f"  {line}", file=sys.stderr)
        return CONFIG_EXIT
    except SetupError as exc:  # something to fix on this machine or cluster, said in words
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`| head`): not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (Python flushes it at exit)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

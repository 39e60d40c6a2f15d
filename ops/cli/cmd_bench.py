"""``rlstream bench NAME [--json]``: benchmarks that measure against a baseline in the same run.

Each bench module exposes ``register_bench(subparsers)``. Progress goes to stderr; with ``--json``
the last line of stdout is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from rlstream.ops.bench.common import mark_start

BENCHES = (
    "rlstream.ops.bench.bus",
    "rlstream.ops.bench.deltas",
    "rlstream.ops.bench.sync",
    "rlstream.ops.bench.router_replay",
    "rlstream.ops.bench.asyncrl",
    "rlstream.ops.bench.ingest",
    "rlstream.ops.bench.geo",
    "rlstream.ops.bench.chaos",
    "rlstream.ops.bench.publish",
    "rlstream.ops.bench.learner",
    "rlstream.ops.bench.table",
    "rlstream.ops.bench.engines",
    "rlstream.ops.bench.stability",
    "rlstream.ops.bench.verdicts",
    "rlstream.ops.bench.role_start",
    "rlstream.ops.bench.tidal",
    "rlstream.ops.bench.plan",
)
# Benchmarks added as the features land are appended here.


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (bus, deltas, sync, geo, ...)")
    bsub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(name).register_bench(bsub)
    for name, bench in bsub.choices.items():  # every bench's result records its start's load
        if name != "table" and "--save" not in bench._option_string_actions:
            bench.add_argument(
                "--save", action="store_true", help="keep the result in results/ (with provenance)"
            )
        if name != "table":
            bench.add_argument(
                "--save-as",
                metavar="NAME",
                type=_result_name,
                help="keep it as results/bench-NAME.json (a variant of the bench's own result)",
            )
        bench.set_defaults(func=_marked(bench.get_default("func")))


def _marked(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        mark_start(keep=getattr(args, "save_as", None) or bool(getattr(args, "save", False)))
        return func(args)

    return run


def _result_name(text: str) -> str:
    if not text or not all(c.isalnum() or c in "-_" for c in text):
        raise argparse.ArgumentTypeError(f"a result name is letters, digits, - and _: {text!r}")
    return text

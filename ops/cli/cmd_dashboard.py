"""``rlstream dashboard`` (live web page over SSE) and ``rlstream report`` (static HTML + PNGs).

Both only read a run's streams: no consumer group is joined and nothing is committed, so they
can watch a run in production. See ``ops.observe.dashboard`` and ``ops.observe.report``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlstream.ops.run.kafka_env import add_kafka_args, settings_from_args

if TYPE_CHECKING:
    from rlstream.producers.client.settings import KafkaSettings


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("dashboard", help="live web dashboard of a run (charts over SSE)")
    d.add_argument(
        "--run", default=None, help="run name (default: the run updated last in rl.runs)"
    )
    d.add_argument("--host", default="127.0.0.1", help="address to listen on")
    d.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    d.add_argument("--interval", type=float, default=1.0, help="seconds between pushed snapshots")
    add_kafka_args(d)
    d.set_defaults(func=_dashboard)
    r = sub.add_parser("report", help="static HTML report of a run with PNG plots")
    r.add_argument("run", help="run name")
    r.add_argument("--out", required=True, help="directory for index.html and the PNGs")
    r.add_argument("--idle", type=float, default=10.0, help="give up after this many idle seconds")
    add_kafka_args(r)
    r.set_defaults(func=_report)


def _pick_run(args: argparse.Namespace, settings: KafkaSettings) -> str:
    from rlstream.consumers.run_log import latest_run, run_manifests
    from rlstream.schemas.topics import validate_name

    if args.run:
        return validate_name(args.run)
    run = latest_run(run_manifests(settings))
    if run is None:
        raise SystemExit("error: no run manifest in rl.runs; name the run with --run")
    return run


def _dashboard(args: argparse.Namespace) -> int:
    from rlstream.consumers.consumer import Stopper
    from rlstream.ops.observe.dashboard import serve_dashboard

    settings = settings_from_args(args)
    run = _pick_run(args, settings)
    dashboard, server = serve_dashboard(settings, run, args.host, args.port, args.interval)
    print(
        f"dashboard of run {run}: {server.url}  (Kafka at {settings.bootstrap_servers}; Ctrl-C stops)",
        flush=True,
    )
    stopper = Stopper().install()
    try:
        while not stopper.wait(1.0):
            pass
    finally:
        server.stop()
        dashboard.stop()
    return 0


def _report(args: argparse.Namespace) -> int:
    from rlstream.ops.observe.report import build_report
    from rlstream.schemas.topics import validate_name

    settings = settings_from_args(args)
    started = time.monotonic()
    index = build_report(
        settings,
        validate_name(args.run),
        Path(args.out),
        args.idle,
        lambda line: print(line, file=sys.stderr),
    )
    print(f"report of run {args.run} in {time.monotonic() - started:.1f}s: {index}")
    return 0

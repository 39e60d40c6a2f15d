"""Shared plumbing for benchmarks: a broker to measure against, medians, JSON output."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def bench_kafka(args: Any) -> Iterator[Any]:
    """Settings for the cluster named by the args/env/local cluster, else a temporary one.

    A temporary cluster is started in its own state directory and stopped (by pid) at the end.
    """
    from rlstream.ops import cluster
    from rlstream.producers.settings import KafkaSettings

    settings = KafkaSettings.from_env(getattr(args, "bootstrap", None))
    if settings is not None:
        yield settings
        return
    local = cluster.load(getattr(args, "home", None))
    if "trainer" in local.running_regions():
        yield KafkaSettings(bootstrap_servers=local.bootstrap("trainer"))
        return
    with tempfile.TemporaryDirectory(prefix="rlstream-bench-") as tmp:
        home = Path(tmp) / "cluster"
        progress("starting a temporary local Kafka for the benchmark ...")
        state = cluster.up(["trainer"], home=home, log=lambda *_: None)
        try:
            yield KafkaSettings(bootstrap_servers=state.bootstrap("trainer"))
        finally:
            cluster.down(home=home, purge=True, log=lambda *_: None)


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[index])


def emit(result: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    """Human lines first; with ``as_json`` the JSON object is the last stdout line."""
    for line in lines:
        print(line)
    if as_json:
        print(json.dumps(result))

"""Shared plumbing for benchmarks: a broker to measure against, medians, JSON output, and the
kept result of every run (``results/bench-NAME.json`` with the machine it ran on; the folder is
``$RLSTREAM_RESULTS`` when set)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
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


def emit(result: dict[str, Any], as_json: bool, lines: list[str], name: str | None = None) -> None:
    """Human lines first; with ``as_json`` the JSON object is the last stdout line. With a
    ``name`` the result is also kept (``save``)."""
    for line in lines:
        print(line)
    if name is not None:
        progress(f"result kept in {save(name, result)}")
    if as_json:
        print(json.dumps(result))


def save(name: str, result: dict[str, Any]) -> Path:
    """Write ``result`` with the machine's description and the code's commit; returns the path."""
    folder = Path(os.environ.get("RLSTREAM_RESULTS") or "results")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench-{name}.json"
    record = {
        "bench": name,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["rlstream", *sys.argv[1:]]),
        "machine": machine(),
        "result": result,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, OS, Python, key libraries, commit."""
    import numpy
    import zstandard

    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem_gb = round(
            int(next(ln for ln in meminfo if ln.startswith("MemTotal")).split()[1]) / 2**20, 1
        )
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "zstandard": zstandard.__version__,
        "commit": _commit(),
    }


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None

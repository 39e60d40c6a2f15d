"""The main job: a whole asynchronous GRPO run on the local cluster, every role its own process.

``run_demo`` starts the local Kafka, creates the run's topics, records the run manifest, starts
learner, admission, judges, rollout workers and the scheduler as separate ``rlstream run ...``
processes, shows live progress read from the streams themselves, and at the end stops exactly
the processes it started (by pid), writes a PNG (success rate by policy version, staleness
histogram) and returns the summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstream.consumers.consumer import Stopper
from rlstream.ops.analytics import RunAnalytics
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import topics


@dataclass
class RoleProcess:
    name: str
    proc: subprocess.Popen
    log: Path


def start_role(
    role: str, run: str, settings: KafkaSettings, logs: Path, extra: list[str], name: str = ""
) -> RoleProcess:
    name = name or role
    log = logs / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "rlstream",
        "run",
        role,
        "--run",
        run,
        "--bootstrap",
        settings.bootstrap_servers,
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return RoleProcess(name, proc, log)


def stop_roles(roles: list[RoleProcess], timeout: float = 20.0) -> None:
    """SIGTERM each role we started (by pid), wait, then SIGKILL what is left."""
    for r in roles:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in roles:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def follow_streams(
    settings: KafkaSettings, run: str, progress: RunAnalytics, stopper: Stopper
) -> None:
    """Feed ``progress`` from the run's streams until stopped (runs in a thread)."""
    from rlstream.consumers.consumer import RoleConsumer, make_consumer

    streams = ["rewards", "trajectories", "admitted", "rejected", "weights.manifests"]
    consumer = RoleConsumer(
        make_consumer(settings, f"rlstream.{run}.demo-monitor"),
        [topics.topic_name(run, s) for s in streams],
        settings=settings,
    )
    try:
        while not stopper.stopped:
            for rec in consumer.poll_batch(500, 0.5):
                if rec.event is not None:
                    progress.take(rec.topic_partition[0], rec.value, rec.message.timestamp()[1])
    finally:
        consumer.close()


def write_png(progress: RunAnalytics, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = sorted(progress.success)
    rates = [progress.rate([v]) for v in versions]
    counts = [progress.success[v][1] for v in versions]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(versions, rates, marker="o")
    ax1.set_xlabel("behaviour policy version")
    ax1.set_ylabel("success rate (hidden tests)")
    ax1.set_ylim(0, 1)
    ax1.set_title("success rate by policy version")
    for v, r, c in zip(versions, rates, counts, strict=True):
        ax1.annotate(str(c), (v, r), fontsize=6, alpha=0.6)
    staleness = progress.staleness["admitted"] + progress.staleness["rejected"]
    ax2.bar(list(staleness), list(staleness.values()), width=0.8)
    ax2.set_xlabel("staleness at admission (versions)")
    ax2.set_ylabel("groups")
    ax2.set_title("staleness histogram")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record_run_manifest(
    settings: KafkaSettings, run: str, config: Any, status: str, created_ms: int, regions: list[str]
) -> None:
    """Put the run manifest (resolved config, seeds, code version, topics) in ``rl.runs``."""
    from rlstream import __version__
    from rlstream.producers.producer import EventProducer

    record = {
        "run": run,
        "created_ms": created_ms,
        "updated_ms": int(time.time() * 1000),
        "status": status,
        "config_json": config.model_dump_json(),
        "seeds": {"run": config.seed},
        "code_version": _code_version(__version__),
        "model": config.model,
        "start_offsets": [],
        "topics": sorted(topics.run_topics(run).values()),
        "regions": regions,
    }
    with EventProducer.connect(settings) as producer:
        producer.produce(topics.RUNS_TOPIC, "run_manifest", record, run)


def _code_version(version: str) -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        sha = ""
    return f"{version}+{sha}" if sha else version


def status_line(progress: RunAnalytics, started: float) -> str:
    newest = sorted(progress.success)[-2:]
    return (
        f"[{time.monotonic() - started:5.0f}s] policy v{progress.version}  success "
        f"{progress.rate(newest):.2f} (v{newest[-1] if newest else '-'})  trajectories "
        f"{progress.trajectories}  rewards {progress.rewards}  admitted {progress.admitted}  "
        f"rejected {sum(progress.rejected.values())}  staleness "
        f"{progress.mean_recent_staleness() or 0.0:.1f}"
    )


def summary(run: str, progress: RunAnalytics, wall: float, png: Path) -> dict[str, Any]:
    final = progress.final_versions()
    return {
        "run": run,
        "warm_start_success": progress.rate([0]),
        "final_success": progress.rate(final),
        "final_versions": sorted(final),
        "policy_versions": progress.version,
        "wall_seconds": round(wall, 1),
        "groups_admitted": progress.admitted,
        "groups_rejected": sum(progress.rejected.values()),
        "rejected_by_reason": dict(progress.rejected),
        "trajectories": progress.trajectories,
        "png": str(png),
    }


def json_default(value: Any) -> Any:
    return float(value) if isinstance(value, int | float) else str(value)


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, default=json_default)

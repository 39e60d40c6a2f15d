"""``rlstream bench async``: asynchronous (bounded staleness) vs synchronous GRPO on the real
pipeline: every role its own process, over Kafka, with the real sandboxed environment.

Each arm is one ``rlstream demo`` run (one region; learner, admission, the two judges, the
scheduler, ``--workers`` rollout workers and the eval role) on one local cluster shared by all
arms, from one cached warm start, for ``--versions`` policy versions. The arms differ only in
the staleness budget (``max_staleness``):

- sync: a budget of 0. The scheduler releases a batch only when nothing is in flight and the
  learner waits for it (``rollout.scheduler.releasable``); workers generate with the version
  that released the task; the learner waits for its batch, the workers wait for the learner;
- async: a budget of ``--max-staleness`` (the demo's 2): up to ``groups_per_step * budget``
  groups in flight; the learner trains as soon as a step's worth is admitted.

Same workers, same in-flight capacity per worker (one group at a time), same tasks (same run
seed), same judges. Environment time: each sample's sandbox work is real (the task's tests run
in the sandbox), and on top of it a lognormal time (median ``--env-median-s``, sigma
``--env-sigma``, capped at 20 s, seeded by the task) stands for long tool runs; a group waits
for its slowest sample (``rollout.config.EnvLatency``).

Measured from the run's own streams: ``samples_per_s`` is trained samples (``groups_per_step *
group_size`` per version) over the time from the learner's commit of version 1 to that of the
last version (start-up and warm start excluded); ``success_per_min`` is the rise of the
training samples' success (the final versions' against version 0's, as the demo reports it) per
minute from version 0's commit to the last version's. ``speedup`` is the median async
``samples_per_s`` over the median sync one (``--reps`` runs each, interleaved so machine noise
hits both alike; ``speedup_runs`` pairs them rep by rep). ``sweep``: one run per staleness
budget in ``--sweep`` (the arms' runs are reused where the budget matches), the trade-off a user
chooses from.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlstream.ops.bench.common import emit, local_cluster, median, progress


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("async", help="asynchronous vs synchronous GRPO on the Kafka pipeline")
    p.add_argument("--versions", type=int, default=20, help="policy versions per run")
    p.add_argument("--reps", type=int, default=3, help="runs of each arm")
    p.add_argument("--max-staleness", type=int, default=2, help="the async arm's budget")
    p.add_argument("--sweep", default="0,1,2,4,8", help="staleness budgets, one run each")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes")
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--env-median-s", type=float, default=0.3, help="median env time per sample")
    p.add_argument("--env-sigma", type=float, default=1.2, help="lognormal sigma (tail weight)")
    p.add_argument("--minutes", type=float, default=15.0, help="time cap of one run")
    p.add_argument("--home", default=None, help="a running local cluster's state directory")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for both arms' runs, before the bench's own (repeatable)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.versions < 2:
        raise SystemExit("error: --versions must be >= 2")
    if args.max_staleness < 1:
        raise SystemExit("error: --max-staleness (the async arm) must be >= 1; 0 is the sync arm")
    result = run(args)
    emit(result, args.json, _lines(result), name="async")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    budgets = sorted({int(b) for b in args.sweep.split(",") if b.strip()})
    runs: dict[int, list[dict[str, Any]]] = {}
    with (
        local_cluster(args, reuse_default=False) as local,
        tempfile.TemporaryDirectory(prefix="rlstream-async-") as out,
    ):
        home = local.home
        for rep in range(args.reps):
            for budget in (0, args.max_staleness):
                runs.setdefault(budget, []).append(_one(args, home, Path(out), budget, rep))
        for budget in budgets:
            if budget not in runs:
                runs[budget] = [_one(args, home, Path(out), budget, 0)]
    sync, fast = runs[0], runs[args.max_staleness]
    speedup = median([r["samples_per_s"] for r in fast]) / median(
        [r["samples_per_s"] for r in sync]
    )
    return {
        "pipeline": "kafka",
        "speedup": speedup,
        "speedup_runs": [
            a["samples_per_s"] / s["samples_per_s"] for a, s in zip(fast, sync, strict=True)
        ],
        "sync": _summary(sync),
        "async": _summary(fast),
        "sweep": [
            {
                "max_staleness": b,
                "samples_per_s": median([r["samples_per_s"] for r in runs[b]]),
                "success_per_min": median([r["success_per_min"] for r in runs[b]]),
                "mean_staleness": median([r["mean_staleness"] for r in runs[b]]),
                "runs": len(runs[b]),
            }
            for b in budgets
        ],
        "versions": args.versions,
        "workers": args.workers,
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "env_median_s": args.env_median_s,
        "env_sigma": args.env_sigma,
        "max_staleness": args.max_staleness,
        "reps": args.reps,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["samples_per_s"] for r in runs]
    return {
        "samples_per_s": median(rates),
        "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates),
        "success_per_min": median([r["success_per_min"] for r in runs]),
        "runs": runs,
    }


def _one(args: argparse.Namespace, home: Path, out: Path, budget: int, rep: int) -> dict[str, Any]:
    """One demo run with staleness budget ``budget``; its figures from its streams."""
    run = f"bench-async-s{budget}-r{rep}-{int(time.time())}"
    sets = {
        "max_staleness": budget,
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "rollout.env_latency.median_s": args.env_median_s,
        "rollout.env_latency.sigma": args.env_sigma,
        "eval.every": 1_000_000,  # the eval role scores version 0 only, on a few tasks
        "eval.eval_tasks": 4,
        "eval.k": 1,
    }
    cmd = [sys.executable, "-m", "rlstream", "demo", "--json", "--regions", "trainer"]
    cmd += ["--run", run, "--home", str(home), "--out", str(out)]
    cmd += ["--max-versions", str(args.versions), "--minutes", str(args.minutes)]
    cmd += ["--rollout-workers", str(args.workers)]
    for item in [*args.set, *(f"{key}={value}" for key, value in sets.items())]:
        cmd += ["--set", item]
    progress(f"run {run}: max_staleness={budget}, rep {rep + 1} ...")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.minutes * 60 + 600)
    if proc.returncode != 0:
        raise SystemExit(f"error: {run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    demo = json.loads(proc.stdout.strip().splitlines()[-1])
    figures = _figures(home, run, demo, args)
    progress(
        f"  {figures['versions']} versions, {figures['samples_per_s']:.2f} trained samples/s, "
        f"success {demo['warm_start_success']:.2f} -> {demo['final_success']:.2f}, "
        f"mean staleness {figures['mean_staleness']:.2f}"
    )
    return figures


def _figures(
    home: Path, run: str, demo: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    from rlstream.ops import cluster

    settings = cluster.load(home).settings("trainer")
    commits = commits_ms(settings, run)
    last = max(commits)
    if last < 2:
        raise SystemExit(f"error: {run} reached version {last} only; raise --minutes")
    train_s = (commits[last] - commits[1]) / 1000
    rl_min = (commits[last] - commits[0]) / 60_000
    samples = (last - 1) * args.groups_per_step * args.group_size
    staleness = _staleness(settings, run)
    return {
        "run": run,
        "versions": last,
        "samples_per_s": samples / train_s,
        "success_per_min": (demo["final_success"] - demo["warm_start_success"]) / rl_min,
        "warm_start_success": demo["warm_start_success"],
        "final_success": demo["final_success"],
        "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
        "rejected_by_reason": demo["rejected_by_reason"],
    }


def commits_ms(settings: Any, run: str) -> dict[int, int]:
    """Version -> when the learner committed it (its manifest's ``created_ms``)."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.schemas import events, topics

    out: dict[int, int] = {}
    for msg in read_topic(settings, topics.topic_name(run, "weights.manifests"), name="bench"):
        rec = events.decode(msg.value() or b"").record
        out[rec["version"]] = min(out.get(rec["version"], rec["created_ms"]), rec["created_ms"])
    return out


def _staleness(settings: Any, run: str) -> list[int]:
    """The staleness of every admitted group at its admission."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.schemas import events, topics

    out = []
    for msg in read_topic(settings, topics.topic_name(run, "admitted"), name="bench"):
        rec = events.decode(msg.value() or b"").record
        if rec.get("part_index", 0) == 0:
            out.append(int(rec["staleness"]))
    return out


def _lines(r: dict[str, Any]) -> list[str]:
    s, a = r["sync"], r["async"]
    lines = [
        f"pipeline over Kafka, {r['workers']} rollout workers, {r['groups_per_step']} groups of "
        f"{r['group_size']} per step, env time lognormal median {r['env_median_s']} s sigma "
        f"{r['env_sigma']}, {r['versions']} versions per run, {r['reps']} runs per arm",
        f"sync (budget 0): {s['samples_per_s']:.2f} trained samples/s "
        f"({s['samples_per_s_min']:.2f}-{s['samples_per_s_max']:.2f})",
        f"async (budget {r['max_staleness']}): {a['samples_per_s']:.2f} trained samples/s "
        f"({a['samples_per_s_min']:.2f}-{a['samples_per_s_max']:.2f})",
        f"speedup (medians): {r['speedup']:.2f}x; per rep "
        + ", ".join(f"{x:.2f}x" for x in r["speedup_runs"]),
        "sweep: max_staleness  samples/s  success/min  mean staleness",
    ]
    for p in r["sweep"]:
        lines.append(
            f"       {p['max_staleness']:>13}  {p['samples_per_s']:>9.2f}  "
            f"{p['success_per_min']:>11.3f}  {p['mean_staleness']:>14.2f}"
        )
    return lines

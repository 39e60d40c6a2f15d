"""``rlstream launch RECIPE``: every process of a run, started and watched with one command.

The recipe (a file, or a shipped one by name) names the model, the tasks, the judges, the
regions and their clusters; ``ops.run.launch.plan`` turns it into processes, each an
``rlstream run ROLE`` that restarts its role when it fails. The tasks' reference answers are
checked first (``ops.run.task_check``: a task that cannot pass is named and nothing starts);
the run's config is recorded (and a run of that name with another config refused) and its
weight key made before any role starts.
One progress line shows the versions against ``--max-versions`` with an ETA, the success rate,
the staleness and how many processes are up; Ctrl-C (or the bound) stops every process with
SIGTERM, so each drains and commits. ``--dry-run`` prints the commands and starts nothing;
``--prepare`` makes the run and writes its processes as systemd units and a Compose file
(``RUN/deploy/``) for hosts of one's own, starting nothing (``docs/launch.md``). ``--json`` ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Seconds between progress lines.
PROGRESS_EVERY_S = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="start every process of a run from its recipe, and watch it")
    p.add_argument("recipe", help="a recipe file, or a shipped recipe by name (demo, smollm2 ...)")
    p.add_argument("--run", default=None, help="run name (default RECIPE-<time>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-versions", type=int, default=None, help="stop after this policy version")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long")
    p.add_argument("--dry-run", action="store_true", help="print the processes; start nothing")
    p.add_argument(
        "--prepare",
        action="store_true",
        help="make the run (topics, recorded config, weight key) and write its processes as "
        "systemd units and a Compose file under OUT/RUN/deploy; start nothing",
    )
    p.add_argument("--image", default="rlstream:latest", help="image named in the Compose file")
    p.add_argument("--out", default=".rlstream/runs", help="where logs and descriptions go")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.add_argument(
        "--brokers",
        type=int,
        default=None,
        help="brokers of each local region (a new region: default 1; a region created with "
        "another count is refused)",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    from rlstream.ops.run import launch, recorded
    from rlstream.ops.run.config import find_recipe, load_run_config

    path = find_recipe(args.recipe)
    sets = [*args.set]
    if args.max_versions is not None:
        sets.append(f"learner.max_versions={args.max_versions}")
    config = load_run_config(path, sets)
    run = args.run or f"{Path(path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    procs = launch.plan(config)
    shared = launch.shared_args(path, sets)
    home = _home(args, config)
    digest = recorded.config_hash(config)
    if args.dry_run:
        print(f"# run {run}, config {digest}: {len(procs)} processes")
        for p in procs:
            print(shlex.join(p.command(run, shared, home)))
        return 0
    if not _tasks_pass(config):
        return 2
    out = Path(args.out) / run
    try:
        settings = launch.prepare_regions(
            config, run, args.home, args.brokers, authorize=_authorizer(args, config, run)
        )
    except recorded.ConfigMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trainer = config.regions.trainer
    keys = _run_keys(settings[trainer], run, config, args)
    deploy = _describe(out / "deploy", run, procs, shared, keys, home, args.image)
    print(f"run {run}: config {digest} recorded; processes described in {deploy}", flush=True)
    if args.prepare:
        return 0
    return _run_processes(args, run, config, procs, shared, settings, keys, out, digest)


def _tasks_pass(config: Any) -> bool:
    """The self-check of the run's tasks (``ops.run.task_check``); False, with every broken
    task named, when one cannot pass."""
    from rlstream.ops.run.task_check import check_tasks

    found = check_tasks(config, lambda line: print(line, flush=True))
    unchecked = "".join(f"; {n}: {why}" for n, why in found.unchecked.items())
    if found.broken:
        for why in found.broken:
            print(f"error: {why}", file=sys.stderr)
        print(
            f"error: {len(found.broken)} of {found.checked} tasks cannot pass their own tests: "
            "fix or remove them (`rlstream env score --tasks FILE --canonical` names them)",
            file=sys.stderr,
        )
        return False
    cached = " (checked before)" if found.cached else ""
    passed = f"{found.checked} references pass{cached}" if found.checked else "none checked"
    print(f"tasks: {passed}{unchecked}", flush=True)
    return True


def _authorizer(args: argparse.Namespace, config: Any, run: str) -> Any:
    """On a secured local cluster, the run's users and ACLs applied in every region as admin
    (as ``demo --secure`` does), so each role connects as its own user; else None."""
    from rlstream.ops import cluster
    from rlstream.ops.cli.cmd_demo import authorize_run

    home = _home(args, config)
    if home is None or not any(r.secure for r in cluster.load(Path(home)).regions.values()):
        return None
    regions, where = config.regions.topology(), Path(home)
    return lambda _state, settings: authorize_run(run, regions, settings, where)


def _home(args: argparse.Namespace, config: Any) -> str | None:
    """The local cluster's state folder when a region of the run is local, else None."""
    from rlstream.ops import cluster

    local = [r for r in config.regions.topology().names if r not in config.regions.clusters]
    if not local:
        return None
    return str(Path(args.home).resolve() if args.home else cluster.default_home())


def _run_keys(settings: Any, run: str, config: Any, args: argparse.Namespace) -> Any:
    """The run's weight keys, made and recorded now (``demo.sign_weights``): the private key in
    the learner's own state folder, where a learner restarted by hand finds it (on a secured
    local cluster, in the cluster's secrets, where ``acl apply`` made it)."""
    from rlstream.ops import cluster
    from rlstream.ops.cluster import security
    from rlstream.ops.demo import demo
    from rlstream.producers.weights.signing import KEY_FILE

    learner = config.role("learner")
    key_file = Path(learner.state_dir) / run / KEY_FILE
    home = _home(args, config)
    if home is not None and any(r.secure for r in cluster.load(Path(home)).regions.values()):
        key_file = security.weights_key_file(Path(home), run)
    return demo.sign_weights(settings, run, key_file, learner.insecure_weights)


def _describe(folder: Path, run, procs, shared, keys, home, image) -> Path:
    from rlstream.ops.run import launch

    folder.mkdir(parents=True, exist_ok=True)
    for name, text in launch.systemd_units(run, procs, shared, keys, home).items():
        (folder / name).write_text(text)
    (folder / "compose.json").write_text(launch.compose_file(run, procs, shared, keys, image))
    return folder


def _run_processes(args, run, config, procs, shared, settings, keys, out, digest) -> int:
    from rlstream.consumers.consumer import Stopper
    from rlstream.ops.demo import demo
    from rlstream.ops.run.recorded import record_run_manifest

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from rlstream.ops import cluster

    # a role finds a local region in the state folder, a recipe's cluster in the recipe
    home = _home(args, config) or str(cluster.default_home())
    started = demo.start_plan(procs, run, settings, logs, shared, keys, home)
    print(f"run {run}: {len(started)} processes started; logs in {logs}", flush=True)
    regions = config.regions.topology()
    progress, stopper = demo.RunAnalytics(run), Stopper().install()
    follower = threading.Thread(
        target=demo.follow_streams,
        args=(settings[regions.trainer], run, progress, stopper, regions),
        daemon=True,
    )
    follower.start()
    t0 = time.monotonic()
    target = config.learner.max_versions
    try:
        why = _watch(args, started, progress, stopper, t0, target)
        if why == "max_versions":  # the learner stops itself there: let it finish its commit
            learner = next(r for r in started if r.name == "learner")
            with contextlib.suppress(subprocess.TimeoutExpired):
                learner.proc.wait(30)
    finally:
        stopper.stop()
        demo.stop_roles(started, timeout=60)
        follower.join(timeout=10)
    wall = time.monotonic() - t0
    now = int(time.time() * 1000)
    record_run_manifest(
        settings[regions.trainer], run, config, "finished", now, list(regions.names)
    )
    codes = {r.name: r.proc.returncode for r in started}
    final = progress.final_versions() or sorted(progress.success)[-1:]
    rate = progress.rate(final)
    result = {
        "run": run,
        "config_hash": digest,
        "versions": progress.version,
        "final_success": None if math.isnan(rate) else round(rate, 4),
        "final_versions": final,
        "wall_seconds": round(wall, 1),
        "stopped": why,
        "exit_codes": codes,
        "logs": str(logs),
    }
    judged = f"success {rate:.2f} (v{min(final)}-v{max(final)})" if final else "nothing judged"
    print(f"\nrun {run} stopped ({why}) after {wall:.0f}s: policy v{progress.version}, {judged}")
    if args.json:
        print(json.dumps(result))
    return 0 if why in ("max_versions", "minutes", "interrupted") else 1


def _watch(args, started, progress, stopper, t0: float, target: int) -> str:
    """Until the run is done, bounded, interrupted or a process gives up; returns why."""
    last = 0.0
    while not stopper.stopped:
        time.sleep(0.5)
        elapsed = time.monotonic() - t0
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            print(progress_line(progress, started, elapsed, target), flush=True)
            last = time.monotonic()
        if progress.version >= target:
            return "max_versions"
        if args.minutes is not None and elapsed > args.minutes * 60:
            return "minutes"
        for r in started:
            code = r.proc.poll()
            if code is None:
                continue
            if r.name == "learner" and code == 0:  # it stops itself at learner.max_versions
                return "max_versions"
            print(f"process {r.name} exited ({code}); see {r.log}", file=sys.stderr)
            return f"{r.name} exited {code}"
    return "interrupted"


def progress_line(progress: Any, started: list, elapsed: float, target: int) -> str:
    """``[####------] v12/50  ETA 3m10s  success 0.42  staleness 0.8  9/9 up``."""
    done = min(progress.version, target)
    width = 20
    bar = "#" * round(width * done / max(target, 1))
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = f"{(target - done) / rate:.0f}s" if rate > 0 and done < target else "-"
    newest = sorted(progress.success)[-2:]
    success = f"{progress.rate(newest):.2f}" if newest else "-"
    version = f"v{progress.version}" if progress.version >= 0 else "v-"
    up = sum(1 for r in started if r.proc.poll() is None)
    return (
        f"[{bar:<{width}}] {version}/{target}  {elapsed:.0f}s  ETA {eta}  success {success}  "
        f"staleness {progress.mean_recent_staleness() or 0.0:.1f}  {up}/{len(started)} up"
    )

"""``rlstream demo``: the main job on the embedded default (see ``ops.demo``)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole asynchronous GRPO pipeline on the local cluster")
    p.add_argument("--run", default=None, help="run name (default demo-<time>)")
    p.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of the RL phase")
    p.add_argument("--max-versions", type=int, default=200, help="stop after this policy version")
    p.add_argument("--rollout-workers", type=int, default=2, help="rollout processes")
    p.add_argument("--config", default=None, help="TOML recipe (default ops/recipes/demo.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=".rlstream/runs", help="where logs and the PNG go")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from rlstream.consumers.consumer import Stopper
    from rlstream.ops import cluster, demo
    from rlstream.ops.config import load_run_config
    from rlstream.producers.admin import ensure_run_topics
    from rlstream.producers.settings import KafkaSettings
    from rlstream.trainer.learner_step import LearnerConfig, init_model

    run = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    out = Path(args.out) / run
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cache = str(Path(args.out) / "warm-start.pt")
    # Every role gets the same overrides; the run manifest records the config they resolve to.
    sets = [
        *args.set,
        f"learner.warm_start_cache={cache}",
        f"learner.state_dir={out / 'learner'}",
        f"learner.max_versions={args.max_versions}",
    ]
    config = load_run_config(args.config, sets)
    extra = ["--config", args.config] if args.config else []
    for item in sets:
        extra += ["--set", item]
    state = cluster.up(["trainer"], home=args.home)
    settings = KafkaSettings(bootstrap_servers=state.bootstrap("trainer"))
    ensure_run_topics(settings, run)
    demo.record_run_manifest(settings, run, config, "running", int(time.time() * 1000), ["trainer"])
    print(f"run {run}: logs in {out / 'logs'}, Kafka at {settings.bootstrap_servers}", flush=True)
    print("warm start (supervised, cached) ...", flush=True)
    learner_cfg = config.role("learner")
    assert isinstance(learner_cfg, LearnerConfig)
    init_model(learner_cfg, lambda line: print(f"  {line}", flush=True))
    roles = [
        demo.start_role("learner", run, settings, out / "logs", extra),
        demo.start_role("admission", run, settings, out / "logs", extra),
    ]
    roles += [
        demo.start_role(
            "judge", run, settings, out / "logs", ["--name", name, *extra], f"judge-{name}"
        )
        for name in config.judges
    ]
    roles += [
        demo.start_role(
            "rollout", run, settings, out / "logs", ["--member", str(i), *extra], f"rollout-{i}"
        )
        for i in range(args.rollout_workers)
    ]
    roles.append(demo.start_role("scheduler", run, settings, out / "logs", extra))
    progress, stopper = demo.RunAnalytics(run), Stopper().install()
    follower = threading.Thread(
        target=demo.follow_streams, args=(settings, run, progress, stopper), daemon=True
    )
    follower.start()
    started = time.monotonic()
    try:
        _watch(args, roles, progress, stopper, started)
    finally:
        stopper.stop()
        demo.stop_roles(roles)
        follower.join(timeout=10)
    wall = time.monotonic() - started
    png = out / "success_by_version.png"
    demo.write_png(progress, png)
    demo.record_run_manifest(
        settings, run, config, "finished", int(time.time() * 1000), ["trainer"]
    )
    result = demo.summary(run, progress, wall, png)
    print(
        f"\nrun {run} finished in {wall:.0f}s: policy v{result['policy_versions']}, success "
        f"{result['warm_start_success']:.2f} (warm start, v0) -> {result['final_success']:.2f} "
        f"(v{min(result['final_versions'] or [0])}-v{max(result['final_versions'] or [0])}); "
        f"{result['groups_admitted']} groups admitted, {result['groups_rejected']} rejected "
        f"{result['rejected_by_reason']}"
    )
    print(f"plot: {png}\nlogs: {out / 'logs'}\nstop the cluster with `rlstream cluster down`")
    if args.json:
        print(demo.dumps(result))
    return 0


def _watch(args, roles, progress, stopper, started) -> None:
    from rlstream.ops import demo

    last = 0.0
    while not stopper.stopped:
        time.sleep(1.0)
        elapsed = time.monotonic() - started
        if time.monotonic() - last >= 5:
            print(demo.status_line(progress, started), flush=True)
            last = time.monotonic()
        dead = [r for r in roles if r.proc.poll() is not None and r.name != "scheduler"]
        if dead:
            print(
                f"role {dead[0].name} exited ({dead[0].proc.returncode}); see {dead[0].log}",
                file=sys.stderr,
            )
            return
        if elapsed > args.minutes * 60 or progress.version >= args.max_versions:
            return

"""``rlstream demo``: the main job on the embedded default (see ``ops.demo.demo``).

Multi-region by default (``--regions trainer,eu``): the first region (or ``trainer``) trains, the
others roll out; the rollout workers run outside the trainer region, spread over the rollout
regions, and every role agrees on the regions through the run config (``regions.*``).
``--secure`` runs on the secured local cluster: the run's users, topics and ACLs are applied in
every region (each region's own plan, ``rlstream acl apply --region R``) and on every link, and
each role connects as its own user, a rollout worker in a rollout region too. Without
``--secure`` on a cluster started secured, the roles connect as ``admin`` and the links are still
given the run's streams. ``--feedback N`` adds N simulated editor users (``ops.demo.editors``): they
ask ``serve policy`` for completions and send feedback through ``serve feedback``, and
feedback-rl trains on it beside the rollouts."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlstream.producers.weights.run_keys import RunKeys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole asynchronous GRPO pipeline on the local cluster")
    p.add_argument("--run", default=None, help="run name (default demo-<time>)")
    p.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of the RL phase")
    p.add_argument("--max-versions", type=int, default=200, help="stop after this policy version")
    p.add_argument(
        "--rollout-workers",
        type=int,
        default=2,
        help="rollout processes, spread over the rollout regions",
    )
    p.add_argument(
        "--regions",
        default="trainer,eu",
        help="comma-separated regions, the trainer region first (default: trainer,eu); "
        "one region runs everything there",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="learner ranks on torch.distributed (sets learner.ranks; default the recipe's, 1)",
    )
    p.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="rollout engine: torch in process, or vllm (servers the workers start from "
        "`make vllm`'s venv; the policy's heads become 64 wide, which vLLM's CPU build runs)",
    )
    p.add_argument(
        "--brokers",
        type=int,
        default=None,
        help="brokers of each local region (a new region: default 1; 3 replicates every topic, "
        "see docs/kafka.md; a region created with another count is refused, not reused); the "
        "recipe's regions.brokers wins for the regions it names",
    )
    p.add_argument(
        "--feedback",
        type=int,
        default=0,
        metavar="USERS",
        help="simulated editor users who request completions from `serve policy` and send "
        "feedback through `serve feedback`; feedback-rl trains on it beside the rollouts",
    )
    p.add_argument("--config", default=None, help="TOML recipe (default ops/recipes/demo.toml)")
    p.add_argument(
        "--recipe",
        default=None,
        metavar="NAME",
        help="a shipped recipe by name (ops/recipes/NAME.toml, e.g. smollm2); or use --config",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="your own model: a folder `rlstream model import` made (or any local HF folder of "
        "a supported type); sets policy.hf_dir, its own tokenizer and chat template are used",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=".rlstream/runs", help="where logs and the PNG go")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.add_argument(
        "--secure",
        action="store_true",
        help="on the secured local cluster (SASL/SCRAM over TLS, ACLs enforced, secured "
        "MirrorMaker 2 links): the run's users, topics and ACLs applied in every region, every "
        "role connected as its own user",
    )
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from rlstream.consumers.consumer import Stopper
    from rlstream.ops.demo import demo
    from rlstream.ops.run import recorded
    from rlstream.ops.run.config import load_run_config
    from rlstream.producers.client.settings import log_librdkafka_to
    from rlstream.trainer.config import LearnerConfig
    from rlstream.trainer.learner_step import init_model

    if args.feedback and args.secure:
        raise SystemExit("error: --feedback runs on an unsecured cluster only for now")
    args.config, args.set = demo.recipe_and_model(args.config, args.recipe, args.model, args.set)
    names = [r.strip() for r in args.regions.split(",") if r.strip()] or ["trainer"]
    run = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    out = Path(args.out) / run
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # librdkafka's own lines (BGQUEUE, GETPID ...) go beside the role logs, not between the
    # progress lines
    log_librdkafka_to(logging.FileHandler(out / "logs" / "demo-kafka-clients.log"))
    cache = str(
        Path(args.out) / ("warm-start.pt" if args.engine == "torch" else "warm-start-vllm.pt")
    )
    # Every role gets the same overrides; the run manifest records the config they resolve to.
    sets = [
        *args.set,
        f"learner.warm_start_cache={cache}",
        f"learner.state_dir={out / 'learner'}",
        f"learner.max_versions={args.max_versions}",
        f"tracker.artifacts_dir={out}",
        f"regions.trainer={names[0]}",
        f"regions.rollout={json.dumps(names[1:])}",
        *([f"learner.ranks={args.ranks}"] if args.ranks else []),
        *demo.engine_sets(args.engine, out),
        *(demo.FEEDBACK_SETS if args.feedback else []),
    ]
    config = load_run_config(args.config, sets)
    regions = config.regions.topology()
    extra = ["--config", args.config] if args.config else []
    for item in sets:
        extra += ["--set", item]
    settings = _start_regions(args, run, config, regions)
    home = settings[regions.trainer]
    print(f"run {run}: logs in {out / 'logs'}, regions {_where(settings, regions)}", flush=True)
    print("warm start (supervised, cached) ...", flush=True)
    learner_cfg = config.role("learner")
    assert isinstance(learner_cfg, LearnerConfig)
    init_model(learner_cfg, lambda line: print(f"  {line}", flush=True))
    key_file = demo.learner_key_file(args.secure, _home(args), run, out)
    keys = demo.sign_weights(home, run, key_file, learner_cfg.insecure_weights)
    procs = _processes(args, config)
    users = _role_users(args, run, out, procs, cache) if args.secure else None
    roles = _start_roles(args, run, procs, settings, out / "logs", extra, keys, users)
    tracker = demo.start_role(
        "tracker",
        run,
        home,
        out / "logs",
        extra,
        region=regions.trainer,
        home=_home(args) if users is not None and users.enabled else None,
        env={**keys.env("tracker"), **(users.env("tracker") if users else {})},
    )
    services: list[Any] = []
    editors = None
    if args.feedback:
        from rlstream.ops.demo import editors as editor_users

        print(f"{args.feedback} editor users: serve policy and serve feedback ...", flush=True)
        services, editors = editor_users.start(
            run, home, out / "logs", extra, config, args.feedback, keys
        )
    progress, tally, stopper = demo.RunAnalytics(run), demo.RegionTally(), Stopper().install()
    follower = threading.Thread(
        target=demo.follow_streams,
        args=(home, run, progress, stopper, regions, tally),
        daemon=True,
    )
    follower.start()
    started = time.monotonic()
    try:
        _watch(
            args,
            roles,
            progress,
            stopper,
            started,
            lambda: tally.figures(regions, progress.version),
        )
        if editors is not None:
            editors.stop()
        trainers = [r for r in roles if r.name != "eval"]
        demo.stop_roles(trainers)  # the eval role finishes the last due version first
        due = demo.last_due(progress.version, config.eval.every)
        demo.wait_for_eval(home, run, due, [r for r in roles if r.name == "eval"])
    except BaseException:
        demo.stop_roles([tracker])  # otherwise stopped last, after the final model is written
        raise
    finally:
        stopper.stop()
        if editors is not None:
            editors.stop()
        for service in services:
            service.stop()
        demo.stop_roles(roles)
        follower.join(timeout=10)
    wall = time.monotonic() - started
    png = out / "success_by_version.png"
    evals = demo.eval_summary(home, run, config.model)
    demo.write_png(progress, png, evals["eval_curve"])
    now = int(time.time() * 1000)
    recorded.record_run_manifest(home, run, config, "finished", now, list(regions.names))
    result = demo.summary(run, progress, wall, png, regions, tally)
    result.update(evals)
    result.update(demo.final_model(home, run, config, progress.version, out))
    result["tracking"] = demo.stop_tracker(tracker, out)
    result.update(demo.weights_summary(home, run, config))
    result["learner_ranks"] = learner_cfg.ranks
    result["model"] = demo.model_record(config.policy)
    result["os_users"] = (
        users.record() if users else {"enabled": False, "reason": "not secured", "users": {}}
    )
    result.update(demo.throughput(home, run, config.model, regions))
    result.update(demo.engine_summary(out / "engines"))
    result["feedback"] = None
    if editors is not None:
        from rlstream.ops.demo.editors import trained_online_groups

        result["feedback"] = {**editors.figures(), **trained_online_groups(home, run)}
    _print_summary(run, result, wall, png, out)
    if args.json:
        print(demo.dumps(result))
    return 0


def _start_regions(args, run, config, regions) -> dict:
    """Start the local regions and their MirrorMaker 2 links; create each region's topics;
    record the run's config (``ops.run.launch.prepare_regions``)."""
    from rlstream.ops.run import launch, recorded

    authorize = None
    if args.secure:

        def authorize(_state, settings) -> None:
            authorize_run(run, regions, settings, _home(args))

    try:
        settings = launch.prepare_regions(
            config, run, args.home, args.brokers, True if args.secure else None, authorize
        )
    except recorded.ConfigMismatch as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"run {run}: config {recorded.config_hash(config)} recorded", flush=True)
    return settings


def authorize_run(run: str, regions, settings: dict, home: Path) -> None:
    """As admin: each region's users, topics and ACLs for the run, then the links' ACLs."""
    from rlstream.ops import cluster
    from rlstream.ops.cli.cmd_acl import apply

    for name in regions.names:
        counts = apply(settings[name], run, home, regions, name)
        print(
            f"run {run}, region {name}: {counts['users']} users, {counts['acls']} ACLs applied",
            flush=True,
        )
    links = cluster.authorize_links(cluster.load(home), run)
    if links:
        print(f"run {run}: {links} MirrorMaker 2 ACLs on the links", flush=True)


def _processes(args, config) -> list:
    """The run's processes (``ops.run.launch.plan``), the tracker apart: it is stopped last."""
    from rlstream.ops.run.launch import plan

    return [
        p for p in plan(config, args.rollout_workers, bool(args.feedback)) if p.role != "tracker"
    ]


def _start_roles(args, run, procs, settings, logs: Path, extra, keys: RunKeys, users) -> list:
    """``procs``, each in its region and given its part of the run's ``keys`` (the signing key
    file: the learner alone); secured, each finds the cluster in the state folder as its own
    Kafka user, and runs as its own OS user where ``users`` says so."""
    from rlstream.ops.demo import demo

    home = _home(args) if args.secure else None
    return demo.start_plan(procs, run, settings, logs, extra, keys, home, users)


def _role_users(args, run: str, out: Path, procs: list, cache: str):
    """A secured demo's roles, each as an OS user of its own (``ops.run.os_users``): the
    learner owns its state folder, the rollout workers their engine figures, the tracker the
    run's folder (its store and uploads); where the host does not allow it, the downgrade is
    said here and recorded in the summary (``os_users``)."""
    from rlstream.ops.run import os_users

    roles = sorted({p.role for p in procs} | {"tracker"})
    writes = {"learner": [out / "learner"], "rollout": [out / "engines"]}
    reads = [out, Path(cache), *([Path(args.config)] if args.config else [])]
    users = os_users.prepare(roles, writes, reads)
    if not users.enabled:
        print(f"run {run}: every role runs as this user: {users.reason}", flush=True)
        return users
    tracker = users.users["tracker"]
    os.chown(out, tracker.pw_uid, tracker.pw_gid)  # the folder alone: the logs stay ours
    names = ", ".join(f"{r} as {u.pw_name}" for r, u in sorted(users.users.items()))
    print(f"run {run}: roles as their own OS users: {names}", flush=True)
    return users


def _home(args) -> Path:
    from rlstream.ops import cluster

    return Path(args.home) if args.home else cluster.default_home()


def _where(settings, regions) -> str:
    return ", ".join(
        f"{n} ({'trainer' if n == regions.trainer else 'rollout'}) at {s.bootstrap_servers}"
        for n, s in settings.items()
    )


def _print_summary(run: str, result: dict, wall: float, png: Path, out: Path) -> None:
    print(
        f"\nrun {run} finished in {wall:.0f}s: policy v{result['policy_versions']}, success "
        f"{result['warm_start_success']:.2f} (warm start, v0) -> {result['final_success']:.2f} "
        f"(v{min(result['final_versions'] or [0])}-v{max(result['final_versions'] or [0])}); "
        f"{result['groups_admitted']} groups admitted, {result['groups_rejected']} rejected "
        f"{result['rejected_by_reason']}"
    )
    if result.get("eval_final") is not None:
        print(
            f"  held-out eval ({result['eval_tasks']} tasks never trained on): greedy success "
            f"{result['eval_warm_start']:.2f} (v0) -> {result['eval_final']:.2f} "
            f"(v{result['eval_final_version']}), pass@{result['k']} "
            f"{result['eval_pass_at_k_warm_start']:.2f} -> {result['eval_pass_at_k']:.2f}; "
            f"released {result['eval_released']}"
        )
    for name, r in result["regions"].items():
        role = "trainer" if name == result["trainer_region"] else "rollout"
        print(
            f"  region {name} ({role}): {r['trajectories_admitted']} trajectories admitted, "
            f"weights v{r['weights_version']}"
        )
    if result.get("engine"):
        p50 = result["swap_p50_s"]
        memory = result["engine_memory_bytes"]
        print(
            f"  engine {result['engine']} {result['engine_version']}: "
            f"{result['engine_swaps']} swaps (p50 {'-' if p50 is None else f'{p50:.3f}s'}), "
            f"{result['engine_restarts']} restarts"
            + ("" if memory is None else f", {memory / 2**30:.1f} GiB per worker's engine")
        )
    if result.get("feedback"):
        f = result["feedback"]
        print(
            f"  editor feedback: {f['users']} users, {f['requests']} requests, "
            f"{f['accepted']} completions accepted and {f['rejected']} rejected; online groups "
            f"{f['online_groups_admitted']} admitted, {f['online_groups_trained']} trained"
            + (f"; {f['errors']} errors, last: {f['last_error']}" if f["errors"] else "")
        )
    if result.get("model_dir"):
        print(f"final policy v{result['final_version']} (HF): {result['model_dir']}")
    print(f"plot: {png}\nlogs: {out / 'logs'}\nstop the cluster with `rlstream cluster down`")


def _watch(args, roles, progress, stopper, started, regions) -> None:
    from rlstream.ops.demo import demo

    last = 0.0
    while not stopper.stopped:
        time.sleep(1.0)
        elapsed = time.monotonic() - started
        if time.monotonic() - last >= 5:
            print(demo.status_line(progress, started, regions()), flush=True)
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

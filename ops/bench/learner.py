"""``rlstream bench learner``: trained samples per second of the learner's step on 1 and 2
ranks (torch.distributed, gloo on CPU), and packed against right-padded batches.

The groups are real rollouts of the demo's warm-started policy (the demo recipe's learner
config: its policy, GRPO rules and publish dtype) on tasks of the demo's family, made once and
fed to every rank count in the same order; rewards alternate 0/1 within a group (the step's
cost does not depend on them). Per rank count N: N processes (``trainer.distributed.Ranks``; N
= 1 is the one-process learner), each with the model and a sharded ``WeightPublisher`` on a
fresh run's topics; after version 0 and one untimed step, ``--steps`` timed steps each train
``--groups-per-step`` groups (every rank its slice, gradients averaged: ``learner_step.
train_step``) and publish the version (every rank its shard, rank 0 commits the manifest):
what the learner role does per step, without reading the admitted stream.
``samples_per_s`` = samples trained / rank 0's wall time of the timed steps.
Each rank runs one torch thread; the one-rank learner is measured twice, on one thread and on
every core (``threads``), so that N ranks are compared with one process given the same cores.
The machine's cores are shared by the ranks (and the broker): N ranks on fewer than N free
cores cannot be N times faster.

``packing`` (one process, one thread, no Kafka): the same groups' steps trained right-padded
and packed (``grpo.pack_tokens`` = the longest context unless ``--pack-tokens``), from the same
weights, the two arms alternating step by step; ``tokens_per_s`` = real (non-padding) tokens of
the step's contexts / the median step time, ``packing_speedup`` = packed / padded, and the
contexts' length distribution (``lengths``: min, p10, p50, p90, max) and padding share.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlstream.schemas.derive import derive

MODEL = "policy"


def register_bench(bench_subparsers: Any) -> None:
    """Add ``learner`` to the ``rlstream bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "learner",
        help="trained samples per second of the learner's step, 1 and 2 ranks",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--ranks", default="1,2", help="rank counts to measure")
    p.add_argument("--steps", type=int, default=6, help="timed steps per rank count")
    p.add_argument("--groups-per-step", type=int, default=4, help="groups per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per group")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per rollout")
    p.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (recipe's)")
    p.add_argument("--cache", default=None, help="warm-start cache file")
    p.add_argument("--pack-tokens", type=int, default=0, help="packed row size (0: longest)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override (e.g. policy.d_model=256), before the bench's own (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap (default: local cluster)")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.ops.bench.common import bench_kafka, emit

    with (
        tempfile.TemporaryDirectory(prefix="rlstream-bench-learner-") as tmp,
        bench_kafka(args) as settings,
    ):
        result = run(args, settings, Path(tmp))
    lines = [
        f"{r['ranks']} rank(s), {r['threads']} thread(s): {r['samples_per_s']:.2f} trained samples/s "
        f"(train {r['train_s']:.2f}s, publish {r['publish_s']:.2f}s over {r['steps']} steps)"
        for r in result["runs"]
    ]
    pk = result["packing"]
    lines.append(
        f"packed {pk['packed']['tokens_per_s']:.0f} vs padded {pk['padded']['tokens_per_s']:.0f} "
        f"tokens/s: packing_speedup {pk['packing_speedup']:.2f} (contexts {pk['lengths']})"
    )
    emit(result, args.json, [] if args.json else lines, "learner")
    return 0


def _config(args: argparse.Namespace, cache: str) -> Any:
    from rlstream.ops.run.config import load_run_config

    sets = [*args.set, f"learner.warm_start_cache={cache}"]
    sets.append(f"groups_per_step={args.groups_per_step}")
    if args.warm_steps is not None:
        sets.append(f"learner.warm_start.steps={args.warm_steps}")
    return load_run_config(None, sets).role("learner")


def _groups(args: argparse.Namespace, cfg: Any, count: int) -> list[dict[str, Any]]:
    """``count`` admitted-like groups of real rollouts of the warm-started policy."""
    import torch

    from rlstream.envs import fx_tasks as tasks
    from rlstream.rollout.config import HarnessConfig
    from rlstream.rollout.harness import Rollout
    from rlstream.schemas import arrays
    from rlstream.trainer.learner_step import init_model

    model, _ = init_model(cfg, lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    rollout = Rollout(
        model, HarnessConfig(max_new_tokens=args.max_new_tokens, inference_dtype="bfloat16")
    )
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        task = tasks.sample_task(1_000_003 + i)
        samples = []
        for j, s in enumerate(rollout.group(task.prompt, args.group_size, gen)):
            fields = arrays.pack_tokens(s.token_ids, s.logprobs, s.loss_mask, s.routes)
            # a compacted sample trains as its contexts, as admission's records say
            bounds = (
                [v for g in s.segments for v in (g.start, g.end)] if len(s.segments) > 1 else []
            )
            samples.append(
                {
                    **fields,
                    "segment_bounds": bounds,
                    "reward": float(j % 2),
                    "passed": bool(j % 2),
                    "policy_version": 0,
                }
            )
        out.append({"group_id": f"g{i}", "samples": samples, "staleness": 0})
    return out


def _rank(
    rank: int,
    world: int,
    port: int,
    settings: Any,
    run: str,
    cfg: Any,
    groups: list,
    threads: int,
    out: Any,
) -> None:  # pragma: no cover (runs in a spawned process)
    import torch

    from rlstream.ops.bench.common import run_signer
    from rlstream.producers.weights.publisher import rank_publisher
    from rlstream.schemas import topics
    from rlstream.trainer.learner_step import StepInput, init_model, published_state, train_step

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    ranks = None
    if world > 1:
        from rlstream.trainer.distributed import RankEnv, Ranks

        ranks = Ranks(RankEnv(rank, world, "127.0.0.1", port), backend="gloo")
    model, optimizer = init_model(cfg, lambda line: None)
    if ranks is not None:
        optimizer = ranks.adopt(model, optimizer)
    txn_id = f"{topics.group_id(run, 'learner')}.0"
    signer = run_signer(settings, run) if rank == 0 else None
    pub = rank_publisher(settings, run, MODEL, txn_id, ranks, cfg.keyframe_every, signer)
    producer = pub.producer
    pub.publish_version(published_state(model, cfg.publish_dtype), 0)
    b = cfg.groups_per_step
    steps = [
        [
            StepInput(g, [("admitted", 0, b * s + k)])
            for k, g in enumerate(groups[b * s : b * (s + 1)])
        ]
        for s in range(len(groups) // b)
    ]
    train_s = publish_s = 0.0
    samples = 0
    for version, used in enumerate(steps, start=1):
        t0 = time.perf_counter()
        train_step(model, optimizer, used, cfg, ranks)
        t1 = time.perf_counter()
        pub.publish_version(published_state(model, cfg.publish_dtype), version)
        t2 = time.perf_counter()
        if version > 1:  # the first step warms up
            train_s, publish_s = train_s + t1 - t0, publish_s + t2 - t1
            samples += sum(len(item.group["samples"]) for item in used)
    if rank == 0:
        out.put({"samples": samples, "train_s": train_s, "publish_s": publish_s})
    pub.close()
    producer.wait(30)
    if ranks is not None:
        ranks.close()


def _measure(
    settings: Any, run: str, cfg: Any, groups: list, world: int, threads: int
) -> dict[str, Any]:
    from rlstream.ops.run.ranks import run_local_ranks

    return run_local_ranks(_rank, world, (settings, run, cfg, groups, threads), "learner")


def run(args: argparse.Namespace, settings: Any, tmp: Path) -> dict[str, Any]:
    """Measure every rank count in ``args.ranks``; returns the figures (module docstring)."""
    from rlstream.ops.bench.common import progress
    from rlstream.producers.client.admin import admin_client, ensure_run_topics
    from rlstream.schemas import topics

    cfg = _config(args, args.cache or str(tmp / "warm.pt"))
    worlds = [int(x) for x in str(args.ranks).split(",") if x.strip()]
    progress(f"rolling out {(args.steps + 1) * args.groups_per_step} groups of {args.group_size}")
    groups = _groups(args, cfg, (args.steps + 1) * args.groups_per_step)
    runs = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cores = os.cpu_count() or 1
    arms = [(w, t) for w in worlds for t in ([1, cores] if w == 1 and cores > 1 else [1])]
    for world, threads in arms:
        run_name = f"bench-learner-{stamp}-{world}x{threads}"
        ensure_run_topics(settings, run_name)
        progress(
            f"{world} rank(s), {threads} thread(s): {args.steps} timed steps of "
            f"{args.groups_per_step} groups"
        )
        f = _measure(settings, run_name, cfg, groups, world, threads)
        total = f["train_s"] + f["publish_s"]
        runs.append(
            {
                "ranks": world,
                "threads": threads,
                "samples_per_s": round(f["samples"] / total, 3),
                "samples": f["samples"],
                "steps": args.steps,
                "train_s": round(f["train_s"], 3),
                "publish_s": round(f["publish_s"], 3),
            }
        )
        admin_client(settings).delete_topics(list(topics.run_topics(run_name).values()))
    progress("packed vs padded steps")
    return {
        "runs": runs,
        "packing": packing_figures(cfg, groups, args.groups_per_step, args.pack_tokens),
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "architecture": cfg.policy.architecture,
        "policy": cfg.policy.model_dump(exclude_none=True),
        "params": _params(cfg),
    }


def packing_figures(
    cfg: Any, groups: list, groups_per_step: int, pack_tokens: int
) -> dict[str, Any]:
    """Padded against packed steps on ``groups`` (module docstring), one thread."""
    import statistics

    import numpy as np
    import torch

    from rlstream.rollout.model import clone_policy
    from rlstream.trainer.learner_step import StepInput, group_sequences, init_model, train_step
    from rlstream.trainer.packing import pack_rows

    torch.set_num_threads(1)
    steps = [
        [StepInput(g) for g in groups[i : i + groups_per_step]]
        for i in range(0, len(groups) - groups_per_step + 1, groups_per_step)
    ]
    lengths = [len(s.token_ids) for g in groups for s in group_sequences(g, cfg.grpo)[0]]
    width = pack_tokens or max(lengths)
    model, _ = init_model(cfg, lambda line: None)
    arms: dict[str, Any] = {}
    for name, size in (("padded", 0), ("packed", width)):
        arm_cfg = derive(cfg, grpo=derive(cfg.grpo, pack_tokens=size))
        m = clone_policy(model)
        arms[name] = (arm_cfg, m, torch.optim.Adam(m.parameters(), lr=cfg.lr), [])
    for k, used in enumerate(steps):
        for arm_cfg, m, opt, times in arms.values():
            t0 = time.perf_counter()
            train_step(m, opt, used, arm_cfg)
            if k > 0:  # the first step warms up
                times.append(time.perf_counter() - t0)
    per_step = [
        [len(s.token_ids) for g in used for s in group_sequences(g.group, cfg.grpo)[0]]
        for used in steps[1:]
    ]
    tokens = statistics.median(sum(n) for n in per_step)
    out: dict[str, Any] = {}
    for name, (_, _, _, times) in arms.items():
        med = statistics.median(times)
        out[name] = {"step_s_median": round(med, 4), "tokens_per_s": round(tokens / med, 1)}
    real = sum(sum(n) for n in per_step)
    padded_slots = sum(len(n) * max(n) for n in per_step)
    packed_slots = sum(len(pack_rows(n, max(width, *n))) * max(width, *n) for n in per_step)
    out["padded"]["padding_share"] = round(1 - real / padded_slots, 3)
    out["packed"]["padding_share"] = round(1 - real / packed_slots, 3)
    pct = np.percentile(lengths, [0, 10, 50, 90, 100]).round(1).tolist()
    return {
        **out,
        "packing_speedup": round(out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"], 3),
        "pack_tokens": width,
        "threads": 1,
        "timed_steps": len(per_step),
        "lengths": dict(zip(["min", "p10", "p50", "p90", "max"], pct, strict=True)),
    }


def _params(cfg: Any) -> int:
    """Parameters of the learner's policy, each tied tensor once."""
    from rlstream.rollout.model import build_policy

    return sum(t.numel() for t in build_policy(cfg.policy).state_dict().values())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m rlstream.ops.bench.learner")
    register_bench(parser.add_subparsers())
    ns = parser.parse_args(["learner", *sys.argv[1:]])
    raise SystemExit(ns.func(ns))

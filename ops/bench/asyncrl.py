"""``rlstream bench async``: asynchronous (bounded staleness) vs synchronous GRPO, same workload.

Both modes run the same components in one process: ``workers`` rollout threads generate real
groups with the tiny MoE policy, each sample then waits a long-tailed environment time (a
lognormal sleep standing for sandboxed tool runs, which use no CPU here); the learner takes a
real GRPO step every ``groups_per_step`` groups. Only the discipline differs:

- sync: release one step's groups, wait for every one of them (the slowest sample decides),
  train, publish, repeat: learner and workers wait for each other;
- async: keep ``groups_per_step * max_staleness`` groups in flight; the learner trains as soon
  as a step's worth of groups is done, rollouts continue with the weights they have.

Reported: trained samples per second, learner idle fraction, and observed staleness; the
speedup is async samples/s over sync samples/s, in the same run with the same seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import random
import threading
import time
from typing import Any

from rlstream.ops.bench.common import emit, progress


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("async", help="asynchronous vs synchronous GRPO on a long-tail workload")
    p.add_argument("--steps", type=int, default=12, help="learner steps per mode")
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=8, help="rollout threads")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--env-median-s", type=float, default=0.3, help="median env time per sample")
    p.add_argument("--env-sigma", type=float, default=1.2, help="lognormal sigma (tail weight)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from rlstream.envs import tasks
        from rlstream.rollout.harness import HarnessConfig
        from rlstream.rollout.model import PolicyConfig, build_policy

        torch.set_num_threads(1)
        self.args, self.tasks = args, tasks
        self.model = build_policy(PolicyConfig(vocab_size=tasks.VOCAB_SIZE))
        self.harness = HarnessConfig(max_new_tokens=24, max_turns=0)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.version = 0
        self.lock = threading.Lock()  # the weights: read by rollouts, written by the learner

    def rollout(self, index: int, rng: random.Random) -> dict[str, Any]:
        """One real group, then each sample's long-tail env time; returns what the learner needs."""
        import torch

        from rlstream.rollout.harness import Rollout

        task = self.tasks.sample_task(index)
        with self.lock:
            version = self.version
            samples = Rollout(self.model, self.harness).group(
                task.prompt, self.args.group_size, torch.Generator().manual_seed(index)
            )
        env = [rng.lognormvariate(0, self.args.env_sigma) * self.args.env_median_s for _ in samples]
        time.sleep(max(env))  # the group is done when its slowest sample is
        rewards = [float(rng.random() < 0.5) for _ in samples]
        return {"samples": samples, "rewards": rewards, "version": version}

    def train(self, groups: list[dict[str, Any]]) -> None:
        from rlstream.trainer import grpo

        seqs, advs = [], []
        for g in groups:
            for s, a in zip(g["samples"], grpo.group_advantages(g["rewards"]), strict=True):
                part = grpo.split_segments(s.token_ids, s.logprobs, s.loss_mask, s.routes)
                seqs += part
                advs += [float(a)] * len(part)
        with self.lock:
            grpo.grpo_step(
                self.model, self.optimizer, grpo.make_batch(seqs, advs), grpo.GrpoConfig()
            )
            self.version += 1


def _run(bench: _Bench, mode: str) -> dict[str, float]:
    args = bench.args
    b, steps = args.groups_per_step, args.steps
    in_flight_cap = b if mode == "sync" else b * max(1, args.max_staleness)
    todo: queue.Queue[int | None] = queue.Queue()
    done: queue.Queue[dict[str, Any]] = queue.Queue()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while (index := todo.get()) is not None:
            done.put(bench.rollout(index, rng))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.workers)]
    for t in threads:
        t.start()
    released, idle, staleness, trained = 0, 0.0, [], 0
    started = time.perf_counter()
    while trained < steps:
        if mode == "sync" or released - trained * b < in_flight_cap:
            while released - trained * b < in_flight_cap:
                todo.put(released)
                released += 1
        wait0 = time.perf_counter()
        batch = [done.get() for _ in range(b)]
        idle += time.perf_counter() - wait0
        staleness += [bench.version - g["version"] for g in batch]
        bench.train(batch)
        trained += 1
        progress(f"  {mode}: step {trained}/{steps}")
    wall = time.perf_counter() - started
    with contextlib.suppress(queue.Empty):
        while True:  # drop the work no step will use
            todo.get_nowait()
    for _ in threads:
        todo.put(None)
    for t in threads:  # a thread still in torch at interpreter exit aborts the process
        t.join()
    samples = steps * b * args.group_size
    return {
        "samples_per_s": samples / wall,
        "learner_idle_fraction": idle / wall,
        "wall_s": wall,
        "mean_staleness": sum(staleness) / len(staleness),
    }


def _main(args: argparse.Namespace) -> int:
    progress("bench async: same workload, synchronous then asynchronous")
    sync = _run(_Bench(args), "sync")
    asyn = _run(_Bench(args), "async")
    result = {
        "bench": "async",
        "speedup": asyn["samples_per_s"] / sync["samples_per_s"],
        "async_samples_per_s": asyn["samples_per_s"],
        "sync_samples_per_s": sync["samples_per_s"],
        "learner_idle_fraction_async": asyn["learner_idle_fraction"],
        "learner_idle_fraction_sync": sync["learner_idle_fraction"],
        "mean_staleness_async": asyn["mean_staleness"],
        "max_staleness": args.max_staleness,
        "workers": args.workers,
        "steps": args.steps,
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "env_median_s": args.env_median_s,
        "env_sigma": args.env_sigma,
    }
    lines = [
        f"sync:  {sync['samples_per_s']:.2f} trained samples/s, learner idle {sync['learner_idle_fraction']:.0%}",
        f"async: {asyn['samples_per_s']:.2f} trained samples/s, learner idle "
        f"{asyn['learner_idle_fraction']:.0%}, mean staleness {asyn['mean_staleness']:.2f}",
        f"speedup async/sync: {result['speedup']:.2f}x",
    ]
    emit(result, args.json, lines, "async")
    return 0

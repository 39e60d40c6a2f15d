"""``rlstream bench router-replay``: train/inference mismatch with and without router replay.

Rollouts are generated the way rollout workers do (a bf16 copy of the weights, routes and
behaviour logprobs recorded per token); the learner recomputes the same sequences in fp32 twice:
with free routing, and with the recorded experts forced (router replay). Reported, over the
positions that produce policy-generated tokens:

- ``expert_mismatch_*``: share of those positions where the set of experts chosen in any MoE
  layer differs from the one used at inference (with replay: 0 by construction, measured anyway);
- ``logprob_mae_*``: mean |logp_train - logp_behaviour| of the generated tokens.

With ``--json`` the last stdout line is one JSON object with those four keys and the context.
Only the standard library is imported at module import time (``rlstream --help`` stays fast).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def register_bench(bench_subparsers: Any) -> None:
    """Add ``router-replay`` to the ``rlstream bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "router-replay",
        help="expert and logprob mismatch between bf16 inference and fp32 training",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--tasks", type=int, default=24, help="prompts (groups) to roll out")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of tasks and sampling")
    p.add_argument("--warm-steps", type=int, default=150, help="warm-start steps before measuring")
    p.add_argument("--cache", default=None, help="warm-start cache file")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.ops.bench.common import emit

    result = run(args)
    lines = [] if args.json else [f"{key:40s} {value}" for key, value in result.items()]
    emit(result, args.json, lines, "router-replay")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the mismatch; returns the metrics (see the module docstring)."""
    import torch

    from rlstream.envs import tasks
    from rlstream.rollout.harness import HarnessConfig, Rollout
    from rlstream.rollout.model import PolicyConfig
    from rlstream.trainer import grpo
    from rlstream.trainer.warmstart import WarmStartConfig, warm_start

    torch.set_num_threads(1)
    started = time.perf_counter()
    policy_cfg = PolicyConfig(vocab_size=tasks.VOCAB_SIZE)
    ws = WarmStartConfig(steps=getattr(args, "warm_steps", 150), seed=args.seed)
    model = warm_start(policy_cfg, ws, getattr(args, "cache", None), _progress)
    rollout = Rollout(model, HarnessConfig(max_new_tokens=48, inference_dtype="bfloat16"))
    gen = torch.Generator().manual_seed(args.seed)
    seqs: list[grpo.TrainSequence] = []
    for i in range(args.tasks):
        task = tasks.sample_task(args.seed * 100_003 + i)
        for s in rollout.group(task.prompt, args.group_size, gen):
            seqs += grpo.split_segments(s.token_ids, s.logprobs, s.loss_mask, s.routes)
    batch = grpo.make_batch(seqs, [0.0] * len(seqs))
    free = _mismatch(model, batch, replay=False)
    replay = _mismatch(model, batch, replay=True, flipped=free["flipped"])
    return {
        "expert_mismatch_with_replay": replay["expert_mismatch"],
        "expert_mismatch_without_replay": free["expert_mismatch"],
        "logprob_mae_with_replay": replay["logprob_mae"],
        "logprob_mae_without_replay": free["logprob_mae"],
        "logprob_max_abs_with_replay": replay["logprob_max_abs"],
        "logprob_max_abs_without_replay": free["logprob_max_abs"],
        "logprob_mae_on_flipped_with_replay": replay["flipped_mae"],
        "logprob_mae_on_flipped_without_replay": free["flipped_mae"],
        "tokens": int(batch.loss_mask.sum()),
        "sequences": len(seqs),
        "inference_dtype": "bfloat16",
        "training_dtype": "float32",
        "n_layers": policy_cfg.n_layers,
        "n_experts": policy_cfg.n_experts,
        "top_k": policy_cfg.top_k,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _mismatch(model: Any, batch: Any, replay: bool, flipped: Any = None) -> dict[str, Any]:
    """Expert-set mismatch and |logprob| error of an fp32 recompute against the rollout.

    ``flipped`` (a mask of positions whose experts differ under free routing) selects where
    ``flipped_mae`` is measured; by default it is this run's own mismatch mask.
    """
    import torch

    from rlstream.rollout.model import sequence_logprobs

    with torch.no_grad():
        forced = batch.routes if replay else None
        logp, routes = sequence_logprobs(model, batch.tokens, forced)
    mask = batch.loss_mask[:, 1:] > 0  # position t-1 produced generated token t
    same = routes.sort(dim=-1).values == batch.routes[:, :-1].sort(dim=-1).values
    differs = ~same.flatten(2).all(dim=-1)
    abs_err = (logp[:, 1:] - batch.behaviour_logprobs[:, 1:]).abs()
    err = abs_err[mask]
    flipped = (differs & mask) if flipped is None else flipped
    return {
        "expert_mismatch": float(differs[mask].float().mean()),
        "logprob_mae": float(err.mean()),
        "logprob_max_abs": float(err.max()),
        "flipped_mae": float(abs_err[flipped].mean()) if bool(flipped.any()) else 0.0,
        "flipped": flipped,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m rlstream.ops.bench.router_replay")
    register_bench(parser.add_subparsers())
    ns = parser.parse_args(["router-replay", *sys.argv[1:]])
    raise SystemExit(ns.func(ns))

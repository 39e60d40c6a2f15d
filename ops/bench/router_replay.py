"""``rlstream bench router-replay``: train/inference mismatch with and without router replay.

Rollouts are generated the way rollout workers do (a bf16 copy of the weights, routes and
behaviour logprobs recorded per token); the learner recomputes the same sequences in fp32 twice:
with free routing, and with the recorded experts forced (router replay). Per arm
(``with_replay``, ``without_replay``), over the positions that produce policy-generated tokens:

- ``route_flip_fraction``: share of those positions where, in any MoE layer, the learner's own
  router (top-k of its fp32 router probabilities at that position, in that forward) would pick a
  different expert set than the sampler recorded. Under replay the experts used are the recorded
  ones, but the router's own choice is still measured on the replayed forward's hidden states, so
  this is not 0 by construction: it says how often replay overrides the learner's router;
- ``logprob_kl``: mean per-token KL(sampler || learner), estimated on the sampled tokens with
  the non-negative unbiased estimator ``r - 1 - log r``, ``r = p_learner / p_sampler``;
- ``logprob_mae``: mean |logp_learner - logp_sampler| of the generated tokens;
- ``clipped_fraction``: share of tokens whose importance ratio ``r`` exceeds the truncation cap
  of the GRPO loss (``objectives.TruncatedIS.cap``), i.e. tokens the truncation clips;
- ``expert_mismatch``: share of positions whose experts *used* differ from the recorded ones
  (0 under replay by construction; kept as a check of the replay path, not as a result).

With ``--json`` the last stdout line is one JSON object with both arms and the context.
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
    lines = [] if args.json else _lines(result)
    emit(result, args.json, lines, "router-replay")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the mismatch; returns the metrics (see the module docstring)."""
    import torch

    from rlstream.envs import fx_tasks as tasks
    from rlstream.envs import protocol
    from rlstream.rollout.config import HarnessConfig, PolicyConfig
    from rlstream.rollout.harness import Rollout
    from rlstream.trainer import grpo, objectives
    from rlstream.trainer.config import WarmStartConfig
    from rlstream.trainer.warmstart import warm_start

    torch.set_num_threads(1)
    started = time.perf_counter()
    policy_cfg = PolicyConfig(vocab_size=protocol.VOCAB_SIZE)
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
    cap = objectives.TruncatedIS().cap
    return {
        "with_replay": _mismatch(model, batch, replay=True, cap=cap),
        "without_replay": _mismatch(model, batch, replay=False, cap=cap),
        "is_cap": cap,
        "tokens": int(batch.loss_mask.sum()),
        "sequences": len(seqs),
        "inference_dtype": "bfloat16",
        "training_dtype": "float32",
        "architecture": policy_cfg.architecture,
        "n_layers": policy_cfg.n_layers,
        "n_experts": policy_cfg.n_experts,
        "top_k": policy_cfg.top_k,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _lines(r: dict[str, Any]) -> list[str]:
    out = [f"{r['tokens']} generated tokens, bf16 sampler vs fp32 learner, IS cap {r['is_cap']}"]
    for arm in ("with_replay", "without_replay"):
        out.append(f"{arm:15s} " + ", ".join(f"{k} {v:.3g}" for k, v in r[arm].items()))
    return out


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _mismatch(model: Any, batch: Any, replay: bool, cap: float) -> dict[str, float]:
    """One arm's figures (see the module docstring) of an fp32 recompute against the rollout."""
    import torch

    from rlstream.rollout.model import sequence_logprobs

    with torch.no_grad():
        forced = batch.routes if replay else None
        logp, used = sequence_logprobs(model, batch.tokens, forced)
        k = used.shape[-1]
        own = torch.stack([p.topk(k, dim=-1).indices for p in model.last_router_probs], dim=2)
    mask = batch.loss_mask[:, 1:] > 0  # position t-1 produced generated token t
    recorded = batch.routes[:, :-1].sort(dim=-1).values

    def differs(routes: Any) -> Any:
        return ~(routes.sort(dim=-1).values == recorded).flatten(2).all(dim=-1)

    diff = (logp[:, 1:] - batch.behaviour_logprobs[:, 1:])[mask]  # log r per generated token
    ratio = diff.exp()
    return {
        "route_flip_fraction": float(differs(own)[mask].float().mean()),
        "logprob_kl": float((ratio - 1 - diff).mean()),
        "logprob_mae": float(diff.abs().mean()),
        "logprob_max_abs": float(diff.abs().max()),
        "clipped_fraction": float((ratio > cap).float().mean()),
        "expert_mismatch": float(differs(used)[mask].float().mean()),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m rlstream.ops.bench.router_replay")
    register_bench(parser.add_subparsers())
    ns = parser.parse_args(["router-replay", *sys.argv[1:]])
    raise SystemExit(ns.func(ns))

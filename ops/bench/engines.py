"""``rlstream bench engines``: the in-process ``torch`` engine against vLLM (its CPU build here),
on the same model and prompts; weight swaps in place against a reload from disk; partial
rollouts against swapping between tasks.

The model is the vLLM demo's policy shape (the demo's Qwen3-MoE with heads 64 wide: vLLM's CPU
attention runs no 16), freshly initialised from its seed, fp32 in both engines. Figures:

- ``throughput``: generated tokens per second at 1, 16 and 64 concurrent requests (``--levels``),
  each request one row of ``--new-tokens`` tokens after its own prompt (``--prompt-tokens``
  tokens of a task prompt), no stop token, so both engines generate exactly the same number of
  tokens; median over ``--reps``. vLLM: that many requests in flight at once (threads, one HTTP
  request each; continuous batching in the server). torch: the engine runs one request at a
  time, and its best case for C requests is one batch of C rows with a KV cache
  (``rollout.model.generate``), which is what is timed. ``ratio`` = vLLM / torch.
- ``swap``: ``--swaps`` versions (every tensor moved, as an RL step moves them) into the running
  vLLM server in place (the changed tensors through /dev/shm and the model's weight loader,
  pause -> resumed: ``rollout.vllm_engine``), against the same versions written whole as a
  checkpoint and reloaded by the server from disk (write + pause -> resumed); medians. The
  torch engine's swap (``load_state_dict`` in process) for reference.
- ``partial`` (with ``--partial-versions`` > 0): two ``rlstream demo --engine vllm`` runs on one
  local cluster (one region, ``--workers`` rollout workers), ``rollout.swap`` = ``partial`` and
  ``between_tasks``, to the same version: the fraction of trajectories spanning more than one
  version, the mean token staleness (learner version at admission minus the version that made
  each generated token, over admitted samples), trained samples per second from the learner's
  commit of version 1 to its last (start-up and warm start excluded, as ``bench async``), and
  ``gain`` = partial / between_tasks.

``load_average`` is the machine's 1-minute load before and after. Progress goes to stderr;
with ``--json`` the last stdout line is the result, kept in ``results/bench-engines.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlstream.ops.bench.common import emit, local_cluster, median, progress


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engines", help="torch vs vLLM: tokens/s, swaps in place, partial rollouts")
    p.add_argument("--levels", default="1,16,64", help="concurrent requests, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per level")
    p.add_argument("--swaps", type=int, default=10, help="versions swapped in, per way")
    p.add_argument(
        "--partial-versions",
        type=int,
        default=15,
        help="versions of each partial-rollout run (0: no runs)",
    )
    p.add_argument("--workers", type=int, default=1, help="rollout workers of those runs")
    p.add_argument("--minutes", type=float, default=15.0, help="time cap of one of those runs")
    p.add_argument("--home", default=None, help="a running local cluster's state directory")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for both partial-rollout runs (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.rollout.vllm_process import vllm_python

    if vllm_python() is None:
        raise SystemExit("error: vLLM is not installed: run `make vllm`")
    result = run(args)
    emit(result, args.json, _lines(result), name="engines")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlstream.envs import fx_tasks as tasks
    from rlstream.ops.demo.demo import VLLM_DEMO_SETS
    from rlstream.ops.run.config import load_run_config
    from rlstream.rollout.model import build_policy

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    policy = load_run_config(None, list(VLLM_DEMO_SETS)).policy
    model = build_policy(policy).eval()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    prompts = [
        model.text.prompt(tasks.sample_task(i).prompt)[: args.prompt_tokens]
        for i in range(max(levels))
    ]
    if min(len(p) for p in prompts) < args.prompt_tokens:
        raise SystemExit(f"error: task prompts are shorter than {args.prompt_tokens} tokens")
    with tempfile.TemporaryDirectory(prefix="rlstream-engines-") as tmp:
        engine = _vllm(model, policy, Path(tmp))
        try:
            throughput = _throughput(args, model, engine, prompts, levels)
            swap = _swaps(args, model, engine)
            memory = engine.memory_bytes()
        finally:
            engine.close()
    result: dict[str, Any] = {
        "model": policy.model_dump(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "engine_version": engine.stats.engine_version,
        "torch_version": torch.__version__,
        "throughput": throughput,
        "swap": swap,
        "vllm_memory_bytes": memory,
    }
    if args.partial_versions > 0:
        result["partial"] = _partial(args)
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def _vllm(model: Any, policy: Any, tmp: Path) -> Any:
    from rlstream.rollout.config import VllmConfig
    from rlstream.rollout.vllm_engine import VllmEngine

    progress("starting the vLLM server ...")
    cfg = VllmConfig(work_dir=str(tmp), max_num_seqs=128, kv_cache_gib=2.0)
    engine = VllmEngine(cfg, model, policy, "policy", tmp / "vllm.log")
    engine.push(0, dict(model.state_dict()))
    return engine


def _throughput(
    args: argparse.Namespace, model: Any, engine: Any, prompts: list[list[int]], levels: list[int]
) -> list[dict[str, Any]]:
    out = []
    for level in levels:
        torch_s = [
            _torch_batch(model, prompts[:level], args.new_tokens, r) for r in range(args.reps)
        ]
        vllm_s = [
            _vllm_batch(engine, prompts[:level], args.new_tokens, r) for r in range(args.reps)
        ]
        tokens = level * args.new_tokens
        row = {
            "concurrency": level,
            "tokens": tokens,
            "torch_tokens_per_s": tokens / median(torch_s),
            "vllm_tokens_per_s": tokens / median(vllm_s),
        }
        row["ratio"] = row["vllm_tokens_per_s"] / row["torch_tokens_per_s"]
        progress(
            f"  {level:>3} concurrent: torch {row['torch_tokens_per_s']:.0f} tokens/s, vLLM "
            f"{row['vllm_tokens_per_s']:.0f} tokens/s ({row['ratio']:.2f}x)"
        )
        out.append(row)
    return out


def _torch_batch(model: Any, prompts: list[list[int]], new: int, seed: int) -> float:
    import torch

    from rlstream.rollout.model import generate

    started = time.perf_counter()
    gen = generate(model, torch.tensor(prompts), new, 1.0, torch.Generator().manual_seed(seed))
    took = time.perf_counter() - started
    assert int(gen.lengths.sum()) == len(prompts) * new
    return took


def _vllm_batch(engine: Any, prompts: list[list[int]], new: int, seed: int) -> float:
    """Seconds for ``len(prompts)`` requests in flight at once, one row each."""
    import torch

    lengths: list[int] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            gen = engine.generate(
                torch.tensor([prompts[i]]),
                max_new=new,
                temperature=1.0,
                generator=torch.Generator().manual_seed(seed * 1000 + i),
                stop_ids=(),
                prior=None,
            )
            lengths.append(int(gen.lengths.sum()))
        except BaseException as exc:  # surfaced after the join
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - started
    if errors:
        raise errors[0]
    assert sum(lengths) == len(prompts) * new
    return took


def _swaps(args: argparse.Namespace, model: Any, engine: Any) -> dict[str, Any]:
    import torch

    progress(f"swapping {args.swaps} versions in place, then {args.swaps} from disk ...")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    versions = []
    for _ in range(2 * args.swaps):  # RL-like: every tensor moves a little
        state = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        versions.append(state)
    before = len(engine.stats.swap_s)
    for v, state in enumerate(versions[: args.swaps], 1):
        engine.push(v, state)
    in_place = engine.stats.swap_s[before:]
    from_disk = [
        engine.reload_from_disk(v, state)["seconds"]
        for v, state in enumerate(versions[args.swaps :], args.swaps + 1)
    ]
    torch_s = []
    for state in versions[: args.swaps]:
        started = time.perf_counter()
        with torch.no_grad():
            model.load_state_dict(state)
        torch_s.append(time.perf_counter() - started)
    return {
        "versions": args.swaps,
        "in_place_p50_s": median(in_place),
        "from_disk_p50_s": median(from_disk),
        "speedup": median(from_disk) / median(in_place),
        "torch_load_state_dict_p50_s": median(torch_s),
        "in_place_s": [round(s, 5) for s in in_place],
        "from_disk_s": [round(s, 5) for s in from_disk],
    }


def _partial(args: argparse.Namespace) -> dict[str, Any]:
    arms: dict[str, dict[str, Any]] = {}
    with (
        local_cluster(args, reuse_default=False) as local,
        tempfile.TemporaryDirectory(prefix="rlstream-engines-") as out,
    ):
        for swap in ("between_tasks", "partial"):
            arms[swap] = _arm(args, local.home, Path(out), swap)
    gain = arms["partial"]["samples_per_s"] / arms["between_tasks"]["samples_per_s"]
    return {"engine": "vllm", **arms, "gain": gain, "workers": args.workers}


def _arm(args: argparse.Namespace, home: Path, out: Path, swap: str) -> dict[str, Any]:
    """One ``rlstream demo --engine vllm`` run with ``rollout.swap = swap``; its figures."""
    from rlstream.ops import cluster
    from rlstream.ops.bench.asyncrl import commits_ms
    from rlstream.ops.run.config import load_run_config

    run = f"bench-engines-{swap.replace('_', '-')}-{int(time.time())}"
    cmd = [sys.executable, "-m", "rlstream", "demo", "--json", "--engine", "vllm"]
    cmd += ["--regions", "trainer", "--run", run, "--home", str(home), "--out", str(out)]
    cmd += ["--max-versions", str(args.partial_versions), "--minutes", str(args.minutes)]
    cmd += ["--rollout-workers", str(args.workers)]
    quiet_eval = ("eval.every=1000000", "eval.eval_tasks=4", "eval.k=1")  # not what is measured
    for item in (*args.set, f"rollout.swap={swap}", *quiet_eval):
        cmd += ["--set", item]
    progress(f"run {run} (rollout.swap={swap}) ...")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.minutes * 60 + 900)
    if proc.returncode != 0:
        raise SystemExit(f"error: {run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    demo = json.loads(proc.stdout.strip().splitlines()[-1])
    settings = cluster.load(home).settings("trainer")
    commits = commits_ms(settings, run)
    last = max(commits)
    config = load_run_config(None, args.set)  # the run's recipe: the groups of a step
    samples = (last - 1) * config.groups_per_step * config.group_size
    figures = {
        "run": run,
        "versions": last,
        "samples_per_s": samples / ((commits[last] - commits[1]) / 1000),
        **_spans(settings, run),
        "engine_swaps": demo["engine_swaps"],
        "engine_restarts": demo["engine_restarts"],
        "swap_p50_s": demo["swap_p50_s"],
        "pause_s_p50": demo.get("pause_s_p50"),
        "pause_s_p99": demo.get("pause_s_p99"),
        "sync_s_p50": demo.get("sync_s_p50"),
        "warm_start_success": demo["warm_start_success"],
        "final_success": demo["final_success"],
    }
    progress(
        f"  {last} versions, {figures['samples_per_s']:.2f} trained samples/s, "
        f"{figures['spanning_fraction']:.1%} of trajectories span > 1 version"
    )
    return figures


def _spans(settings: Any, run: str) -> dict[str, Any]:
    """Of the run's trajectories: the fraction spanning more than one version; of its admitted
    samples' generated tokens: the mean staleness (learner version at admission minus the
    version that made the token)."""
    import numpy as np

    from rlstream.consumers.read_to_end import read_topic
    from rlstream.schemas import arrays, events, topics

    spans: dict[tuple[str, int], list[dict[str, int]]] = {}
    for msg in read_topic(settings, topics.topic_name(run, "trajectories"), name="bench"):
        rec = events.decode(msg.value() or b"").record
        spans.setdefault((rec["group_id"], rec["sample_index"]), rec["version_spans"])
    ages: list[float] = []
    for msg in read_topic(settings, topics.topic_name(run, "admitted"), name="bench"):
        rec = events.decode(msg.value() or b"").record
        for sample in rec["samples"]:
            mask = arrays.unpack_tokens(sample).loss_mask
            offset = int(sample.get("token_offset", 0))
            versions = np.zeros(len(mask), dtype=np.int64)
            for s in spans.get((rec["group_id"], sample["sample_index"]), []):
                a, b = s["token_start"] - offset, s["token_end"] - offset
                versions[max(0, a) : max(0, b)] = s["version"]
            ages += (rec["learner_version"] - versions[mask > 0]).tolist()
    return {
        "trajectories": len(spans),
        "spanning_fraction": sum(len(s) > 1 for s in spans.values()) / max(1, len(spans)),
        "token_staleness_mean": float(np.mean(ages)) if ages else None,
    }


def _lines(r: dict[str, Any]) -> list[str]:
    lines = [
        f"Qwen3-MoE policy, {r['parameters']} parameters, fp32; vLLM {r['engine_version']} "
        f"(CPU build), torch {r['torch_version']}; load average {r['load_average'][0]} before, "
        f"{r['load_average'][1]} after, {os.cpu_count()} cores",
        "concurrent  torch tokens/s  vLLM tokens/s  vLLM/torch",
    ]
    for t in r["throughput"]:
        lines.append(
            f"{t['concurrency']:>10}  {t['torch_tokens_per_s']:>14.0f}  "
            f"{t['vllm_tokens_per_s']:>13.0f}  {t['ratio']:>10.2f}"
        )
    s = r["swap"]
    lines.append(
        f"swap in place p50 {s['in_place_p50_s']:.4f}s (pause -> resumed) vs reload from disk "
        f"{s['from_disk_p50_s']:.4f}s: {s['speedup']:.1f}x; torch load_state_dict "
        f"{s['torch_load_state_dict_p50_s']:.4f}s; vLLM memory "
        f"{r['vllm_memory_bytes'] / 2**30:.2f} GiB (PSS)"
    )
    if "partial" in r:
        p = r["partial"]
        for arm in ("between_tasks", "partial"):
            a = p[arm]
            lines.append(
                f"{arm:>13}: {a['samples_per_s']:.2f} trained samples/s, "
                f"{a['spanning_fraction']:.1%} of {a['trajectories']} trajectories span > 1 "
                f"version, token staleness {a['token_staleness_mean']}"
            )
        lines.append(f"partial / between_tasks trained samples/s: {p['gain']:.2f}x")
    return lines

"""``rlstream bench plan``: the rates of the sizing model (``ops.plan.model``), fitted on two small
models and checked against a larger one, in one run on this machine.

Per size (each of ``--calibrate-gb``, then ``--check-gb``) and trial (``--trials``), on a fresh run's
topics: one publisher (the learner's, one rank, signed) publishes a keyframe of a synthetic bf16
model (normal(0, 0.02) values, as ``bench publish``), a fresh subscriber follows it, then the
publisher publishes a delta in which ``--changed`` of the elements moved by one bf16 step up or
down (what an RL step at a small learning rate does to bf16 weights) and the subscriber, holding
the keyframe, follows that. Measured per version: ``publish_s`` (the call, encode + chunks
acknowledged + manifest committed), its encode time, ``follow_s`` (from the publish's return
to the subscriber holding the version, verified), its fetch and decode times, raw and wire
bytes.

The rates come from the calibration sizes alone (medians over trials, after one warm-up trial
that is not counted; ``fit_rates``): per kind, encode and decode as ``fixed + core-seconds per
raw GB`` lines through the sizes, write and fetch as ``fixed + seconds per wire GB`` lines
through every version. ``one_host`` then predicts the check size's ``publish_s`` and
``follow_s`` from its raw and wire bytes, and each prediction is compared with the median
measured there: the target, fixed before any run, is **within 25%**.
The result also carries ``rlstream plan``'s answer for the default deployment with these rates.

What it cannot check: everything past one host (partitions and brokers on their own machines,
WAN links, GPUs): those figures are the deployment's (``ops.plan.model.ASSUMED``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

MODEL = "policy"
#: The target, fixed before the runs: every prediction within this of the measured median.
TARGET_ERROR = 0.25


def register_bench(bench_subparsers: Any) -> None:
    """Add ``plan`` to the ``rlstream bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "plan",
        help="the sizing model's rates, fitted small and checked 4x larger",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument(
        "--calibrate-gb",
        default="0.5,1",
        help="model sizes the rates come from (GB, two or more)",
    )
    p.add_argument("--check-gb", type=float, default=2.0, help="model size predicted and measured")
    p.add_argument("--changed", type=float, default=0.02, help="share of elements a delta moves")
    p.add_argument("--trials", type=int, default=5, help="runs per size (medians)")
    p.add_argument("--tensor-mb", type=float, default=32.0, help="size of each tensor in MB")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap (default: local cluster)")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.ops.bench.common import bench_kafka, emit

    with bench_kafka(args) as settings:
        result = run(args, settings)
    emit(result, args.json, [] if args.json else lines(result), "plan")
    return 0  # ``held`` says whether the predictions held: at a tiny size they mean nothing


def lines(result: dict[str, Any]) -> list[str]:
    out = [f"rates (from {result['calibrate_gb']} GB): {result['rates']}"]
    for c in result["checks"]:
        out.append(
            f"{c['kind']} of {c['raw_gb']} GB ({c['wire_gb']} GB on the wire): "
            f"{c['what']} predicted {c['predicted_s']} s, measured {c['measured_s']} s "
            f"(error {c['error']:.0%})"
        )
    out.append(f"every prediction within {TARGET_ERROR:.0%}: {result['held']}")
    scale = result["scale"]
    out.append(
        f"default deployment: lands in {scale['land_s']} s ({scale['stages_s']}); "
        f"dominant {scale['dominant']}"
    )
    return out


def _perturb(state: dict[str, Any], share: float, seed: int) -> dict[str, Any]:
    """A copy of ``state`` with ``share`` of every tensor's elements one bf16 step up or down."""
    import numpy as np

    from rlstream.schemas.deltacodec import TensorBits

    rng = np.random.default_rng(seed)
    out = {}
    for name, t in state.items():
        bits = t.bits.astype(np.int32)
        moved = rng.random(bits.size) < share
        bits[moved] += rng.choice(np.array([-1, 1], np.int32), int(moved.sum()))
        out[name] = TensorBits(t.dtype, t.shape, np.clip(bits, 0, 0xFFFF).astype(np.uint16))
    return out


def _trial(settings: Any, gb: float, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """One keyframe and one delta, published and followed; their figures."""
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.ops.bench.common import run_signer
    from rlstream.ops.bench.publish import _state, _tensors
    from rlstream.producers.client.admin import admin_client, ensure_run_topics
    from rlstream.producers.weights.publisher import rank_publisher
    from rlstream.schemas import topics

    run = f"bench-plan-{time.strftime('%Y%m%d-%H%M%S')}-{seed}"
    ensure_run_topics(settings, run)
    pub = rank_publisher(
        settings,
        run,
        MODEL,
        f"{topics.group_id(run, 'learner')}.0",
        signer=run_signer(settings, run),
    )
    states = [_state(_tensors(gb, args.tensor_mb), 0, 1)]
    states.append(_perturb(states[0], args.changed, seed))
    out = []
    try:
        with WeightSubscriber(settings, run, MODEL, fetch_timeout=600) as sub:
            sub.poll(1.0)  # connected and reading before the first version: no start-up in it
            for version, state in enumerate(states):
                t0 = time.perf_counter()
                pub.publish_version(state, version)
                published = time.perf_counter()
                if sub.wait_for(version, timeout=1200) is None or sub.version != version:
                    raise RuntimeError(f"version {version} not followed: {sub.failures}")
                followed = time.perf_counter()
                stats, report = pub.last_stats, sub.reports[-1]
                assert stats is not None
                out.append(
                    {
                        "kind": stats.kinds[0],
                        "raw_gb": stats.raw_bytes / 1e9,
                        "wire_gb": sum(stats.encoded_bytes.values()) / 1e9,
                        "publish_s": published - t0,
                        "encode_s": stats.encode_s,
                        "follow_s": followed - published,
                        "fetch_s": report.fetch_s,
                        "decode_s": report.decode_s,
                    }
                )
    finally:
        pub.close()
        admin_client(settings).delete_topics(list(topics.run_topics(run).values()))
    return out


def _medians(trials: list[list[dict[str, Any]]]) -> list[dict[str, float | str]]:
    """Per version of a trial (keyframe, delta), the median of every figure over trials."""
    from rlstream.ops.bench.common import median

    out: list[dict[str, float | str]] = []
    for i in range(len(trials[0])):
        rows = [t[i] for t in trials]
        row: dict[str, float | str] = {"kind": rows[0]["kind"]}
        row.update({k: median([r[k] for r in rows]) for k in rows[0] if k != "kind"})
        out.append(row)
    return out


def fit_rates(rows: list[dict[str, Any]], cores: int) -> Any:
    """``Rates`` from the median figures of keyframes and deltas at the calibration sizes: per
    kind, encode and decode as ``fixed + core-seconds per raw GB`` lines through the sizes;
    write and fetch as ``fixed + seconds per wire GB`` lines through every version."""
    from rlstream.ops.plan.model import Rates, fit_line

    def line(kind: str, what: str) -> tuple[float, float]:
        mine = [r for r in rows if r["kind"] == kind]
        fixed, per_gb = fit_line([float(r["raw_gb"]) for r in mine], [float(r[what]) for r in mine])
        return max(fixed, 0.0), per_gb * cores

    def wire_line(seconds: list[float]) -> tuple[float, float]:
        fixed, per_gb = fit_line([float(r["wire_gb"]) for r in rows], seconds)
        return max(fixed, 0.0), per_gb

    keyframes = [r for r in rows if r["kind"] == "keyframe"]
    return Rates(
        encode_keyframe=line("keyframe", "encode_s"),
        encode_delta=line("delta", "encode_s"),
        decode_keyframe=line("keyframe", "decode_s"),
        decode_delta=line("delta", "decode_s"),
        write=wire_line([float(r["publish_s"]) - float(r["encode_s"]) for r in rows]),
        # following also finds the manifest (the subscriber polls): the wall time not spent
        # decoding is the fetch's, its fixed part included
        fetch=wire_line([float(r["follow_s"]) - float(r["decode_s"]) for r in rows]),
        keyframe_wire_ratio=sum(float(r["wire_gb"]) / float(r["raw_gb"]) for r in keyframes)
        / len(keyframes),
        cores=cores,
    )


def run(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """Calibrate, check, and size the default deployment (module docstring)."""
    from rlstream.ops.bench.common import progress
    from rlstream.ops.plan.model import Deployment, one_host, plan, relative_error
    from rlstream.schemas.deltacodec.memory import DEFAULT_WORKERS

    sizes = [float(x) for x in str(args.calibrate_gb).split(",") if x.strip()]
    measured: dict[str, list[Any]] = {"calibrate": [], "calibrate_trials": []}
    progress(f"warm-up: {sizes[0]} GB, not counted (first connections, page faults)")
    _trial(settings, sizes[0], args, seed=args.trials)
    for label, gb in [*(("calibrate", g) for g in sizes), ("check", args.check_gb)]:
        trials = []
        for t in range(args.trials):
            progress(f"{label}: {gb} GB, trial {t + 1} of {args.trials}")
            trials.append(_trial(settings, gb, args, seed=t))
        if label == "calibrate":
            measured["calibrate"] += _medians(trials)
            measured["calibrate_trials"] += trials
        else:
            measured["check"], measured["check_trials"] = _medians(trials), trials
    rates = fit_rates(measured["calibrate"], DEFAULT_WORKERS)
    checks = []
    for row in measured["check"]:
        predicted = one_host(str(row["kind"]), float(row["raw_gb"]), float(row["wire_gb"]), rates)
        for what in ("publish_s", "follow_s"):
            got = float(row[what])
            checks.append(
                {
                    "kind": row["kind"],
                    "what": what,
                    "raw_gb": round(float(row["raw_gb"]), 3),
                    "wire_gb": round(float(row["wire_gb"]), 4),
                    "predicted_s": round(predicted[what], 3),
                    "measured_s": round(got, 3),
                    "error": round(relative_error(predicted[what], got), 3),
                }
            )
    return {
        "calibrate_gb": sizes,
        "check_gb": args.check_gb,
        "changed": args.changed,
        "trials": args.trials,
        "model": "synthetic bf16, normal(0, 0.02); delta: one bf16 step on a share of elements",
        "rates": asdict(rates),
        "measured": measured,
        "checks": checks,
        "target_error": TARGET_ERROR,
        "max_error": max(c["error"] for c in checks),
        "held": all(c["error"] <= TARGET_ERROR for c in checks),
        "scale": plan(Deployment(), rates),
    }

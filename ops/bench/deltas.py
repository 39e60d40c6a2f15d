"""``rlstream bench deltas``: the weight-delta codec on four workloads, against the bounds the
data allows and against baselines.

Workloads (``--workloads``), one case per learning rate: ``synthetic`` (a simulated Adam step),
``adam-real`` (one real Adam step of a byte-level LM trained here), ``finetune`` (fine-tuning a
pretrained byte LM on prose), ``learner`` (the project's own learner and its GRPO steps) and
``pretrained`` (a real pretrained model, SmolLM2-135M, mid-fine-tune with warm AdamW); each case
says whether its optimizer was in its steady state (``steady_state``).

Per case, medians over ``--reps`` repetitions, single-threaded unless said: the ratio against the
order-0 and conditioned bounds, encode, apply and decode rates, generic baselines (zstd, byte
planes, sparse) in the same run, the hash ceilings (BLAKE3, xxh3), multi-core scaling, the
``fast_apply`` variant, and ``bit_exact`` (checked outside the timed region).

Details: docs/benchmarks.md (bench deltas).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from rlstream.ops.bench.common import emit, median, progress
from rlstream.ops.bench.delta_workloads import (
    STEADY_STATE,
    WORKLOADS,
    Arrays,
    Pair,
    adam_real,
    finetune,
    learner_versions,
    pretrained,
    synthetic,
)


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deltas", help="weight-delta codec on four workloads vs bounds and zstd")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--params", type=int, default=100_000_000, help="synthetic: bf16 weights")
    p.add_argument("--tensors", type=int, default=4, help="synthetic: tensors of the weights")
    p.add_argument(
        "--lrs", default="1e-6,1e-5", help="synthetic, adam-real, finetune: learning rates"
    )
    p.add_argument("--real-width", type=int, default=512, help="adam-real: model width")
    p.add_argument("--real-layers", type=int, default=4, help="adam-real: transformer blocks")
    p.add_argument("--real-seconds", type=float, default=60.0, help="adam-real: pretraining")
    p.add_argument("--finetune-width", type=int, default=384, help="finetune: model width")
    p.add_argument("--finetune-layers", type=int, default=4, help="finetune: transformer blocks")
    p.add_argument(
        "--pretrain-minutes", type=float, default=10.0, help="finetune: pretraining (cached)"
    )
    p.add_argument("--finetune-steps", type=int, default=4, help="finetune: versions per lr")
    p.add_argument("--learner-warm-steps", type=int, default=300, help="learner: warm start")
    p.add_argument("--learner-steps", type=int, default=6, help="learner: GRPO steps")
    p.add_argument(
        "--pretrained-model", default=None, help="pretrained: an HF folder (default: SmolLM2)"
    )
    p.add_argument(
        "--pretrained-warm-steps", type=int, default=20, help="pretrained: AdamW warm-up steps"
    )
    p.add_argument("--pretrained-steps", type=int, default=2, help="pretrained: versions per lr")
    p.add_argument("--reps", type=int, default=5, help="repetitions per timing (median)")
    p.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1, help="threads of the scaling arm"
    )
    p.add_argument("--max-chunk-bytes", type=int, default=900_000, help="codec chunk limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    emit(result, args.json, _lines(result), "deltas")
    return 0 if all(c["bit_exact"] for c in result["cases"]) else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every workload's cases; returns ``{"cases": [...], ...}``."""
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    lrs = [float(x) for x in args.lrs.split(",")]
    makers: dict[str, Callable[[], Iterator[tuple[float, list[Pair], str]]]] = {
        "synthetic": lambda: synthetic(args, lrs),
        "adam-real": lambda: adam_real(args, lrs),
        "finetune": lambda: finetune(args, lrs),
        "learner": lambda: learner_versions(args),
        "pretrained": lambda: pretrained(args, lrs),
    }
    _warm_up()
    cases = []
    for workload in chosen:
        for lr, pairs, what in makers[workload]():
            case = {"workload": workload, "steady_state": STEADY_STATE[workload], "lr": lr}
            cases.append({**case, "model": what, **_case(pairs, args)})
    return {
        "bench": "deltas",
        "workloads": chosen,
        "dtype": "bfloat16",
        "reps": args.reps,
        "max_chunk_bytes": args.max_chunk_bytes,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cases": cases,
    }


def _warm_up() -> None:
    """Compile (or load) the codec's numba kernels before anything is timed: a one-time
    cost of a process, not of a version."""
    from rlstream.schemas import deltacodec as dc

    dc.compile_kernels()


# --- measuring --------------------------------------------------------------------------


class Timing(NamedTuple):
    """Median seconds of the repetitions: wall clock, and this process's CPU time (on a
    shared machine the CPU time is the steadier per-core figure)."""

    wall: float
    cpu: float


def _timed(
    fn: Callable[..., Any],
    reps: int,
    check: Callable[[Any], bool] | None = None,
    setup: Callable[[], Any] | None = None,
) -> tuple[Timing, Any, bool]:
    """Time ``reps`` calls of ``fn`` (given ``setup()``'s result when there is a setup);
    ``setup`` and ``check`` run outside the timed region."""
    walls, cpus, ok, out = [], [], True, None
    for _ in range(max(1, reps)):
        prepared = setup() if setup is not None else None
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn() if setup is None else fn(prepared)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        ok = ok and (check is None or check(out))
    return Timing(median(walls), median(cpus)), out, ok


def _state(arrays: Arrays) -> dict[str, Any]:
    """New wrappers each call: no hash cached, as for a state never hashed before."""
    from rlstream.schemas.deltacodec import TensorBits

    return {k: TensorBits.from_numpy(a, tag) for k, (tag, a) in arrays.items()}


def _case(pairs: list[Pair], args: argparse.Namespace) -> dict[str, Any]:
    from rlstream.schemas import deltacodec as dc

    raw = sum(a.nbytes for _, new in pairs for _, a in new.values())
    progress(f"deltas: {raw / 1e6:.1f} MB x {len(pairs)}: encode x{args.reps}")
    encs, t_enc, t_enc_warm = _time_encode(pairs, args)
    progress(f"deltas: decode and apply in place x{args.reps}")
    t_dec, t_apply, exact = _time_decode(encs, pairs, args.reps)
    progress(f"deltas: encode and apply on {args.cores} threads x{args.reps}")
    _, t_enc_n, _ = _time_encode(pairs, args, workers=args.cores)
    _, t_apply_n, exact_n = _time_decode(encs, pairs, args.reps, workers=args.cores)
    progress(f"deltas: encode and apply with xxh3 hashes x{args.reps}")
    legacy, t_enc_xxh3, _ = _time_encode(pairs, args, dc.LEGACY_HASH)
    _, t_apply_xxh3, exact_xxh3 = _time_decode(legacy, pairs, args.reps)
    fast = _fast_apply(pairs, args)
    progress("deltas: bounds and baselines (zstd-19 generic codings take a while)")
    order0 = [dc.entropy_bound(_state(o), _state(n)) for o, n in pairs]
    cond = [dc.conditioned_bound(_state(o), _state(n)) for o, n in pairs]
    raw_bits = sum(b.raw_bits for b in order0)
    encoded = sum(e.manifest["encoded_bytes"] for e in encs)
    ratio = raw / encoded
    order0_x = _allows(raw_bits, sum(b.bound_bits for b in order0))
    cond_x = _allows(raw_bits, sum(b.bound_bits for b in cond))
    news = [a for _, n in pairs for _, a in n.values()]
    t_copy, t_copy_reuse = _time_memcpy(news, args.reps)
    times = {
        "encode": t_enc,
        "encode_warm": t_enc_warm,
        "decode": t_dec,
        "apply": t_apply,
        "memcpy": t_copy,
        "memcpy_reuse": t_copy_reuse,
        "hash": _time_hash(news, args.reps, dc.LEGACY_HASH),
        "crypto_hash": _time_hash(news, args.reps, dc.DEFAULT_HASH),
        "encode_xxh3": t_enc_xxh3,
        "apply_xxh3": t_apply_xxh3,
        "encode_cores": t_enc_n,
        "apply_cores": t_apply_n,
    }
    return {
        "params": sum(a.size for _, a in pairs[0][1].values()),
        "versions": len(pairs),
        "changed_fraction": sum(b.changed for b in order0) / max(1, sum(b.numel for b in order0)),
        "ratio": ratio,
        "order0_bound_x": order0_x,
        "conditioned_bound_x": cond_x,
        "fraction_of_conditioned_bound": None if cond_x is None else ratio / cond_x,
        "encoded_bytes": encoded,
        "chunks": sum(len(e.chunks) for e in encs),
        "largest_chunk_bytes": max((len(c) for e in encs for c in e.chunks), default=0),
        "encodings": sorted(
            {p[3] for e in encs for t in e.manifest["tensors"] for p in t["pieces"]}
        ),
        **{f"{k}_gb_per_s": raw / t.wall / 1e9 for k, t in times.items()},
        "cpu_time_gb_per_s": {k: raw / t.cpu / 1e9 for k, t in times.items()},
        **_zstd_baselines(pairs),
        **(generic := _generic_baselines(pairs, ratio)),
        "fast_apply": {
            **fast,
            "x_smaller_than_strongest_generic": fast["ratio"]
            / generic["strongest_generic"]["ratio"],
        },
        "cores": args.cores,
        "encode_scaling": t_enc.wall / t_enc_n.wall,
        "apply_scaling": t_apply.wall / t_apply_n.wall,
        "bit_exact": exact and exact_xxh3 and exact_n and fast["bit_exact"],
        "hash_algorithm": dc.DEFAULT_HASH,
    }


def _fast_apply(pairs: list[Pair], args: argparse.Namespace) -> dict[str, Any]:
    """The versions encoded for fast applies, and their applies under each check."""
    raw = sum(a.nbytes for _, new in pairs for _, a in new.values())
    progress(f"deltas: fast-apply coding: encode, apply in place x{args.reps}")
    encs, t_enc, _ = _time_encode(pairs, args, fast_apply=True)
    times = {"encode": t_enc}
    _, times["apply"], exact = _time_decode(encs, pairs, args.reps, check="changes")
    _, times["apply_full"], exact_full = _time_decode(encs, pairs, args.reps, check="full")
    _, times["apply_cores"], exact_n = _time_decode(
        encs, pairs, args.reps, workers=args.cores, check="changes"
    )
    encoded = sum(e.manifest["encoded_bytes"] for e in encs)
    return {
        "ratio": raw / encoded,
        "encoded_bytes": encoded,
        "encodings": sorted(
            {p[3] for e in encs for t in e.manifest["tensors"] for p in t["pieces"]}
        ),
        **{f"{k}_gb_per_s": raw / t.wall / 1e9 for k, t in times.items()},
        "apply_scaling": times["apply"].wall / times["apply_cores"].wall,
        "cpu_time_gb_per_s": {k: raw / t.cpu / 1e9 for k, t in times.items()},
        "bit_exact": exact and exact_full and exact_n,
    }


def _allows(raw_bits: int, bound_bits: float) -> float | None:
    """The ratio a bound allows; None when nothing changed (any ratio is within it)."""
    return raw_bits / bound_bits if bound_bits > 0 else None


def _time_encode(
    pairs: list[Pair],
    args: argparse.Namespace,
    algorithm: str | None = None,
    workers: int = 1,
    fast_apply: bool = False,
) -> tuple[list[Any], Timing, Timing]:
    """Encode from fresh wrappers (hashes computed) and with the base hashes known (hashes of
    ``algorithm``, the codec's default if None), on ``workers`` threads; with
    ``fast_apply``, for fast applies (then the warm timing is not measured: zero)."""
    from rlstream.schemas import deltacodec as dc

    algorithm = algorithm or dc.DEFAULT_HASH
    mk = {
        "version": 1,
        "base_version": 0,
        "max_chunk_bytes": args.max_chunk_bytes,
        "hash_algorithm": algorithm,
        "workers": workers,
        "fast_apply": fast_apply,
    }
    t_cold, encs, _ = _timed(
        lambda: [dc.encode_delta(_state(o), _state(n), **mk) for o, n in pairs], args.reps
    )
    if fast_apply:
        return encs, t_cold, Timing(0.0, 0.0)
    warm = [_state(o) for o, _ in pairs]
    for state in warm:
        for t in state.values():
            t.hash_of(algorithm)
    t_warm, _, _ = _timed(
        lambda: [
            dc.encode_delta(w, _state(n), **mk) for w, (_, n) in zip(warm, pairs, strict=True)
        ],
        args.reps,
    )
    return encs, t_cold, t_warm


def _time_decode(
    encs: list[Any], pairs: list[Pair], reps: int, workers: int = 1, check: str = "full"
) -> tuple[Timing, Timing, bool]:
    """Decode into new arrays (base hashes computed), and apply in place (``check``) onto a
    held copy of the base whose hashes are known (copied outside the timed region), on
    ``workers`` threads; checks every result bit for bit."""
    from rlstream.schemas import deltacodec as dc

    wants = [_state(n) for _, n in pairs]

    def exact(outs: list[Any]) -> bool:
        return all(dc.same_state(o, w) for o, w in zip(outs, wants, strict=True))

    t_dec, _, ok_dec = _timed(
        lambda: [
            dc.decode(e.manifest, e.chunks, _state(o), workers=workers)
            for e, (o, _) in zip(encs, pairs, strict=True)
        ],
        reps,
        exact,
    )
    algorithm = dc.hash_algorithm(encs[0].manifest) if encs else dc.DEFAULT_HASH
    hashes = [{k: t.hash_of(algorithm) for k, t in _state(o).items()} for o, _ in pairs]

    def held() -> list[Any]:
        out = []
        for (o, _), known in zip(pairs, hashes, strict=True):
            state = _state({k: (tag, a.copy()) for k, (tag, a) in o.items()})
            for k, t in state.items():
                t.remember_hash(known[k], algorithm)
            out.append(state)
        return out

    def apply(states: list[Any]) -> list[Any]:
        return [
            dc.apply_in_place(e.manifest, e.chunks, s, workers=workers, check=check)
            for e, s in zip(encs, states, strict=True)
        ]

    t_apply, _, ok_apply = _timed(apply, reps, exact, setup=held)
    return t_dec, t_apply, ok_dec and ok_apply


def _time_memcpy(arrays: list[Any], reps: int) -> tuple[Timing, Timing]:
    """Copy of the same bytes into new memory, and into memory already in use."""
    import numpy as np

    t_fresh, _, _ = _timed(lambda: [a.copy() for a in arrays], reps)
    sinks = [np.empty_like(a) for a in arrays]

    def reuse() -> None:
        for sink, a in zip(sinks, arrays, strict=True):
            np.copyto(sink, a)

    reuse()  # fault the pages in first
    t_reuse, _, _ = _timed(reuse, reps)
    return t_fresh, t_reuse


def _time_hash(arrays: list[Any], reps: int, algorithm: str) -> Timing:
    """The codec's tensor hash (``bits_hash``) of the same bytes, of ``algorithm``."""
    from rlstream.schemas.deltacodec.bits import bits_hash

    t_hash, _, _ = _timed(lambda: [bits_hash(a, algorithm) for a in arrays], reps)
    return t_hash


def _zstd_baselines(pairs: list[Pair]) -> dict[str, float]:
    """zstd level 3, one thread, of the full new weights and of old XOR new."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=3, threads=0)
    news = [a for _, n in pairs for _, a in n.values()]
    olds = [o[k][1] for o, n in pairs for k in n]
    raw = sum(a.nbytes for a in news)
    t0 = time.perf_counter()
    full = sum(len(cctx.compress(a.data)) for a in news)
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    xor = sum(len(cctx.compress((a ^ b).data)) for a, b in zip(olds, news, strict=True))
    t_xor = time.perf_counter() - t0
    return {
        "zstd_full_ratio": raw / full,
        "zstd_full_gb_per_s": raw / t_full / 1e9,
        "zstd_xor_ratio": raw / xor,
        "zstd_xor_gb_per_s": raw / t_xor / 1e9,
    }


def _generic_baselines(pairs: list[Pair], ratio: float) -> dict[str, Any]:
    """The generic codings of old -> new (``delta_baselines``): their ratios, the strongest, and
    how many times smaller the codec's encoding is than it."""
    from rlstream.ops.bench.delta_baselines import generic_ratios

    generic = generic_ratios(pairs)
    name = max(generic, key=lambda k: generic[k])
    return {
        "generic": generic,
        "strongest_generic": {"name": name, "ratio": generic[name]},
        "x_smaller_than_strongest_generic": ratio / generic[name],
    }


def _lines(result: dict[str, Any]) -> list[str]:
    head = (
        f"deltas: median of {result['reps']}, {result['cpu_count']} cpus,"
        f" load {result['load_average']}"
    )
    lines = [head]
    for c in result["cases"]:
        f = c["fast_apply"]
        lines += [
            f"{c['workload']} lr {c['lr']:g} ({c['params']:,} params x {c['versions']}):"
            f" {c['changed_fraction']:.3%} changed, ratio {c['ratio']:.1f}x"
            f" (order-0 bound {_x(c['order0_bound_x'])}, conditioned bound"
            f" {_x(c['conditioned_bound_x'])}, {_x(c['fraction_of_conditioned_bound'], '.3f', '')}"
            " of it;"
            f" zstd full {c['zstd_full_ratio']:.2f}x, zstd xor {c['zstd_xor_ratio']:.1f}x),"
            f" bit exact: {c['bit_exact']}",
            "  generic codings, zstd-19: "
            + ", ".join(f"{k} {v:.1f}x" for k, v in c["generic"].items())
            + f"; the codec is {c['x_smaller_than_strongest_generic']:.2f}x smaller than the"
            f" strongest ({c['strongest_generic']['name']})",
            f"  encode {c['encode_gb_per_s']:.2f} GB/s (warm {c['encode_warm_gb_per_s']:.2f}),"
            f" apply in place {c['apply_gb_per_s']:.2f} GB/s, decode {c['decode_gb_per_s']:.2f}"
            f" GB/s, memcpy {c['memcpy_gb_per_s']:.2f} GB/s (reuse {c['memcpy_reuse_gb_per_s']:.2f}),"
            f" blake3 {c['crypto_hash_gb_per_s']:.2f} GB/s; with xxh3 hashes: encode"
            f" {c['encode_xxh3_gb_per_s']:.2f}, apply {c['apply_xxh3_gb_per_s']:.2f},"
            f" xxh3 {c['hash_gb_per_s']:.2f} GB/s",
            f"  on {c['cores']} threads: encode {c['encode_cores_gb_per_s']:.2f} GB/s"
            f" ({c['encode_scaling']:.2f}x one), apply {c['apply_cores_gb_per_s']:.2f} GB/s"
            f" ({c['apply_scaling']:.2f}x one)",
            "  by CPU time: "
            + ", ".join(f"{k} {v:.2f}" for k, v in c["cpu_time_gb_per_s"].items())
            + " GB/s",
            f"  fast-apply coding: ratio {f['ratio']:.1f}x"
            f" ({f['x_smaller_than_strongest_generic']:.2f}x smaller than the strongest generic),"
            f" encode {f['encode_gb_per_s']:.2f} GB/s, apply in place {f['apply_gb_per_s']:.2f}"
            f" GB/s checking the changes ({f['apply_full_gb_per_s']:.2f} with every hash),"
            f" on {c['cores']} threads {f['apply_cores_gb_per_s']:.2f} GB/s"
            f" ({f['apply_scaling']:.2f}x one)",
        ]
    return lines


def _x(value: float | None, fmt: str = ".1f", unit: str = "x") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"

"""``rlstream bench deltas``: the weight-delta codec on simulated RL steps, against baselines.

Model: ``--params`` bf16 weights in ``--tensors`` equal tensors, from fp32 master weights
w ~ N(0, 0.01²). One RL step per learning rate: steady-state Adam moments for i.i.d. unit
gradients (beta1 = 0.9: m ~ N(0, 0.229²); beta2 = 0.999: v ~ 1 ± 0.045), update
``lr * m / (sqrt(v) + 1e-8)``, new bf16 = round-to-nearest-even(w + update). At lr 1e-6 this
changes about 1.7% of the bf16 bit patterns, at 1e-5 about 11%.

Per case, medians over ``--reps`` repetitions, all single-threaded (numpy, zstd threads=0):

- ``encode_gb_per_s``: raw bytes of the new weights / encode time, from fresh tensors (both
  tensor hashes computed); ``encode_warm_gb_per_s``: base hashes already known (a learner
  that encoded the previous version has them);
- ``decode_gb_per_s``: into newly allocated arrays, base hashes computed and verified;
  ``decode_recycled_gb_per_s``: a double-buffered worker (base hashes known from its own
  previous decode, output written over the buffers of the version before);
- ``ratio`` (raw / encoded chunk bytes), the order-0 ``entropy_bound`` ratio of the change
  (``deltacodec.entropy_bound``) and ``entropy_bound_ratio`` = ratio / bound;
- baselines in the same run: zstd (level 3) of the full new weights and of old XOR new, and
  ``memcpy_gb_per_s`` (``np.copy`` of the same bytes into new memory; ``memcpy_reuse`` into
  existing memory);
- ``bit_exact``: every decoded state equals the new state bit for bit (checked outside the
  timed region).

Every ``*_gb_per_s`` uses wall-clock medians; ``cpu_time_gb_per_s`` repeats them with this
process's CPU time, the steadier per-core figure on a machine shared with other work (the
run also records the load average).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from rlstream.ops.bench.common import emit, median, progress

WEIGHT_STD = 0.01
ADAM_M_STD = 0.229  # sqrt((1 - beta1) / (1 + beta1)) for beta1 = 0.9
ADAM_V_STD = 0.045  # relative spread of v for beta2 = 0.999
ADAM_EPS = 1e-8


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deltas", help="weight-delta codec on simulated RL steps vs zstd/memcpy")
    p.add_argument("--params", type=int, default=100_000_000, help="bf16 weights in the model")
    p.add_argument("--tensors", type=int, default=4, help="tensors the weights are split into")
    p.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates")
    p.add_argument("--reps", type=int, default=5, help="repetitions per timing (median)")
    p.add_argument("--max-chunk-bytes", type=int, default=900_000, help="codec chunk limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    emit(result, args.json, _lines(result), "deltas")
    return 0 if all(c["bit_exact"] for c in result["cases"]) else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every learning rate's case; returns ``{"cases": [...], ...}``."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    sizes = _split(args.params, args.tensors)
    progress(f"deltas: {args.params:,} bf16 params in {len(sizes)} tensors")
    master = [rng.standard_normal(n, dtype=np.float32) * np.float32(WEIGHT_STD) for n in sizes]
    old = [_to_bf16(w) for w in master]
    cases = []
    for lr in (float(x) for x in args.lrs.split(",")):
        progress(f"deltas: lr {lr:g}: simulating one Adam step")
        new = [_to_bf16(_adam_step(w, lr, rng)) for w in master]
        cases.append(_case(lr, old, new, args))
    return {
        "bench": "deltas",
        "params": args.params,
        "tensors": len(sizes),
        "dtype": "bfloat16",
        "raw_bytes": 2 * args.params,
        "reps": args.reps,
        "max_chunk_bytes": args.max_chunk_bytes,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cases": cases,
    }


def _split(params: int, tensors: int) -> list[int]:
    tensors = max(1, min(tensors, params))
    return [params // tensors + (i < params % tensors) for i in range(tensors)]


def _to_bf16(w: Any) -> Any:
    """bf16 bit patterns of fp32 values, round to nearest even (inputs are finite)."""
    import numpy as np

    u = w.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def _adam_step(w: Any, lr: float, rng: Any) -> Any:
    import numpy as np

    m = rng.standard_normal(w.size, dtype=np.float32) * np.float32(ADAM_M_STD)
    v = np.float32(1.0) + rng.standard_normal(w.size, dtype=np.float32) * np.float32(ADAM_V_STD)
    m *= np.float32(lr) / (np.sqrt(v) + np.float32(ADAM_EPS))
    return w + m


class Timing(NamedTuple):
    """Median seconds of the repetitions: wall clock, and this process's CPU time (on a
    shared machine the CPU time is the steadier per-core figure)."""

    wall: float
    cpu: float


def _timed(
    fn: Callable[[], Any], reps: int, check: Callable[[Any], bool] | None = None
) -> tuple[Timing, Any, bool]:
    """Time ``reps`` calls; ``check`` runs on each result outside the timed region."""
    walls, cpus, ok, out = [], [], True, None
    for _ in range(max(1, reps)):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        ok = ok and (check is None or check(out))
    return Timing(median(walls), median(cpus)), out, ok


def _state(arrays: list[Any]) -> dict[str, Any]:
    """New wrappers each call: no hash cached, as for a state never hashed before."""
    from rlstream.schemas.deltacodec import TensorBits

    return {f"layer{i}.weight": TensorBits.from_numpy(a, "bfloat16") for i, a in enumerate(arrays)}


def _case(lr: float, old: list[Any], new: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from rlstream.schemas import deltacodec as dc

    raw = sum(a.nbytes for a in new)
    progress(f"deltas: lr {lr:g}: encode x{args.reps}")
    enc, t_enc, t_enc_warm = _time_encode(old, new, args)
    progress(f"deltas: lr {lr:g}: decode x{args.reps}")
    t_dec, t_dec_rec, exact = _time_decode(enc, old, new, args.reps)
    progress(f"deltas: lr {lr:g}: entropy bound and baselines")
    bound = dc.entropy_bound(_state(old), _state(new))
    ratio = raw / enc.manifest["encoded_bytes"]
    t_copy, t_copy_reuse = _time_memcpy(new, args.reps)
    times = {
        "encode": t_enc,
        "encode_warm": t_enc_warm,
        "decode": t_dec,
        "decode_recycled": t_dec_rec,
        "memcpy": t_copy,
        "memcpy_reuse": t_copy_reuse,
    }
    return {
        "lr": lr,
        "changed_fraction": bound.changed / max(1, bound.numel),
        "ratio": ratio,
        "entropy_bound": bound.ratio,
        "entropy_bound_ratio": ratio / bound.ratio,
        "encoded_bytes": enc.manifest["encoded_bytes"],
        "chunks": len(enc.chunks),
        "largest_chunk_bytes": max((len(c) for c in enc.chunks), default=0),
        "encodings": sorted({t["encoding"] for t in enc.manifest["tensors"]}),
        **{f"{k}_gb_per_s": raw / t.wall / 1e9 for k, t in times.items()},
        "cpu_time_gb_per_s": {k: raw / t.cpu / 1e9 for k, t in times.items()},
        **_zstd_baselines(old, new),
        "bit_exact": exact,
    }


def _time_encode(
    old: list[Any], new: list[Any], args: argparse.Namespace
) -> tuple[Any, Timing, Timing]:
    """Encode from fresh wrappers (hashes computed) and with the base hashes known."""
    from rlstream.schemas import deltacodec as dc

    mk = {"version": 1, "base_version": 0, "max_chunk_bytes": args.max_chunk_bytes}
    t_cold, enc, _ = _timed(lambda: dc.encode_delta(_state(old), _state(new), **mk), args.reps)
    warm = _state(old)
    for t in warm.values():
        _ = t.hash
    t_warm, _, _ = _timed(lambda: dc.encode_delta(warm, _state(new), **mk), args.reps)
    return enc, t_cold, t_warm


def _time_decode(
    enc: Any, old: list[Any], new: list[Any], reps: int
) -> tuple[Timing, Timing, bool]:
    """Decode cold (new arrays, base hashes computed) and as a double-buffered worker (base
    hashes known, output over the previous buffers); checks every result bit for bit."""
    from rlstream.schemas import deltacodec as dc

    want = _state(new)

    def exact(out: Any) -> bool:
        return dc.same_state(out, want)

    t_cold, _, ok_cold = _timed(
        lambda: dc.decode(enc.manifest, enc.chunks, _state(old)), reps, exact
    )
    base = _state(old)
    for t in base.values():
        _ = t.hash
    spare = {k: dc.TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in base.items()}

    def recycled() -> Any:
        nonlocal spare
        spare = dc.decode(enc.manifest, enc.chunks, base, recycle=spare)
        return spare

    t_recycled, _, ok_recycled = _timed(recycled, reps, exact)
    return t_cold, t_recycled, ok_cold and ok_recycled


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


def _zstd_baselines(old_arrays: list[Any], new_arrays: list[Any]) -> dict[str, float]:
    """zstd level 3, one thread, of the full new weights and of old XOR new."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=3, threads=0)
    raw = sum(a.nbytes for a in new_arrays)
    t0 = time.perf_counter()
    full = sum(len(cctx.compress(a.data)) for a in new_arrays)
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    xor = sum(len(cctx.compress((a ^ b).data)) for a, b in zip(old_arrays, new_arrays, strict=True))
    t_xor = time.perf_counter() - t0
    return {
        "zstd_full_ratio": raw / full,
        "zstd_full_gb_per_s": raw / t_full / 1e9,
        "zstd_xor_ratio": raw / xor,
        "zstd_xor_gb_per_s": raw / t_xor / 1e9,
    }


def _lines(result: dict[str, Any]) -> list[str]:
    head = (
        f"deltas: {result['params']:,} bf16 params, {result['tensors']} tensors, median of"
        f" {result['reps']}, {result['cpu_count']} cpus, load {result['load_average']}"
    )
    lines = [head]
    for c in result["cases"]:
        lines += [
            f"lr {c['lr']:g}: {c['changed_fraction']:.3%} changed, ratio {c['ratio']:.1f}x"
            f" (entropy bound {c['entropy_bound']:.1f}x, {c['entropy_bound_ratio']:.3f} of it;"
            f" zstd full {c['zstd_full_ratio']:.2f}x, zstd xor {c['zstd_xor_ratio']:.1f}x),"
            f" {c['chunks']} chunks, bit exact: {c['bit_exact']}",
            f"  encode {c['encode_gb_per_s']:.2f} GB/s (warm {c['encode_warm_gb_per_s']:.2f}),"
            f" decode {c['decode_gb_per_s']:.2f} GB/s (recycled {c['decode_recycled_gb_per_s']:.2f}),"
            f" memcpy {c['memcpy_gb_per_s']:.2f} GB/s (reuse {c['memcpy_reuse_gb_per_s']:.2f})",
            "  by CPU time: "
            + ", ".join(f"{k} {v:.2f}" for k, v in c["cpu_time_gb_per_s"].items())
            + " GB/s",
        ]
    return lines

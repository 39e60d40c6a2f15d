"""``rlstream bench publish``: sharded weight publishing into Kafka, and one version's fetch +
apply, for 1, 2 and 4 publishing ranks, on a model of about ``--gb`` GB.

The model is synthetic (say so when quoting the figures): ``ceil(gb / tensor size)`` bf16
tensors of ``--tensor-mb`` MB each, values drawn like trained weights (normal, std 0.02, cast
to bf16), the same for every rank count. The version measured is a keyframe (every byte of the
model encoded, written and applied: the case where throughput matters; an RL step's delta is
1-2% of it).

Per rank count N, on a fresh run's topics: N processes on gloo (``trainer.distributed.Ranks``;
N = 1 is the one-process publisher, no torch.distributed), each holding a
``WeightPublisher`` with its own chunk producer; rank 0 holds the transactional producer. Each
rank builds the tensors of its own shard only (the others are size stand-ins: a rank never
reads another's tensors). After a barrier each rank calls ``publish_version``; the publish time
is rank 0's, from that call until its manifest committed, which is after every rank's chunks
were acknowledged: ``publish_gb_per_s`` = model GB / that time. Then a fresh
``WeightSubscriber`` (one consumer reading every chunk partition, as a rollout worker does)
takes the version from nothing: manifest, every chunk, verify, decode:
``apply_gb_per_s`` = model GB / (subscriber created -> version held). ``max_version_gb`` is the
largest version published. The broker is local (loopback): Kafka bandwidth is not the limit,
CPU is (the machine's cores are shared by every rank and the broker).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

MODEL = "policy"


def register_bench(bench_subparsers: Any) -> None:
    """Add ``publish`` to the ``rlstream bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "publish",
        help="sharded weight publishing and one version's fetch+apply, 1/2/4 ranks",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--gb", type=float, default=1.0, help="model size in GB (synthetic bf16)")
    p.add_argument("--tensor-mb", type=float, default=32.0, help="size of each tensor in MB")
    p.add_argument("--ranks", default="1,2,4", help="publishing rank counts to measure")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap (default: local cluster)")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.ops.bench.common import bench_kafka, emit

    with bench_kafka(args) as settings:
        result = run(args, settings)
    lines = [
        f"{r['ranks']} rank(s): publish {r['publish_gb_per_s']:.3f} GB/s "
        f"({r['publish_s']:.1f}s), fetch+apply {r['apply_gb_per_s']:.3f} GB/s "
        f"({r['apply_s']:.1f}s), {r['chunks']} chunks, {r['encoded_gb']:.3f} GB on the wire"
        for r in result["runs"]
    ]
    lines.insert(0, f"synthetic bf16 model of {result['max_version_gb']:.3f} GB, keyframe")
    emit(result, args.json, [] if args.json else lines, "publish")
    return 0


@dataclass(frozen=True)
class _Sized:
    """A tensor of another rank's shard: only its size is known here (``shard_names`` needs it)."""

    nbytes: int


def _tensors(gb: float, tensor_mb: float) -> list[tuple[str, int]]:
    """``(name, elements)`` of the synthetic bf16 model."""
    per = max(1, int(tensor_mb * 1e6 / 2))
    count = max(1, math.ceil(gb * 1e9 / (per * 2)))
    return [(f"layers.{i:04d}.weight", per) for i in range(count)]


def _bits(index: int, n: int) -> Any:
    """Tensor ``index``'s bf16 bits: normal(0, 0.02) in fp32, rounded to bf16 (as torch)."""
    import numpy as np

    from rlstream.ops.bench.common import bf16_bits

    rng = np.random.default_rng(index)
    return bf16_bits(rng.standard_normal(n, dtype=np.float32) * np.float32(0.02))


def _state(specs: list[tuple[str, int]], rank: int, world: int) -> dict[str, Any]:
    """The state as rank ``rank`` of ``world`` holds it: its shard real, the rest stand-ins."""
    from rlstream.producers.weights.shards import shard_names
    from rlstream.schemas.deltacodec import TensorBits

    sized = {name: _Sized(n * 2) for name, n in specs}
    mine, _ = shard_names(sized, rank, world)  # type: ignore[arg-type]
    index = {name: i for i, (name, _) in enumerate(specs)}
    state: dict[str, Any] = dict(sized)
    for name in mine:
        n = specs[index[name]][1]
        state[name] = TensorBits("bfloat16", (n,), _bits(index[name], n))
    return state


def _rank(
    rank: int, world: int, port: int, settings: Any, run: str, specs: list, out: Any
) -> None:  # pragma: no cover (runs in a spawned process)
    from rlstream.ops.bench.common import run_signer
    from rlstream.producers.weights.publisher import rank_publisher
    from rlstream.schemas import topics

    ranks = None
    if world > 1:
        from rlstream.trainer.distributed import RankEnv, Ranks

        ranks = Ranks(RankEnv(rank, world, "127.0.0.1", port), backend="gloo")
    signer = run_signer(settings, run) if rank == 0 else None
    txn = f"{topics.group_id(run, 'learner')}.0"
    pub = rank_publisher(settings, run, MODEL, txn, ranks, signer=signer)
    producer = pub.producer
    state = _state(specs, rank, world)
    if ranks is not None:
        ranks.all_gather(None)  # every rank ready: the clock starts together
    t0 = time.perf_counter()
    rec = pub.publish_version(state, 0)
    took = time.perf_counter() - t0
    stats = pub.last_stats
    if rank == 0:
        assert stats is not None
        out.put(
            {
                "publish_s": took,
                "encode_s": stats.encode_s,
                "chunks": len(rec["chunks"]),
                "encoded_bytes": rec["encoded_bytes"],
                "raw_bytes": rec["raw_bytes"],
            }
        )
    pub.close()
    producer.wait(30)
    if ranks is not None:
        ranks.close()


def _publish(settings: Any, run: str, specs: list, world: int) -> dict[str, Any]:
    from rlstream.ops.run.ranks import run_local_ranks

    return run_local_ranks(_rank, world, (settings, run, specs), "publishing")


def _apply(settings: Any, run: str) -> tuple[float, Any]:
    """Seconds from a fresh subscriber to version 0 held, verified; its apply report."""
    from rlstream.consumers.weights.subscriber import WeightSubscriber

    t0 = time.perf_counter()
    with WeightSubscriber(settings, run, MODEL, fetch_timeout=600) as sub:
        snap = sub.wait_for(0, timeout=1200)
        took = time.perf_counter() - t0
        if snap is None or sub.failures:
            raise RuntimeError(f"version 0 not applied: {sub.failures}")
        report = sub.reports[-1]
    return took, report


def run(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """Measure every rank count in ``args.ranks``; returns the figures (module docstring)."""
    from rlstream.ops.bench.common import progress
    from rlstream.producers.client.admin import admin_client, ensure_run_topics
    from rlstream.schemas import topics

    specs = _tensors(args.gb, args.tensor_mb)
    runs, biggest = [], 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for world in [int(x) for x in str(args.ranks).split(",") if x.strip()]:
        run = f"bench-publish-{stamp}-{world}"
        ensure_run_topics(settings, run)
        progress(
            f"{world} rank(s): publishing a {sum(n for _, n in specs) * 2 / 1e9:.2f} GB keyframe"
        )
        pub = _publish(settings, run, specs, world)
        progress(f"{world} rank(s): published in {pub['publish_s']:.1f}s; fetching and applying")
        apply_s, report = _apply(settings, run)
        gb = pub["raw_bytes"] / 1e9
        biggest = max(biggest, pub["raw_bytes"])
        runs.append(
            {
                "ranks": world,
                "publish_gb_per_s": round(gb / pub["publish_s"], 4),
                "apply_gb_per_s": round(gb / apply_s, 4),
                "publish_s": round(pub["publish_s"], 2),
                "encode_s_rank0": round(pub["encode_s"], 2),
                "apply_s": round(apply_s, 2),
                "fetch_s": round(report.fetch_s, 2),
                "decode_s": round(report.decode_s, 2),
                "chunks": pub["chunks"],
                "encoded_gb": round(pub["encoded_bytes"] / 1e9, 4),
            }
        )
        admin_client(settings).delete_topics(list(topics.run_topics(run).values()))
    return {
        "runs": runs,
        "max_version_gb": round(biggest / 1e9, 4),
        "kind": "keyframe",
        "model": "synthetic bf16, normal(0, 0.02)",
        "tensors": len(specs),
        "tensor_mb": args.tensor_mb,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m rlstream.ops.bench.publish")
    register_bench(parser.add_subparsers())
    ns = parser.parse_args(["publish", *sys.argv[1:]])
    raise SystemExit(ns.func(ns))

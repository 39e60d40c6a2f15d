"""``rlstream bench sync``: weight versions from a learner process to subscriber processes
through Kafka, measured end to end.

A learner process publishes versions of a bf16 model under Adam-like steps; ``--subscribers``
subscriber processes follow and swap each version into a simulated engine; the next version is
published once all have swapped, and one more subscriber joins late. Figures: apply latency,
wire ratios against zstd of the XOR computed in the same run, the swap pause, the late join, and
``bit_exact`` at every version.

Only the standard library is imported at module level; the processes import the rest.
Details: docs/benchmarks.md (bench sync).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from rlstream.ops.bench.common import bench_kafka, bf16_bits, emit, median, progress, run_signer

MODEL = "policy"
WEIGHT_STD = 0.01
ADAM_M_STD = 0.229
MIB = 1 << 20


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="weight versions learner -> subscriber processes via Kafka")
    p.add_argument("--mb", type=float, default=100.0, help="model size, MiB of bf16 weights")
    p.add_argument("--versions", type=int, default=6, help="versions to publish (>= 2)")
    p.add_argument("--keyframe-every", type=int, default=4, help="keyframe period K")
    p.add_argument("--subscribers", type=int, default=2, help="subscriber processes")
    p.add_argument("--lr", type=float, default=1e-6, help="Adam-like step size")
    p.add_argument("--chunk-bytes", type=int, default=MIB, help="largest chunk payload")
    p.add_argument(
        "--swap",
        choices=("copy", "ref"),
        default="copy",
        help="copy: the engine copies new bits into its own buffers (decode recycles the"
        " replaced version's); ref: it takes the verified staging arrays by reference",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per version")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--bootstrap", default=None, help="an existing cluster")
    p.add_argument("--home", default=None, help="local cluster state directory to reuse")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    emit(result, args.json, _lines(result), "sync")
    return 0 if result["bit_exact"] else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the processes, publish ``args.versions`` versions, return the figures."""
    if args.versions < 2:
        raise ValueError("--versions must be at least 2")
    with bench_kafka(args) as settings:
        run_name = f"bench-sync-{uuid.uuid4().hex[:8]}"
        _make_topics(settings, run_name)
        cfg = {
            "bootstrap": settings.bootstrap_servers,
            "run": run_name,
            **{
                k: getattr(args, k)
                for k in ("mb", "keyframe_every", "lr", "chunk_bytes", "seed", "swap")
            },
        }
        with _Fleet() as fleet:
            return _measure(fleet, cfg, args)


def _measure(fleet: _Fleet, cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    subs = [fleet.spawn(f"sub{i}", "_subscriber", cfg) for i in range(args.subscribers)]
    for s in subs:
        fleet.expect(s, "ready", args.timeout)
    learner = fleet.spawn("learner", "_learner", cfg)
    ready = fleet.expect(learner, "ready", args.timeout)
    progress(f"sync: {ready['model_bytes'] / MIB:.0f} MiB bf16 in {ready['tensors']} tensors")
    published, applied = [], []
    for v in range(args.versions):
        fleet.send(learner, "go")
        pub = fleet.expect(learner, "published", args.timeout)
        got = [fleet.expect(s, "applied", args.timeout, version=v) for s in subs]
        published.append(pub)
        applied.append(got)
        lag = max(a["swapped_ms"] for a in got) - pub["commit_ms"]
        progress(
            f"sync: v{v} {'+'.join(pub['kinds'])}: {pub['changed'] / pub['numel']:.2%} changed,"
            f" {pub['encoded']['delta' if 'delta' in pub['kinds'] else 'keyframe'] / MIB:.2f} MiB"
            f" delta/keyframe, all {len(subs)} swapped {lag / 1000:.2f}s after commit"
        )
    late = fleet.spawn("late", "_subscriber", cfg)
    t0 = fleet.expect(late, "ready", args.timeout)["ms"]
    joined = fleet.expect(late, "applied", args.timeout, version=args.versions - 1)
    progress(f"sync: a late subscriber bootstrapped in {(joined['swapped_ms'] - t0) / 1000:.2f}s")
    fleet.send(learner, "quit")
    return _figures(ready, published, applied, joined, joined["swapped_ms"] - t0, args)


def _figures(
    ready: dict[str, Any],
    published: list[dict[str, Any]],
    applied: list[list[dict[str, Any]]],
    late: dict[str, Any],
    late_ms: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    model = ready["model_bytes"]
    lags = [
        max(a["swapped_ms"] for a in got) / 1000 - p["commit_ms"] / 1000
        for p, got in zip(published, applied, strict=True)
    ]
    steady = [a for got in applied[1:] for a in got]
    later = published[1:]
    every = [a for got in applied for a in got]
    wire = sum(a["bytes"] for a in steady)
    exact = all(
        a["hash"] == p["state_hash"] for p, got in zip(published, applied, strict=True) for a in got
    )
    return {
        "bench": "sync",
        "versions": args.versions,
        "subscribers": args.subscribers,
        "model_bytes": model,
        "tensors": ready["tensors"],
        "keyframe_every": args.keyframe_every,
        "chunk_bytes": args.chunk_bytes,
        "swap": args.swap,
        "lr": args.lr,
        "changed_fraction": median([p["changed"] / p["numel"] for p in published[1:]]),
        "apply_seconds_p50": median(lags[1:]),
        "apply_seconds_max": max(lags[1:]),
        "bootstrap_seconds": lags[0],
        "work_seconds_p50": median([a["apply_s"] for a in steady]),
        "fetch_seconds_p50": median([a["fetch_s"] for a in steady]),
        "decode_seconds_p50": median([a["decode_s"] for a in steady]),
        "wire_bytes_p50": median([float(a["bytes"]) for a in steady]),
        "wire_ratio": model * len(later) / sum(sum(p["encoded"].values()) for p in later),
        "zstd_xor_ratio": model * len(later) / sum(p["zstd_xor_bytes"] for p in later),
        "follower_wire_ratio": model * len(steady) / max(1, wire),
        "follower_zstd_xor_ratio": model
        * len(later)
        / sum(p["zstd_xor_delta_bytes"] for p in later),
        "wire_ratio_with_bootstrap": model * len(every) / max(1, sum(a["bytes"] for a in every)),
        "pause_ms_p50": median([a["pause_ms"] for a in steady]),
        "pause_ms_max": max(a["pause_ms"] for a in steady),
        "publish_seconds_p50": median([p["publish_s"] for p in published[1:]]),
        "late_join_seconds": late_ms / 1000,
        "late_join_bytes": late["bytes"],
        "late_join_steps": late["steps"],
        "bit_exact": exact and late["hash"] == published[-1]["state_hash"],
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _lines(r: dict[str, Any]) -> list[str]:
    return [
        f"sync: {r['model_bytes'] / MIB:.0f} MiB bf16 model, {r['versions']} versions"
        f" (keyframe every {r['keyframe_every']}), {r['subscribers']} subscriber processes,"
        f" {r['changed_fraction']:.2%} of weights changed per step",
        f"  commit -> all swapped: p50 {r['apply_seconds_p50']:.2f}s, max"
        f" {r['apply_seconds_max']:.2f}s (bootstrap {r['bootstrap_seconds']:.2f}s);"
        f" subscriber work p50 {r['work_seconds_p50']:.2f}s (fetch {r['fetch_seconds_p50']:.2f},"
        f" decode+verify {r['decode_seconds_p50']:.2f}); publish p50 {r['publish_seconds_p50']:.2f}s",
        f"  wire, keyframes amortised: {r['wire_ratio']:.1f}x smaller than the model per"
        f" version (zstd of the XOR, same keyframes: {r['zstd_xor_ratio']:.1f}x); a live"
        f" subscriber fetched {r['follower_wire_ratio']:.1f}x less"
        f" ({r['wire_bytes_p50'] / MIB:.2f} MiB p50; zstd of the XOR:"
        f" {r['follower_zstd_xor_ratio']:.1f}x)",
        f"  swap ({r['swap']}) pause p50 {r['pause_ms_p50']:.1f} ms (max {r['pause_ms_max']:.1f});"
        f" late join {r['late_join_seconds']:.2f}s, {r['late_join_bytes'] / MIB:.1f} MiB via"
        f" {r['late_join_steps']}; bit exact: {r['bit_exact']}",
    ]


def _make_topics(settings: Any, run: str) -> None:
    from rlstream.producers.client.admin import admin_client, apply_topics, run_topic_wants
    from rlstream.schemas import topics

    wanted = {topics.topic_name(run, s) for s in ("weights.manifests", "weights.chunks")}
    apply_topics(admin_client(settings), [w for w in run_topic_wants(run) if w.name in wanted])


# --- the processes ---------------------------------------------------------------------------


class _Fleet:
    """Child processes by pid, one stdout reader thread each feeding JSON lines to a queue.
    Leaving the block stops every child it started (terminate, then kill)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.lines: dict[str, queue.Queue[dict[str, Any] | None]] = {}

    def spawn(self, name: str, role: str, cfg: dict[str, Any]) -> str:
        cmd = [
            sys.executable,
            "-m",
            "rlstream.ops.bench.sync",
            role,
            json.dumps({**cfg, "name": name}),
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs[name], self.lines[name] = proc, queue.Queue()
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()
        return name

    def _read(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.lines[name].put(json.loads(line))
        self.lines[name].put(None)

    def send(self, name: str, line: str) -> None:
        stdin = self.procs[name].stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def expect(
        self, name: str, event: str, timeout: float, version: int | None = None
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines[name].get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{name}: no {event} within {timeout:.0f}s") from None
            if msg is None:
                raise RuntimeError(f"{name} exited (code {self.procs[name].wait()}) before {event}")
            if msg.get("event") == event and (version is None or msg.get("version") == version):
                return msg

    def __enter__(self) -> _Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _layout(mb: float) -> dict[str, tuple[int, ...]]:
    """Transformer-like tensor shapes holding at least ``mb`` MiB of bf16 weights."""
    params = int(mb * MIB) // 2
    d, vocab = (1024, 8192) if mb >= 64 else (256, 2048)
    per_layer = 12 * d * d + 2 * d
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(max(1, math.ceil((params - vocab * d) / per_layer))):
        for name, shape in (
            ("attn.qkv", (3 * d, d)),
            ("attn.out", (d, d)),
            ("mlp.up", (4 * d, d)),
            ("mlp.down", (d, 4 * d)),
            ("norm1", (d,)),
            ("norm2", (d,)),
        ):
            shapes[f"layers.{i}.{name}"] = shape
    return shapes


class _Model:
    """fp32 master weights in the ``_layout`` shapes, Adam-like steps, bf16 bit patterns."""

    def __init__(self, mb: float, seed: int, lr: float) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.scale = np.float32(lr * ADAM_M_STD)
        self.master = {
            n: self.rng.standard_normal(s, dtype=np.float32) * np.float32(WEIGHT_STD)
            for n, s in _layout(mb).items()
        }
        self.numel = sum(w.size for w in self.master.values())

    def step(self) -> None:
        """w += lr * m with m ~ N(0, 0.229²): Adam's steady-state update for unit gradients."""
        import numpy as np

        for w in self.master.values():
            w += self.scale * self.rng.standard_normal(w.shape, dtype=np.float32)

    def state(self) -> dict[str, Any]:
        from rlstream.schemas.deltacodec import TensorBits

        return {n: TensorBits("bfloat16", w.shape, bf16_bits(w)) for n, w in self.master.items()}


def _learner(cfg: dict[str, Any]) -> None:
    from rlstream.producers.client.producer import EventProducer
    from rlstream.producers.client.settings import KafkaSettings
    from rlstream.producers.weights.publisher import WeightPublisher

    model = _Model(cfg["mb"], cfg["seed"], cfg["lr"])
    settings = KafkaSettings(bootstrap_servers=cfg["bootstrap"])
    pub = WeightPublisher(
        EventProducer.transactional(settings, f"rlstream.{cfg['run']}.learner"),
        cfg["run"],
        MODEL,
        keyframe_every=cfg["keyframe_every"],
        max_chunk_bytes=cfg["chunk_bytes"],
        signer=run_signer(settings, cfg["run"]),
    )
    _say(event="ready", model_bytes=2 * model.numel, tensors=len(model.master))
    previous: dict[str, Any] | None = None
    for version, line in enumerate(sys.stdin):  # one "go" per version from the parent
        if line.strip() != "go":
            break
        if version:
            model.step()
        state = model.state()
        t0 = time.perf_counter()
        rec = pub.publish_version(state, version)
        commit_ms = time.time() * 1000
        publish_s = time.perf_counter() - t0
        stats = pub.last_stats
        assert stats is not None
        xor_bytes, full_bytes = _zstd_xor_bytes(state, previous, "keyframe" in stats.kinds)
        previous = state
        _say(
            event="published",
            version=version,
            commit_ms=commit_ms,
            publish_s=publish_s,
            zstd_xor_bytes=xor_bytes + full_bytes,
            zstd_xor_delta_bytes=xor_bytes,
            encode_s=stats.encode_s,
            kinds=list(stats.kinds),
            encoded=stats.encoded_bytes,
            changed=stats.changed,
            numel=model.numel,
            state_hash=rec["state_hash"],
        )


def _zstd_xor_bytes(
    state: dict[str, Any], previous: dict[str, Any] | None, keyframe: bool
) -> tuple[int, int]:
    """The competitor's bytes for one version: zstd (level 3) of each tensor's bf16 bits XOR the
    previous version's, and zstd of the full bits when this version is a keyframe (0, 0 for the
    first version, which both sides send as a keyframe only and the figures leave out)."""
    import zstandard

    if previous is None:
        return 0, 0
    cctx = zstandard.ZstdCompressor(level=3)
    xor = full = 0
    for name, t in state.items():
        xor += len(cctx.compress((t.bits ^ previous[name].bits).tobytes()))
        if keyframe:
            full += len(cctx.compress(t.bits.tobytes()))
    return xor, full


class _Engine:
    """A stand-in inference engine: generates in short steps under a lock, holds its weights in
    its own buffers, and swaps by copying new bits into them under the same lock."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lock = threading.Lock()
        self.weights: dict[str, Any] = {}
        self.version = -1
        self.pauses: dict[int, float] = {}
        self.swapped: dict[int, float] = {}

    def swap(self, snap: Any) -> None:
        import numpy as np

        with self.lock:
            t0 = time.perf_counter()
            if self.mode == "ref":
                self.weights = {name: t.bits for name, t in snap.state.items()}
            for name, t in snap.state.items() if self.mode == "copy" else ():
                if name not in self.weights or self.weights[name].shape != t.bits.shape:
                    self.weights[name] = np.empty_like(t.bits)
                np.copyto(self.weights[name], t.bits)
            self.version = snap.version
            self.pauses[snap.version] = (time.perf_counter() - t0) * 1000
        self.swapped[snap.version] = time.time() * 1000

    def generate(self, seconds: float) -> None:
        with self.lock:
            time.sleep(seconds)  # one decoding step on the current weights


def _subscriber(cfg: dict[str, Any]) -> None:
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.producers.client.settings import KafkaSettings
    from rlstream.schemas import deltacodec as codec

    engine = _Engine(cfg["swap"])
    settings = KafkaSettings(bootstrap_servers=cfg["bootstrap"])
    recycle = cfg["swap"] == "copy"  # the engine keeps no reference to a snapshot's arrays
    sub = WeightSubscriber(settings, cfg["run"], MODEL, on_swap=engine.swap, recycle=recycle)
    sub.start(interval=0.05)
    _say(event="ready", ms=time.time() * 1000)
    served = -1
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    while True:
        engine.generate(0.005)
        report = sub.reports[-1] if sub.reports else None
        if report is None or report.version == served or report.version not in engine.swapped:
            continue
        served = report.version
        snap = sub.latest()
        assert snap is not None
        fresh = {
            n: codec.TensorBits(t.dtype, t.shape, engine.weights[n]) for n, t in snap.state.items()
        }
        _say(
            event="applied",
            version=served,
            swapped_ms=engine.swapped[served],
            apply_s=report.apply_s,
            fetch_s=report.fetch_s,
            decode_s=report.decode_s,
            bytes=report.bytes_fetched,
            pause_ms=engine.pauses[served],
            steps=[f"{v}:{k}" for v, k in report.steps],
            hash=codec.state_hash(fresh),  # the engine's own copy, hashed afresh
        )


def _exit_with_parent() -> None:
    """The parent holds our stdin: when it goes away (closed or dead), so do we."""
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] not in (["_learner"], ["_subscriber"]) or len(sys.argv) != 3:
        sys.exit("this module runs the processes of `rlstream bench sync`; run that instead")
    {"_learner": _learner, "_subscriber": _subscriber}[sys.argv[1]](json.loads(sys.argv[2]))

"""``rlstream bench geo``: weights out and trajectories home across regions, through MirrorMaker 2,
against the same figures inside one region.

Setup: the local multi-region cluster when its ``trainer`` and ``eu`` regions and their link run
(``rlstream cluster up --regions trainer,eu``), else a temporary one started in its own state
directory and stopped (by pid) at the end. A learner in the trainer region publishes
``--versions`` versions of a bf16 model of ``--mb`` MiB (``bench sync``'s model: Adam-like steps,
keyframes every ``--keyframe-every``) with ``WeightPublisher.publish_version``; two subscribers
follow: one in ``eu`` reading MirrorMaker's copies (``source="trainer"``), and, as the baseline,
one in the trainer region reading the local topics. The next version is published when both
have applied the current one, so every version is measured.

Then ``--groups`` rollout transactions (``--group-size`` trajectory events of ``--tokens``
tokens each, like a rollout worker's) are committed in ``eu`` and read at home from
``eu.rl.RUN.trajectories``; the baseline commits them in the trainer region and reads them
there.

Figures (``--json``: the last stdout line): ``propagation_p50_s``/``_p99_s``: the learner's
commit to the version applied (verified, decoded, handed over) in ``eu``; ``cross_region_ratio``:
bytes of the weight records MirrorMaker copied to ``eu`` per version, over the full model's
bytes (keyframes included; ``cross_region_ratio_delta_p50`` over deltas only);
``trajectory_p50_s``/``_p99_s``: a rollout transaction's commit in ``eu`` to its last record read
at home; ``baseline``: the same figures inside one region (propagation, trajectories, and the
bytes the local subscriber fetched per version over the full model).
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

from rlstream.ops.bench.common import emit, local_cluster, median, percentile, progress, run_signer

MODEL = "policy"


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("geo", help="weights out and trajectories home across regions (MM2)")
    p.add_argument("--mb", type=float, default=16.0, help="model size, MiB of bf16 weights")
    p.add_argument("--versions", type=int, default=12, help="versions to publish (>= 3)")
    p.add_argument("--keyframe-every", type=int, default=8, help="keyframe period K")
    p.add_argument("--lr", type=float, default=1e-6, help="Adam-like step size")
    p.add_argument("--groups", type=int, default=20, help="rollout transactions to send home")
    p.add_argument("--group-size", type=int, default=8, help="trajectory events per transaction")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")
    p.add_argument("--timeout", type=float, default=120.0, help="per-version wait, seconds")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.versions < 3:
        raise SystemExit("error: --versions must be >= 3")
    result = run(args)
    emit(result, args.json, _lines(result), name="geo")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlstream.producers.client.admin import ensure_run_topics
    from rlstream.schemas import topics

    run_name = f"bench-geo-{uuid.uuid4().hex[:8]}"
    regions = topics.Regions("trainer", ("eu",))
    with local_cluster(args, ("trainer", "eu"), heap="512m") as local:
        settings = {r: local.settings(r) for r in ("trainer", "eu")}
        for name, s in settings.items():
            ensure_run_topics(s, run_name, regions=regions, here=name)
        weights = _weights(settings, run_name, args)
        trajectories = {
            where: _trajectories(settings, run_name, args, where) for where in ("eu", "trainer")
        }
        crossed = _crossed_bytes(settings["eu"], regions.topic(run_name, "weights.chunks", "eu"))
    return _figures(args, weights, trajectories, crossed)


def _weights(settings: dict[str, Any], run: str, args: argparse.Namespace) -> dict[str, Any]:
    """Publish the versions one by one; per version the commit time and each subscriber's
    applied time and fetched bytes."""
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.ops.bench.sync import _Model
    from rlstream.producers.client.producer import EventProducer
    from rlstream.producers.weights.publisher import WeightPublisher

    model = _Model(args.mb, seed=0, lr=args.lr)
    producer = EventProducer.transactional(settings["trainer"], f"rlstream.{run}.learner")
    signer = run_signer(settings["trainer"], run)
    pub = WeightPublisher(producer, run, MODEL, keyframe_every=args.keyframe_every, signer=signer)
    subs = {
        "eu": WeightSubscriber(settings["eu"], run, MODEL, source="trainer", fetch_timeout=60),
        "trainer": WeightSubscriber(settings["trainer"], run, MODEL, fetch_timeout=60),
    }
    commits: dict[int, float] = {}
    try:
        for sub in subs.values():
            sub.start(interval=0.05)
        for version in range(args.versions):
            if version:
                model.step()
            pub.publish_version(model.state(), version)
            commits[version] = time.time()
            for name, sub in subs.items():
                if not _wait_version(sub, version, args.timeout):
                    raise SystemExit(f"error: region {name} did not apply version {version}")
            progress(f"version {version}: applied in eu and in the trainer region")
    finally:
        for sub in subs.values():
            sub.close()
    return {
        "commits": commits,
        "model_bytes": model.numel * 2,
        "applied": {n: {r.version: r for r in s.reports} for n, s in subs.items()},
    }


def _wait_version(sub: Any, version: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = sub.version
        if current is not None and current >= version:
            return True
        time.sleep(0.01)
    return False


def _trajectories(
    settings: dict[str, Any], run: str, args: argparse.Namespace, where: str
) -> list[float]:
    """Seconds from each rollout transaction's commit in ``where`` to its last record read in
    the trainer region (from the copy when ``where`` is a rollout region)."""
    from rlstream.consumers.consumer import RoleConsumer, make_consumer
    from rlstream.producers.client.producer import EventProducer
    from rlstream.schemas import topics

    local = topics.topic_name(run, "trajectories")
    source = None if where == "trainer" else where
    consumer = RoleConsumer(
        make_consumer(settings["trainer"], f"rlstream.{run}.bench-home-{where}"),
        [topics.topic_pattern(run, "trajectories", [source])],
        settings=settings["trainer"],
    )
    seen: dict[str, float] = {}
    stop = threading.Event()
    reader = threading.Thread(target=_read_home, args=(consumer, args.group_size, seen, stop))
    reader.start()
    producer = EventProducer.transactional(settings[where], f"rlstream.{run}.rollout.{where}")
    committed: dict[str, float] = {}
    try:
        time.sleep(3.0)  # the consumer joins its group before the first record
        for i in range(args.groups):
            group = f"{where}-g{i}"
            with producer.transaction():
                for index in range(args.group_size):
                    rec = _trajectory(run, group, index, args, where)
                    producer.produce(local, "trajectory", rec, group)
            committed[group] = time.time()
            time.sleep(0.2)
        deadline = time.monotonic() + args.timeout
        while len(seen) < args.groups and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        reader.join()
        consumer.close()
        producer.close()
    progress(f"trajectories from {where}: {len(seen)} of {args.groups} groups read at home")
    return [seen[g] - committed[g] for g in committed if g in seen]


def _read_home(consumer: Any, group_size: int, seen: dict[str, float], stop: Any) -> None:
    counts: dict[str, int] = {}
    while not stop.is_set():
        for rec in consumer.poll_batch(500, 0.1):
            if rec.value is None:
                continue
            group = rec.value["group_id"]
            counts[group] = counts.get(group, 0) + 1
            if counts[group] == group_size:
                seen[group] = time.time()


def _trajectory(
    run: str, group: str, index: int, args: argparse.Namespace, region: str
) -> dict[str, Any]:
    import numpy as np

    from rlstream.schemas import arrays

    n, layers, top_k = args.tokens, 8, 8
    rng = np.random.default_rng(index)
    return {
        "run": run, "group_id": group, "task_id": group, "sample_index": index,
        "group_size": args.group_size, "policy_version": 0, "model": MODEL,
        "worker_id": f"{region}-bench", "region": region,
        **arrays.pack_tokens(
            rng.integers(0, 32_000, n, dtype=np.int32), rng.standard_normal(n).astype(np.float32),
            np.ones(n, np.uint8), rng.integers(0, 64, (n, layers, top_k), dtype=np.uint8),
        ),
        "prompt_tokens": 64, "completion": "x" * 256, "turns": [],
        "outcome": {"status": "completed", "tool_calls": 0, "summarised": False},
        "timings": {"queued_ms": 0, "started_ms": 0, "finished_ms": 0, "generate_ms": 0, "env_ms": 0},
    }  # fmt: skip


def _crossed_bytes(eu: Any, chunk_copy: str) -> dict[int, int]:
    """Per version, bytes of the chunk records MirrorMaker wrote to the copy in ``eu`` (key +
    value, as on the wire before compression)."""
    from rlstream.consumers.read_to_end import read_topic

    out: dict[int, int] = {}
    for msg in read_topic(eu, chunk_copy, name="bench-geo-bytes"):
        version = int((msg.key() or b"").decode().split("/")[1])
        out[version] = out.get(version, 0) + len(msg.key() or b"") + len(msg.value() or b"")
    return out


def _figures(
    args: argparse.Namespace,
    weights: dict[str, Any],
    trajectories: dict[str, list[float]],
    crossed: dict[int, int],
) -> dict[str, Any]:
    commits, model_bytes = weights["commits"], weights["model_bytes"]

    def propagation(region: str) -> list[float]:
        applied = weights["applied"][region]
        return [applied[v].applied_ms / 1000 - commits[v] for v in commits if v in applied and v]

    deltas = [v for v in crossed if v and v % args.keyframe_every]
    local = weights["applied"]["trainer"]
    fetched = [local[v].bytes_fetched / model_bytes for v in commits if v in local and v]
    return {
        "versions": args.versions,
        "model_mib": round(model_bytes / 2**20, 1),
        "propagation_p50_s": round(median(propagation("eu")), 3),
        "propagation_p99_s": round(percentile(propagation("eu"), 99), 3),
        "cross_region_ratio": round(sum(crossed.values()) / (len(commits) * model_bytes), 4),
        "cross_region_ratio_delta_p50": round(
            median([crossed[v] / model_bytes for v in deltas]), 4
        ),
        "trajectory_p50_s": round(median(trajectories["eu"]), 3),
        "trajectory_p99_s": round(percentile(trajectories["eu"], 99), 3),
        "trajectory_mib_per_group": round(_group_bytes(args) / 2**20, 2),
        "baseline": {
            "propagation_p50_s": round(median(propagation("trainer")), 3),
            "propagation_p99_s": round(percentile(propagation("trainer"), 99), 3),
            "fetched_ratio_p50": round(median(fetched), 4),
            "trajectory_p50_s": round(median(trajectories["trainer"]), 3),
            "trajectory_p99_s": round(percentile(trajectories["trainer"], 99), 3),
        },
    }


def _group_bytes(args: argparse.Namespace) -> int:
    return args.group_size * args.tokens * (4 + 4 + 1 + 64)


def _lines(r: dict[str, Any]) -> list[str]:
    b = r["baseline"]
    return [
        f"weights ({r['model_mib']} MiB bf16, {r['versions']} versions): commit -> applied in eu "
        f"p50 {r['propagation_p50_s']} s, p99 {r['propagation_p99_s']} s "
        f"(one region: p50 {b['propagation_p50_s']} s, p99 {b['propagation_p99_s']} s)",
        f"bytes crossing regions per version / full model: {r['cross_region_ratio']} "
        f"(deltas p50 {r['cross_region_ratio_delta_p50']}; one region fetches "
        f"{b['fetched_ratio_p50']} per delta)",
        f"trajectories home ({r['trajectory_mib_per_group']} MiB per group): p50 "
        f"{r['trajectory_p50_s']} s, p99 {r['trajectory_p99_s']} s (one region: p50 "
        f"{b['trajectory_p50_s']} s, p99 {b['trajectory_p99_s']} s)",
    ]

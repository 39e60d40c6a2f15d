"""``rlstream bench geo``: weights out and trajectories home across regions, through MirrorMaker 2,
against the same figures inside one region, over loopback or a WAN link.

A learner in the trainer region publishes versions; a subscriber in ``eu`` follows MirrorMaker's
copies, and one in the trainer region is the baseline; then rollout transactions committed in
``eu`` are read at home. ``--rtt-ms`` puts a WAN link (Toxiproxy) between the regions, and
``--cut-s`` cuts it for a while (``duplicates`` must then stay 0).

Figures: propagation and trajectory latencies (p50/p99), cross-region bytes per version, and the
same inside one region as ``baseline``.

Details: docs/benchmarks.md (bench geo).
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections import Counter
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
    p.add_argument(
        "--group-interval-s", type=float, default=0.2, help="seconds between two groups' commits"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="per-version wait, seconds")
    p.add_argument(
        "--rtt-ms",
        default=None,
        help="WAN round trips to measure in turn, comma-separated (e.g. 40,150); default none: "
        "the regions talk over loopback",
    )
    p.add_argument("--mbit", type=float, default=None, help="WAN rate per connection, Mbit/s")
    p.add_argument("--brokers", type=int, default=1, help="brokers per region (temporary cluster)")
    p.add_argument("--cut-s", type=float, default=None, help="cut the link this long mid-run")
    p.add_argument(
        "--mirror-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a MirrorMaker 2 setting for the links (repeatable), e.g. producer.batch.size=16384",
    )
    p.add_argument("--cut-pace-s", type=float, default=1.0, help="seconds a version during a cut")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.versions < 3:
        raise SystemExit("error: --versions must be >= 3")
    if args.cut_s is not None and args.rtt_ms is None:
        raise SystemExit("error: --cut-s cuts the WAN link: give --rtt-ms too")
    result = run(args)
    emit(
        result,
        args.json,
        _lines(result),
        name="geo" if args.brokers == 1 else f"geo-{args.brokers}b",
    )
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlstream.ops import cluster

    rtts = [float(x) for x in args.rtt_ms.split(",")] if args.rtt_ms else [None]
    first = cluster.LinkSpec(rtts[0], args.mbit) if rtts[0] is not None else None
    settings_out = []
    mirror_settings = dict(item.split("=", 1) for item in args.mirror_set)
    with local_cluster(
        args,
        ("trainer", "eu"),
        heap="512m",
        brokers=args.brokers,
        link=first,
        reuse_default=first is None,
    ) as local:
        for rtt in rtts:
            link = None
            if rtt is None and local.wan is not None and local.wan.running():
                link = _link(local, local.wan.rtt_ms, local.wan.mbit)  # a named cluster's WAN
            elif rtt is not None:
                local = cluster.up(
                    ["trainer", "eu"], home=local.home, link=cluster.LinkSpec(rtt, args.mbit),
                    log=lambda *_: None, mirror_settings=mirror_settings,
                )  # fmt: skip
                link = _link(local, rtt, args.mbit)
                progress(f"link at {rtt:g} ms: measured {link['measured_rtt_ms']} ms")
            settings_out.append(_setting(local, args, link))
        brokers = local.regions["trainer"].brokers
    return {
        "versions": args.versions,
        "brokers": brokers,
        "mirror_settings": mirror_settings,
        "model_mib": settings_out[0]["model_mib"],
        "settings": settings_out,
    }


def _link(local: Any, rtt: float, mbit: float | None) -> dict[str, Any]:
    from rlstream.ops.cluster import wan

    proxy = local.regions["trainer"].links["eu"][0][1]
    return {"rtt_ms": rtt, "mbit": mbit, "measured_rtt_ms": round(wan.measure_rtt_ms(proxy), 2)}


def _setting(local: Any, args: argparse.Namespace, link: dict | None) -> dict[str, Any]:
    """One link setting: a fresh run's weights and trajectories, crossing and local."""
    from rlstream.producers.client.admin import ensure_run_topics
    from rlstream.schemas import topics

    run_name = f"bench-geo-{uuid.uuid4().hex[:8]}"
    regions = topics.Regions("trainer", ("eu",))
    settings = {r: local.settings(r) for r in ("trainer", "eu")}
    for name, s in settings.items():
        ensure_run_topics(s, run_name, regions=regions, here=name)
    cut = _Cut(local, args) if args.cut_s is not None else None
    weights = _weights(settings, run_name, args, cut)
    trajectories = {
        where: _trajectories(settings, run_name, args, where, cut if where == "eu" else None)
        for where in ("eu", "trainer")
    }
    crossed = _crossed_bytes(settings["eu"], regions.topic(run_name, "weights.chunks", "eu"))
    figures = _figures(args, weights, trajectories, crossed)
    if cut is not None:
        figures["cut"] = cut.figures(weights, trajectories)
    return {"link": link, **figures}


class _Cut:
    """The link cut of a setting: once during the versions, once during the groups."""

    def __init__(self, local: Any, args: argparse.Namespace) -> None:
        self.home, self.seconds, self.pace = local.home, float(args.cut_s), args.cut_pace_s
        self.at_version = args.versions // 2
        self.at_group = args.groups // 2
        self.cut_at: float | None = None
        self.healed_at: float | None = None
        self.newest_during: int | None = None
        self.stranded: list[str] = []
        self.traj_cut_at = 0.0
        self.traj_healed_at = 0.0
        self.interrupted: list[str] = []

    def cut(self) -> None:
        from rlstream.ops import cluster

        cluster.cut_link("eu", self.home)
        progress(f"link to eu cut for {self.seconds:g} s")

    def heal(self) -> float:
        """Heal the link (and restart its MirrorMaker, ``cluster.heal_link``); returns when the
        link itself came back (the call's start: the proxies heal at once)."""
        from rlstream.ops import cluster

        healed_at = time.time()
        cluster.heal_link("eu", self.home)
        progress(f"link to eu healed (MirrorMaker restarted in {time.time() - healed_at:.1f} s)")
        return healed_at

    def figures(self, weights: dict[str, Any], trajectories: dict[str, Any]) -> dict[str, Any]:
        assert self.cut_at is not None and self.healed_at is not None
        applied = weights["applied"]["eu"]
        after = sorted(
            r.applied_ms / 1000 for r in applied.values() if r.applied_ms / 1000 > self.cut_at
        )
        newest = max(weights["commits"])
        at = trajectories["eu"]["home_at"]
        home = [at[g] - self.traj_healed_at for g in self.stranded if g in at]
        return {
            "seconds": self.seconds,
            "versions_published_dark": weights["published_dark"],
            "dark_s": round(after[0] - self.cut_at, 3) if after else None,
            "caught_up_s": round(applied[newest].applied_ms / 1000 - self.healed_at, 3)
            if newest in applied
            else None,
            "stranded": len(self.stranded),
            "interrupted": len(self.interrupted),
            "stranded_home_p50_s": round(median(home), 3) if home else None,
            "duplicates": {
                "versions_applied_twice": weights["applied_twice"]["eu"],
                "groups_read_twice": trajectories["eu"]["read_twice"],
            },
        }


def _weights(
    settings: dict[str, Any], run: str, args: argparse.Namespace, cut: _Cut | None = None
) -> dict[str, Any]:
    """Publish the versions one by one; per version the commit time and each subscriber's
    applied time and fetched bytes. With a ``cut``, the versions after its ``at_version`` are
    published for its seconds with the link cut, at its pace, waited for in the trainer region
    only."""
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.ops.bench.sync import _Model
    from rlstream.producers.client.producer import EventProducer
    from rlstream.producers.weights.publisher import WeightPublisher
    from rlstream.producers.weights.signing import Verifier

    model = _Model(args.mb, seed=0, lr=args.lr)
    producer = EventProducer.transactional(settings["trainer"], f"rlstream.{run}.learner")
    signer = run_signer(settings["trainer"], run)
    verifier = Verifier.from_hex(signer.public_hex)  # a rollout region is given the run's key
    pub = WeightPublisher(producer, run, MODEL, keyframe_every=args.keyframe_every, signer=signer)
    subs = {
        "eu": WeightSubscriber(
            settings["eu"], run, MODEL, source="trainer", fetch_timeout=60, verifier=verifier
        ),
        "trainer": WeightSubscriber(settings["trainer"], run, MODEL, fetch_timeout=60),
    }
    commits: dict[int, float] = {}
    dark: list[int] = []
    version = 0

    def publish(wait_for: dict[str, Any]) -> None:
        nonlocal version
        if version:
            model.step()
        pub.publish_version(model.state(), version)
        commits[version] = time.time()
        for name, sub in wait_for.items():
            if not _wait_version(sub, version, args.timeout):
                raise SystemExit(f"error: region {name} did not apply version {version}")
        version += 1

    try:
        for sub in subs.values():
            sub.start(interval=0.05)
        while version < args.versions:
            publish(subs)
            progress(f"version {version - 1}: applied in eu and in the trainer region")
            if cut is not None and version - 1 == cut.at_version:
                cut.cut()
                cut.cut_at = time.time()
                while time.time() - cut.cut_at < cut.seconds:
                    started = time.monotonic()
                    dark.append(version)
                    publish({"trainer": subs["trainer"]})
                    time.sleep(max(0.0, cut.pace - (time.monotonic() - started)))
                cut.healed_at = cut.heal()
                if not _wait_version(subs["eu"], version - 1, args.timeout):
                    raise SystemExit(f"error: eu did not catch up to version {version - 1}")
                progress(f"eu caught up to version {version - 1} after the heal")
    finally:
        for sub in subs.values():
            sub.close()
    return {
        "commits": commits,
        "dark_versions": dark,
        "published_dark": len(dark),
        "model_bytes": model.numel * 2,
        "applied": {n: {r.version: r for r in s.reports} for n, s in subs.items()},
        "applied_twice": {
            n: sum(c > 1 for c in Counter(r.version for r in s.reports).values())
            for n, s in subs.items()
        },
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
    settings: dict[str, Any], run: str, args: argparse.Namespace, where: str, cut: _Cut | None
) -> dict[str, Any]:
    """Seconds from each rollout transaction's commit in ``where`` to its last record read in
    the trainer region (from the copy when ``where`` is a rollout region), the time each group
    was read home and how many were read twice. With a ``cut``, the link is cut after its
    ``at_group`` for its seconds while groups go on being committed (its ``stranded``)."""
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
    counts: dict[str, int] = {}
    stop = threading.Event()
    reader = threading.Thread(
        target=_read_home, args=(consumer, args.group_size, seen, counts, stop)
    )
    reader.start()
    producer = EventProducer.transactional(settings[where], f"rlstream.{run}.rollout.{where}")
    committed: dict[str, float] = {}
    try:
        time.sleep(3.0)  # the consumer joins its group before the first record
        cut_at: float | None = None
        for i in range(args.groups):
            group = f"{where}-g{i}"
            with producer.transaction():
                for index in range(args.group_size):
                    rec = _trajectory(run, group, index, args, where)
                    producer.produce(local, "trajectory", rec, group)
            committed[group] = time.time()
            if cut is not None and i == cut.at_group:
                cut.cut()
                cut_at = cut.traj_cut_at = time.time()
            elif cut is not None and cut_at is not None:
                cut.stranded.append(group)
                if time.time() - cut_at >= cut.seconds:
                    cut.traj_healed_at, cut_at = cut.heal(), None
            time.sleep(args.group_interval_s)
        if cut is not None and cut_at is not None:  # the groups ran out before the cut's end
            cut.traj_healed_at = cut.heal()
        deadline = time.monotonic() + args.timeout
        while len(seen) < args.groups and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        reader.join()
        consumer.close()
        producer.close()
    progress(f"trajectories from {where}: {len(seen)} of {args.groups} groups read at home")
    touched: set[str] = set()
    if cut is not None:  # committed during the cut, or committed before it and home after it
        cut.interrupted = [
            g for g in committed if committed[g] < cut.traj_cut_at < seen.get(g, float("inf"))
        ]
        touched = set(cut.stranded) | set(cut.interrupted)
    return {
        "latency_s": [seen[g] - committed[g] for g in committed if g in seen and g not in touched],
        "home_at": dict(seen),
        "read_twice": sum(c > args.group_size for c in counts.values()),
    }


def _read_home(
    consumer: Any, group_size: int, seen: dict[str, float], counts: dict[str, int], stop: Any
) -> None:
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
    trajectories: dict[str, dict[str, Any]],
    crossed: dict[int, int],
) -> dict[str, Any]:
    """A setting's figures; versions published during a cut (and the first after it) are left
    out of the propagation figures: the cut's own figures tell of them."""
    commits, model_bytes = weights["commits"], weights["model_bytes"]
    dark = set(weights["dark_versions"])
    dark |= {max(dark) + 1} if dark else set()
    steady = [v for v in commits if v and v not in dark]

    def propagation(region: str) -> list[float]:
        applied = weights["applied"][region]
        return [applied[v].applied_ms / 1000 - commits[v] for v in steady if v in applied]

    deltas = [v for v in crossed if v and v % args.keyframe_every]
    local = weights["applied"]["trainer"]
    fetched = [local[v].bytes_fetched / model_bytes for v in commits if v in local and v]
    eu, home = trajectories["eu"]["latency_s"], trajectories["trainer"]["latency_s"]
    return {
        "versions": args.versions,
        "model_mib": round(model_bytes / 2**20, 1),
        "model_bytes": model_bytes,
        "propagation_p50_s": round(median(propagation("eu")), 3),
        "propagation_p99_s": round(percentile(propagation("eu"), 99), 3),
        "cross_region_bytes_per_version": round(sum(crossed.values()) / len(commits)),
        "cross_region_ratio": round(sum(crossed.values()) / (len(commits) * model_bytes), 4),
        "cross_region_ratio_delta_p50": round(
            median([crossed[v] / model_bytes for v in deltas]), 4
        ),
        "trajectory_p50_s": round(median(eu), 3),
        "trajectory_p99_s": round(percentile(eu, 99), 3),
        "trajectory_mib_per_group": round(_group_bytes(args) / 2**20, 2),
        "baseline": {
            "propagation_p50_s": round(median(propagation("trainer")), 3),
            "propagation_p99_s": round(percentile(propagation("trainer"), 99), 3),
            "fetched_ratio_p50": round(median(fetched), 4),
            "trajectory_p50_s": round(median(home), 3),
            "trajectory_p99_s": round(percentile(home, 99), 3),
        },
    }


def _group_bytes(args: argparse.Namespace) -> int:
    return args.group_size * args.tokens * (4 + 4 + 1 + 64)


def _lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for r in result["settings"]:
        b, link = r["baseline"], r["link"]
        where = (
            f"WAN {link['rtt_ms']:g} ms RTT (measured {link['measured_rtt_ms']} ms)"
            + (f", {link['mbit']:g} Mbit/s" if link["mbit"] else "")
            if link
            else "loopback"
        )
        lines += [
            f"[{where}, {result['brokers']} broker(s) a region]",
            f"weights ({r['model_mib']} MiB bf16, {r['versions']} versions): commit -> applied "
            f"in eu p50 {r['propagation_p50_s']} s, p99 {r['propagation_p99_s']} s "
            f"(one region: p50 {b['propagation_p50_s']} s, p99 {b['propagation_p99_s']} s)",
            f"bytes crossing regions per version: {r['cross_region_bytes_per_version']} "
            f"({r['cross_region_ratio']} of the model; deltas p50 "
            f"{r['cross_region_ratio_delta_p50']}; one region fetches {b['fetched_ratio_p50']} "
            "per delta)",
            f"trajectories home ({r['trajectory_mib_per_group']} MiB per group): p50 "
            f"{r['trajectory_p50_s']} s, p99 {r['trajectory_p99_s']} s (one region: p50 "
            f"{b['trajectory_p50_s']} s, p99 {b['trajectory_p99_s']} s)",
        ]
        if "cut" in r:
            c = r["cut"]
            lines.append(
                f"cut {c['seconds']:g} s: dark {c['dark_s']} s, caught up {c['caught_up_s']} s "
                f"after the heal, {c['stranded']} groups stranded (home "
                f"{c['stranded_home_p50_s']} s after the heal, p50), duplicates "
                f"{c['duplicates']}"
            )
    return lines

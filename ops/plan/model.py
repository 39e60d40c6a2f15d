"""How long one weight version takes to land on every engine, and what a deployment needs.

A version travels through stages in sequence, as the code runs them today:

1. ``encode``: each learner rank encodes its shard (the codec reads every raw byte of the
   shard and writes the wire bytes), on ``cores_per_rank`` threads;
2. ``write``: the chunks go to the trainer region's brokers and are acknowledged (acks=all),
   then one small transaction commits the manifest;
3. ``link``: MirrorMaker copies the chunks over each WAN link to a rollout region (the
   regions in parallel, each on its own link);
4. ``fetch``: every engine host of a region reads the whole version from the region's
   brokers (today's subscriber reads every chunk of a version);
5. ``decode``: every engine host verifies and decodes it against the version it holds;
6. ``pause``: generation stops while each GPU copies its changed values in.

Each stage's time is linear in the bytes it handles: the codec's (1, 5) in raw bytes (the
snapshot: every byte is read, and a decode rebuilds the whole state), Kafka's (2, 4) and the
link's (3) in wire bytes (the version's chunks) plus a fixed cost, the pause (6) in changed
bytes. The coefficients of stages 1, 2, 4 and 5 are measured on this machine by ``rlstream
bench plan`` (``Rates``: fitted on a small model, checked against a larger one); the hardware
this machine does not have
(broker NICs and disks, WAN links, host-to-device copies) is the deployment's to state
(``Deployment``), and ``plan`` prints which figure came from where.

Pure arithmetic: no Kafka, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """Costs measured by ``rlstream bench plan`` (seconds, GB). The codec's are a fixed part per
    version plus core-seconds per GB of raw weights, apart for keyframes and deltas: a delta's
    encode compares against the previous version and its decode rebuilds the whole state from
    the held one, so neither costs what a keyframe's does, and both read every raw byte."""

    encode_keyframe: tuple[float, float]  # (fixed s, core-seconds per raw GB)
    encode_delta: tuple[float, float]
    decode_keyframe: tuple[float, float]  # verify + decode
    decode_delta: tuple[float, float]
    write: tuple[float, float]  # (fixed s: acks and the manifest's transaction, s per wire GB)
    fetch: tuple[float, float]  # (fixed s: finding the manifest, s per wire GB): one reader
    keyframe_wire_ratio: float  # a keyframe's wire bytes per raw byte (bf16 weights)
    cores: int  # the codec threads the figures were measured with

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rates:
        out: dict[str, Any] = {}
        for f in fields(cls):
            value = data[f.name]
            out[f.name] = tuple(value) if isinstance(value, list) else value  # JSON has no tuples
        return cls(**out)

    def encode_s(self, kind: str, raw_gb: float, cores: int) -> float:
        fixed, per_gb = self.encode_keyframe if kind == "keyframe" else self.encode_delta
        return fixed + raw_gb * per_gb / cores

    def decode_s(self, kind: str, raw_gb: float, cores: int) -> float:
        fixed, per_gb = self.decode_keyframe if kind == "keyframe" else self.decode_delta
        return fixed + raw_gb * per_gb / cores


@dataclass(frozen=True)
class Deployment:
    """What is deployed (defaults: the scale the project follows, a 1T-parameter MoE)."""

    snapshot_gb: float = 1000.0  # raw bf16 weights of one version
    delta_gb: float = 50.0  # one version's chunks on the wire
    every_s: float = 300.0  # a version this often (5-15 min)
    land_s: float = 60.0  # goal: every engine holds a version this long after the step
    pause_s: float = 5.0  # goal: longest generation pause per swap
    ranks: int = 128  # learner ranks, each encodes its shard
    cores_per_rank: int = 8  # codec threads per rank
    brokers: int = 6  # per region
    broker_gb_s: float = 1.0  # per broker, in and out alike (NIC or disk, the lower)
    replication: int = 3  # copies of every chunk in a region
    partitions: int = 64  # of the chunk topic
    partition_gb_s: float = 0.1  # one partition's write rate on a replicated cluster
    producers: int = 128  # chunk producers writing in parallel (one per rank)
    regions: int = 4  # rollout regions, each behind a WAN link
    link_gbit_s: float = 100.0  # per link
    rtt_ms: float = 150.0
    link_round_trips: float = 2.0  # per version across a link (bench geo: 1-2)
    hosts: int = 16  # engine hosts per region
    fetchers_per_host: int = 1  # subscribers splitting the version's chunks (today: 1)
    host_cores: int = 8  # codec threads per engine host (the codec's default is at most 8)
    gpus_per_engine: int = 16
    changed_fraction: float = 0.05  # of the weights whose bits change in one version
    h2d_gb_s: float = 25.0  # host-to-device copy per GPU

    def with_(self, **changes: Any) -> Deployment:
        return replace(self, **changes)


#: Where each figure of ``Deployment`` comes from: the deployment's hardware, not measured here.
ASSUMED = (
    "broker_gb_s", "partition_gb_s", "link_gbit_s", "rtt_ms", "link_round_trips", "h2d_gb_s",
    "changed_fraction",
)  # fmt: skip

#: The stages of a version in order (module docstring).
STAGES = ("encode", "write", "link", "fetch", "decode", "pause")


def _write_terms(d: Deployment, r: Rates) -> dict[str, float]:
    """The chunk write rate (GB/s) each resource allows: the lowest binds."""
    return {
        "producers": d.producers / r.write[1],
        "partitions": d.partitions * d.partition_gb_s,
        "brokers": d.brokers * d.broker_gb_s / d.replication,
    }


def _fetch_terms(d: Deployment, r: Rates) -> dict[str, float]:
    """The rate (GB/s) at which each engine host reads a version: its fetchers', or its share of
    the region's brokers (every host reads the whole version): the lowest binds."""
    return {
        "fetchers_per_host": d.fetchers_per_host / r.fetch[1],
        "brokers": d.brokers * d.broker_gb_s / d.hosts,
    }


def stage_seconds(d: Deployment, r: Rates, kind: str = "delta") -> dict[str, float]:
    """Seconds each stage of one version takes in deployment ``d`` with rates ``r``: a delta
    (the steady state), or a keyframe (its wire bytes from the measured keyframe ratio)."""
    raw = d.snapshot_gb
    wire = d.delta_gb if kind == "delta" else raw * r.keyframe_wire_ratio
    return {
        # each rank encodes its shard of the raw bytes, all ranks at once
        "encode": r.encode_s(kind, raw / d.ranks, d.cores_per_rank),
        "write": r.write[0] + wire / min(_write_terms(d, r).values()),
        "link": wire / (d.link_gbit_s / 8) + d.link_round_trips * d.rtt_ms / 1000,
        "fetch": r.fetch[0] + wire / min(_fetch_terms(d, r).values()),
        "decode": r.decode_s(kind, raw, d.host_cores),
        "pause": raw * d.changed_fraction / d.gpus_per_engine / d.h2d_gb_s,
    }


def binding(d: Deployment, r: Rates, stage: str) -> str:
    """The resource that, doubled, shortens ``stage`` (the one its time is bound by)."""
    if stage == "write":
        terms = _write_terms(d, r)
        return min(terms, key=lambda k: terms[k])
    if stage == "fetch":
        terms = _fetch_terms(d, r)
        return min(terms, key=lambda k: terms[k])
    return {"encode": "ranks", "link": "link_gbit_s", "decode": "host_cores"}.get(
        stage, "gpus_per_engine"
    )


def one_host(kind: str, raw_gb: float, wire_gb: float, r: Rates) -> dict[str, float]:
    """Seconds to publish (encode + write) and to follow (fetch + decode) one version of
    ``raw_gb`` raw and ``wire_gb`` wire bytes as ``bench plan`` runs it: one rank, one
    subscriber, one broker, the codec on ``r.cores`` threads."""
    return {
        "publish_s": r.encode_s(kind, raw_gb, r.cores) + r.write[0] + wire_gb * r.write[1],
        "follow_s": r.fetch[0] + wire_gb * r.fetch[1] + r.decode_s(kind, raw_gb, r.cores),
    }


def land_seconds(stages: dict[str, float]) -> float:
    """A version's time from the learner's step to every engine holding it."""
    return sum(stages.values())


def size(d: Deployment, r: Rates, most_doublings: int = 64) -> tuple[Deployment, list[str]]:
    """A deployment that lands a version within ``d.land_s`` and pauses within ``d.pause_s``,
    grown from ``d``: while a goal is missed, double the resource that binds the longest stage
    (``binding``); stop when a doubling no longer shortens it (its fixed part is left: round
    trips, acknowledgements). Returns the deployment and each doubling, in order."""
    steps: list[str] = []
    for _ in range(most_doublings):
        stages = stage_seconds(d, r)
        if land_seconds(stages) <= d.land_s and stages["pause"] <= d.pause_s:
            break
        stage = "pause" if stages["pause"] > d.pause_s else max(stages, key=lambda k: stages[k])
        name = binding(d, r, stage)
        grown = d.with_(**{name: getattr(d, name) * 2})
        if stage_seconds(grown, r)[stage] > 0.99 * stages[stage]:
            steps.append(f"{stage} cannot be shortened further by {name}")
            break
        d = grown
        steps.append(f"{name} x2 -> {getattr(d, name):g} ({stage})")
    return d, steps


def plan(d: Deployment, r: Rates) -> dict[str, Any]:
    """The whole answer: stages, landing time, the goals met, the dominant term, a deployment
    grown to meet the goals (``size``), and a link's average load."""
    stages = stage_seconds(d, r)
    land = land_seconds(stages)
    dominant = max(stages, key=lambda s: stages[s])
    return {
        "deployment": asdict(d),
        "rates": asdict(r),
        "assumed": list(ASSUMED),
        "stages_s": {k: round(v, 3) for k, v in stages.items()},
        "land_s": round(land, 2),
        "land_goal_met": land <= d.land_s,
        "pause_goal_met": stages["pause"] <= d.pause_s,
        "dominant": dominant,
        "dominant_share": round(stages[dominant] / land, 3) if land else 0.0,
        "sized": _sized(d, r),
        "keyframe_land_s": round(land_seconds(stage_seconds(d, r, "keyframe")), 2),
        "link_avg_gbit_s": round(d.delta_gb * 8 / d.every_s, 3),
        "fits_cadence": land <= d.every_s,
    }


def _sized(d: Deployment, r: Rates) -> dict[str, Any]:
    grown, steps = size(d, r)
    stages = stage_seconds(grown, r)
    changed = {k: v for k, v in asdict(grown).items() if v != getattr(d, k)}
    return {
        "changed": changed,
        "doublings": steps,
        "land_s": round(land_seconds(stages), 2),
        "stages_s": {k: round(v, 3) for k, v in stages.items()},
        "met": land_seconds(stages) <= d.land_s and stages["pause"] <= d.pause_s,
    }


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x`` (a, b); with one distinct x, ``a = 0`` and ``b = y/x``."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    if sxx == 0:
        return 0.0, my / mx
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx
    return my - b * mx, b


def relative_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured``."""
    return abs(predicted - measured) / measured if measured else math.inf

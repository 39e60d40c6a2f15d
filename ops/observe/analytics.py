"""Run analytics: what a run's streams say, folded by pure rules (no Kafka in this module).

``RunAnalytics.take(topic, record, ts_ms)`` folds one decoded record; ``snapshot(now_ms)``
returns a JSON-ready dict of every figure the live dashboard draws and the static report plots,
so both show the same numbers.

Rules a maintainer must keep: a sample counts once (its first segment), a decision once (its
part 0); implausible weight manifests never become the policy version shown; memory is bounded;
nothing is NaN in a snapshot (a figure with no data is ``None``: browsers reject NaN in JSON).

Details: docs/operations.md (Run analytics).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlstream.schemas import topics
from rlstream.schemas.deltacodec.wire import VersionTips

#: Streams the charts show: every stream of a run (catalog order).
CHART_STREAMS = topics.RUN_STREAMS
#: Streams the analytics read: weights.chunks is derived from the manifests (payloads are large).
STREAMS = tuple(s for s in CHART_STREAMS if s != "weights.chunks")
SUCCESS_JUDGE = "tests"
LIVE_WINDOW_S = 300
RATE_WINDOW_S = 10
RUN_BUCKET_S = 10
MAX_LIST = 500
LATENCY_BOUNDS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 300_000)
RECENT_STALENESS = 50


def run_topic_regex(run: str, streams: Iterable[str] = STREAMS) -> str:
    """The subscription for the streams the analytics read, local and mirrored copies."""
    return topics.streams_pattern(run, streams)


def split_topic(topic: str) -> tuple[str | None, str | None, str]:
    """(source region or None, run, stream) of a run topic; (None, None, topic) otherwise."""
    try:
        name = topics.parse_topic(topic)
    except ValueError:
        return None, None, topic
    return name.region, name.run, name.stream


role_of_group = topics.role_of_group


def quantile(
    bounds: tuple[float, ...], counts: list[int], q: float, top: float, bottom: float = 0.0
) -> float | None:
    """The ``q`` quantile of a bucketed distribution, interpolating linearly inside a bucket.

    ``counts[i]`` holds values in ``(bounds[i-1], bounds[i]]``; the last count is the overflow
    bucket. ``bottom`` and ``top`` are the smallest and largest values seen: a bucket is narrowed
    to them, so the answer never leaves the observed range. None when empty.
    """
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            low = max(bounds[i - 1] if i > 0 else 0.0, bottom)
            high = max(min(bounds[i] if i < len(bounds) else top, top), low)
            return low + (high - low) * (rank - seen) / n
        seen += n
    return top


def _mean(total: float, count: int) -> float | None:
    return total / count if count else None


@dataclass
class Series:
    """Record counts over time: per second for the live window, per bucket for the whole run."""

    total: int = 0
    live: dict[int, int] = field(default_factory=dict)
    run: dict[int, int] = field(default_factory=dict)
    newest_s: int = 0

    def add(self, ts_ms: int | None, n: int = 1) -> None:
        self.total += n
        if ts_ms is None or ts_ms <= 0:
            return  # counted, but not placed in time
        sec = ts_ms // 1000
        self.live[sec] = self.live.get(sec, 0) + n
        bucket = sec // RUN_BUCKET_S
        self.run[bucket] = self.run.get(bucket, 0) + n
        if sec > self.newest_s:
            self.newest_s = sec
        if len(self.live) > LIVE_WINDOW_S + 60:
            # prune relative to the newest record, not to a clock, so folding stays pure
            floor = self.newest_s - LIVE_WINDOW_S
            self.live = {s: c for s, c in self.live.items() if s > floor}

    def rate(self, now_ms: int, window_s: int = RATE_WINDOW_S) -> float:
        """Records per second with a timestamp in ``[now - window, now)``."""
        end = now_ms // 1000
        return sum(self.live.get(s, 0) for s in range(end - window_s, end)) / window_s

    def recent(self, now_ms: int, seconds: int = 120) -> list[int]:
        """Per-second counts of the ``seconds`` seconds before ``now``, oldest first."""
        end = now_ms // 1000
        return [self.live.get(s, 0) for s in range(end - seconds, end)]


@dataclass
class JudgeStats:
    count: int = 0
    errors: int = 0
    sum_ms: float = 0.0
    min_ms: float = math.inf
    max_ms: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_MS) + 1))

    def add(self, latency_ms: float, error: bool) -> None:
        self.count += 1
        self.errors += error
        self.sum_ms += latency_ms
        self.min_ms = min(self.min_ms, latency_ms)
        self.max_ms = max(self.max_ms, latency_ms)
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_MS, latency_ms)] += 1

    def summary(self) -> dict[str, Any]:
        q = lambda p: quantile(LATENCY_BOUNDS_MS, self.buckets, p, self.max_ms, self.min_ms)  # noqa: E731
        return {
            "count": self.count,
            "errors": self.errors,
            "mean_ms": _mean(self.sum_ms, self.count),
            "p50_ms": q(0.5),
            "p95_ms": q(0.95),
            "max_ms": self.max_ms if self.count else None,
            "buckets": [
                [b, n] for b, n in zip([*LATENCY_BOUNDS_MS, None], self.buckets, strict=True)
            ],
        }


@dataclass
class RegionStats:
    records: int = 0
    samples: int = 0
    generate_ms: float = 0.0
    weights_wait_ms: float = 0.0
    last_version: int = -1
    topics: set[str] = field(default_factory=set)
    series: Series = field(default_factory=Series)


@dataclass
class Manifest:
    version: int
    kind: str
    raw_bytes: int
    encoded_bytes: int
    created_ms: int
    chunks: int
    stats: dict[str, float]


@dataclass
class RunAnalytics:
    """Every figure of one run, folded from its records; see the module docstring for the rules."""

    run: str = ""
    streams: dict[str, Series] = field(default_factory=dict)
    version: int = -1
    """Newest policy version published (weights.manifests); -1 before the first."""
    success: dict[int, list[int]] = field(default_factory=dict)
    """version -> [passed, judged] of the success judge."""
    scores: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    """version -> judge -> [score sum, scored count]."""
    success_judge: str | None = None
    judges: dict[str, JudgeStats] = field(default_factory=dict)
    staleness: dict[str, collections.Counter[int]] = field(
        default_factory=lambda: {
            "admitted": collections.Counter(),
            "rejected": collections.Counter(),
        }
    )
    recent_staleness: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STALENESS)
    )
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    admitted: int = 0
    trajectories: int = 0
    """Samples (first segments) seen, over all regions."""
    rewards: int = 0
    manifests: dict[int, Manifest] = field(default_factory=dict)
    first_use: dict[tuple[int, str], int] = field(default_factory=dict)
    """(version, region) -> earliest started_ms of a sample generated with that version."""
    regions: dict[str, RegionStats] = field(default_factory=dict)
    dead_letters: collections.Counter[str] = field(default_factory=collections.Counter)
    weights_refused: collections.Counter[str] = field(default_factory=collections.Counter)
    """Manifests not folded, by kind (``epoch``, ``version``)."""
    weight_tips: VersionTips = field(default_factory=VersionTips)
    """model -> newest (version, learner epoch) folded."""
    undecodable: collections.Counter[str] = field(default_factory=collections.Counter)
    lag: dict[str, dict[str, int]] = field(default_factory=dict)
    """group id -> topic -> lag, as last measured (set by ``set_lag``)."""
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)
    """version -> its held-out evaluation (eval events)."""
    capacity: dict[str, collections.deque[dict[str, Any]]] = field(default_factory=dict)
    """region -> its newest capacity signals (``MAX_LIST``), oldest first."""
    preempted: collections.Counter[str] = field(default_factory=collections.Counter)
    """region -> groups its reclaimed workers handed on."""

    # --- folding -------------------------------------------------------------------------

    def take(self, topic: str, record: Mapping[str, Any], ts_ms: int | None = None) -> None:
        """Fold one decoded record of ``topic`` (Kafka timestamp ``ts_ms``, epoch ms)."""
        _, _, stream = split_topic(topic)
        self._series(stream).add(ts_ms)
        handler = _HANDLERS.get(stream)
        if handler is not None:
            handler(self, topic, record, ts_ms)

    def take_undecodable(self, topic: str, reason: str) -> None:
        """Count a record that could not be decoded (it is not folded into any figure)."""
        self.undecodable[f"{split_topic(topic)[2]}: {reason}"] += 1

    def set_lag(self, lags: Mapping[str, Mapping[str, int]]) -> None:
        """Replace the consumer lag, ``group id -> topic -> lag`` (from ``group_lag``)."""
        self.lag = {g: dict(t) for g, t in lags.items()}

    def _series(self, stream: str) -> Series:
        if stream not in self.streams:
            self.streams[stream] = Series()
        return self.streams[stream]

    def _reward(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        self.rewards += 1
        judge, version = str(rec["judge"]), int(rec["policy_version"])
        error = rec.get("error") is not None
        self.judges.setdefault(judge, JudgeStats()).add(float(rec["latency_ms"]), error)
        if error:
            return
        if self.success_judge is None or (judge == SUCCESS_JUDGE != self.success_judge):
            self._set_success_judge(judge)
        if judge == self.success_judge:
            counts = self.success.setdefault(version, [0, 0])
            counts[0] += bool(rec["passed"])
            counts[1] += 1
        total = self.scores.setdefault(version, {}).setdefault(judge, [0.0, 0])
        total[0] += float(rec["score"])
        total[1] += 1

    def _set_success_judge(self, judge: str) -> None:
        # Switching to "tests" after another judge came first: recount from the per-judge scores
        # is impossible (passed is not kept per judge), so restart the success counts.
        if self.success_judge is not None:
            self.success.clear()
        self.success_judge = judge

    def _trajectory(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        source, _, _ = split_topic(topic)
        region = str(rec.get("region") or source or "local")
        stats = self.regions.setdefault(region, RegionStats())
        stats.records += 1
        stats.topics.add(topic)
        version = int(rec["policy_version"])
        stats.last_version = max(stats.last_version, version)
        if int(rec.get("segment_index", 0)) != 0:
            return
        self.trajectories += 1
        stats.samples += 1
        stats.series.add(ts_ms)
        timings = rec.get("timings") or {}
        stats.generate_ms += float(timings.get("generate_ms", 0))
        stats.weights_wait_ms += float(timings.get("weights_wait_ms", 0))
        started = int(timings.get("started_ms", 0))
        if started > 0:
            key = (version, region)
            self.first_use[key] = min(self.first_use.get(key, started), started)

    def _decision(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        if int(rec.get("part_index", 0)) != 0:
            return
        decision = "admitted" if rec["decision"] == "admitted" else "rejected"
        staleness = int(rec["staleness"])
        self.staleness[decision][staleness] += 1
        self.recent_staleness.append(staleness)
        if decision == "admitted":
            self.admitted += 1
        else:
            self.rejected[str(rec.get("reason") or "other")] += 1

    def _manifest(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        version, epoch = int(rec["version"]), int(rec.get("learner_epoch", 0))
        why = self.weight_tips.admit(rec["model"], version, epoch)
        if why is not None:
            self.weights_refused[why[0]] += 1
            return
        self.version = max(self.version, version)
        chunks = len(rec.get("chunks") or [])
        self.manifests[version] = Manifest(
            version=version,
            kind=str(rec["kind"]),
            raw_bytes=int(rec["raw_bytes"]),
            encoded_bytes=int(rec["encoded_bytes"]),
            created_ms=int(rec["created_ms"]),
            chunks=chunks,
            stats={k: float(v) for k, v in (rec.get("stats") or {}).items()},
        )
        self._series("weights.chunks").add(ts_ms or int(rec["created_ms"]), chunks)

    def _dead_letter(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        self.dead_letters[str(rec.get("reason") or "other")] += 1

    def _eval(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        self.evals[int(rec["version"])] = {
            "version": int(rec["version"]),
            "greedy_success": float(rec["greedy_success"]),
            "pass_at_k": float(rec["pass_at_k"]),
            "sample_success": float(rec["sample_success"]),
            "k": int(rec["k"]),
            "n_tasks": int(rec["n_tasks"]),
            "released": bool(rec["released"]),
        }

    # --- figures -------------------------------------------------------------------------

    def _capacity(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        signals = self.capacity.setdefault(str(rec["region"]), collections.deque(maxlen=MAX_LIST))
        signals.append(
            {
                "t_ms": int(rec["published_ms"]),
                "lent": int(rec["lent"]),
                "engines": int(rec["engines"]),
                "dedicated": int(rec.get("dedicated") or 0),
                "busy_engines": float(rec["busy_engines"]),
                "serving_p99_ms": rec.get("serving_p99_ms"),
                "guard": str(rec.get("guard") or ""),
            }
        )

    def _preempted(self, topic: str, rec: Mapping[str, Any], ts_ms: int | None) -> None:
        self.preempted[str(rec["region"])] += 1

    def rate(self, versions: Iterable[int]) -> float:
        """Success rate over ``versions`` together; NaN when none of them was judged."""
        passed = judged = 0
        for v in versions:
            p, j = self.success.get(v, (0, 0))
            passed, judged = passed + p, judged + j
        return passed / judged if judged else float("nan")

    def final_versions(self, min_samples: int = 256, skip_newest: int = 2) -> list[int]:
        """The newest versions holding at least ``min_samples`` judged samples together.

        The ``skip_newest`` newest versions are left out: when a run stops, their groups are still
        being judged, and the ones judged first (short answers) would bias the rate.
        """
        chosen, count = [], 0
        for ver in sorted(self.success, reverse=True)[skip_newest:]:
            chosen.append(ver)
            count += self.success[ver][1]
            if count >= min_samples:
                break
        return chosen

    def mean_recent_staleness(self) -> float | None:
        """Mean staleness of the last ``RECENT_STALENESS`` decisions."""
        return _mean(sum(self.recent_staleness), len(self.recent_staleness))

    def snapshot(self, now_ms: int) -> dict[str, Any]:
        """Every figure as plain JSON types, as of ``now_ms`` (the end of the rate window)."""
        return {
            "run": self.run,
            "now_ms": now_ms,
            "policy_version": self.version,
            "streams": self._stream_figures(now_ms),
            "lag": self._lag_figures(),
            "versions": self._version_figures(),
            "success_judge": self.success_judge,
            "staleness": self._staleness_figures(),
            "mean_recent_staleness": self.mean_recent_staleness(),
            "admitted": self.admitted,
            "rejected": sum(self.rejected.values()),
            "rejections": dict(self.rejected.most_common()),
            "weights": self._weight_figures(),
            "judges": {j: s.summary() for j, s in sorted(self.judges.items())},
            "regions": self._region_figures(now_ms),
            "dead_letters": dict(self.dead_letters.most_common()),
            "weights_refused": dict(self.weights_refused.most_common()),
            "undecodable": dict(self.undecodable.most_common()),
            "samples": self.trajectories,
            "evals": [self.evals[v] for v in sorted(self.evals)][-MAX_LIST:],
            "capacity": self._capacity_figures(),
        }

    def _stream_figures(self, now_ms: int) -> dict[str, dict[str, Any]]:
        out = {}
        for stream in [*CHART_STREAMS, *sorted(set(self.streams) - set(CHART_STREAMS))]:
            s = self.streams.get(stream, Series())
            out[stream] = {"total": s.total, "rate": s.rate(now_ms), "recent": s.recent(now_ms)}
        return out

    def _lag_figures(self) -> dict[str, dict[str, Any]]:
        out = {}
        for group, lags in sorted(self.lag.items()):
            by_stream = {}
            for topic, lag in sorted(lags.items()):
                region, _, stream = split_topic(topic)
                by_stream[f"{region}.{stream}" if region else stream] = lag
            role = role_of_group(self.run, group) or group
            out[role] = {"group": group, "total": sum(by_stream.values()), "topics": by_stream}
        return out

    def _version_figures(self) -> list[dict[str, Any]]:
        versions = sorted(set(self.success) | set(self.scores))[-MAX_LIST:]
        rows = []
        for v in versions:
            passed, judged = self.success.get(v, (0, 0))
            means = {j: _mean(t[0], int(t[1])) for j, t in sorted(self.scores.get(v, {}).items())}
            rows.append(
                {
                    "version": v,
                    "judged": judged,
                    "success": _mean(passed, judged),
                    "mean_reward": means,
                }
            )
        return rows

    def _staleness_figures(self) -> list[list[int]]:
        """Rows ``[staleness, admitted, rejected]`` for every staleness seen, ascending."""
        adm, rej = self.staleness["admitted"], self.staleness["rejected"]
        return [[s, adm.get(s, 0), rej.get(s, 0)] for s in sorted(set(adm) | set(rej))]

    def _weight_figures(self) -> list[dict[str, Any]]:
        rows, previous = [], None
        for v in sorted(self.manifests)[-MAX_LIST:]:
            m = self.manifests[v]
            first_use = {
                region: started - m.created_ms
                for (ver, region), started in sorted(self.first_use.items())
                if ver == v
            }
            rows.append(
                {
                    "version": v,
                    "kind": m.kind,
                    "raw_bytes": m.raw_bytes,
                    "encoded_bytes": m.encoded_bytes,
                    "ratio": m.raw_bytes / m.encoded_bytes if m.encoded_bytes else None,
                    "created_ms": m.created_ms,
                    "interval_ms": m.created_ms - previous.created_ms if previous else None,
                    "chunks": m.chunks,
                    "first_use_ms": first_use,
                    "stats": {k: x for k, x in m.stats.items() if math.isfinite(x)},
                }
            )
            previous = m
        return rows

    def _region_figures(self, now_ms: int) -> dict[str, dict[str, Any]]:
        return {
            region: {
                "records": r.records,
                "samples": r.samples,
                "rate": r.series.rate(now_ms),
                "mean_generate_ms": _mean(r.generate_ms, r.samples),
                "mean_weights_wait_ms": _mean(r.weights_wait_ms, r.samples),
                "last_version": r.last_version,
                "topics": sorted(r.topics),
            }
            for region, r in sorted(self.regions.items())
        }

    def _capacity_figures(self) -> dict[str, dict[str, Any]]:
        """Per region: the newest signal, its history ``[t_ms, lent, busy]`` and the groups
        handed on at a reclaim (tidal capacity)."""
        out = {}
        for region, signals in sorted(self.capacity.items()):
            newest = signals[-1]
            finite = newest["serving_p99_ms"]
            out[region] = {
                **{k: v for k, v in newest.items() if k != "serving_p99_ms"},
                "serving_p99_ms": finite if finite is None or math.isfinite(finite) else None,
                "preempted": self.preempted.get(region, 0),
                "history": [[s["t_ms"], s["lent"], s["busy_engines"]] for s in signals],
            }
        return out

    def run_series(self, stream: str) -> list[tuple[int, int]]:
        """Whole-run counts of ``stream`` as ``(bucket start epoch s, records)``, ascending."""
        s = self.streams.get(stream)
        return [(b * RUN_BUCKET_S, n) for b, n in sorted(s.run.items())] if s else []


_HANDLERS = {
    "rewards": RunAnalytics._reward,
    "trajectories": RunAnalytics._trajectory,
    "admitted": RunAnalytics._decision,
    "rejected": RunAnalytics._decision,
    "weights.manifests": RunAnalytics._manifest,
    "dlq": RunAnalytics._dead_letter,
    "evals": RunAnalytics._eval,
    "capacity": RunAnalytics._capacity,
    "preempted": RunAnalytics._preempted,
}

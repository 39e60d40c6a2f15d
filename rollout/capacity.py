"""The capacity role: what a region's serving fleet lends to rollouts, published as a stream.

Capacity that serves users by day is lent to RL by night. One ``capacity`` role per region reads
the serving load, from the serving engines' own Prometheus ``/metrics`` (vLLM's running and
waiting requests and request latency, or the policy server's) or from a load trace replayed in
compressed time, and publishes a ``Capacity`` record to ``rl.RUN.capacity`` every ``interval_s``:
the engines lent now (``lent``) and why. Rollout workers with a capacity slot below ``lent`` roll
out (``rollout.lease``); the scheduler releases tasks by what each region lends.

The lending rule (``Guard.decide``), each tick:
- serving needs ``ceil(busy / (1 - headroom))`` engines (``busy``: the load in engines' worth),
  and never fewer than ``min_serving``; the rest may be lent;
- the SLO guard: when the serving p99 of the last tick is over ``slo_p99_ms``, lending drops to
  at most one engine below what was lent (and below what the load allows), and it is not raised
  again for ``cooldown_s``: a burst the load rule missed is handed engines back at once;
- lending is raised by at most ``raise_step`` engines a tick (a region rejoins gradually), and
  cut at once.

Details: docs/capacity.md.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import re
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlstream.consumers.consumer import RoleContext
from rlstream.producers.client.producer import EventProducer
from rlstream.schemas import topics
from rlstream.schemas.derive import LOCAL, derive
from rlstream.schemas.errors import RlstreamError

#: The trace shipped with rlstream (``docs/capacity.md`` says what it is).
DIURNAL_TRACE = Path(__file__).resolve().parent / "traces" / "diurnal.csv"


class CapacityError(RlstreamError, ValueError):
    """A trace or a metrics endpoint that cannot be read."""


class CapacityConfig(BaseModel):
    """Config of the capacity role (one per region)."""

    model_config = ConfigDict(extra="forbid")

    engines: int = Field(0, ge=0, le=100_000, description="Serving engines in the region.")
    engines_by_region: dict[str, int] = Field(
        default_factory=dict, description="Serving engines of the regions that differ."
    )
    min_serving: int = Field(1, ge=0, description="Engines never lent, whatever the load.")
    dedicated: int = Field(
        0, ge=0, description="The region's rollout engines that are not the serving fleet's."
    )
    headroom: float = Field(
        0.25, ge=0.0, lt=1.0, description="Share of the serving need kept free on top of it."
    )
    slo_p99_ms: float = Field(2000.0, gt=0, description="Serving latency bound (p99), ms.")
    cooldown_s: float = Field(
        30.0, ge=0, description="After the guard cut lending, it is not raised for this long."
    )
    raise_step: int = Field(1, ge=1, description="Most engines lent more per tick.")
    interval_s: float = Field(1.0, gt=0, le=3600, description="Seconds between two signals.")
    source: Literal["trace", "metrics"] = Field(
        "trace",
        description="Load from a trace replayed in compressed time (the serving p99 still from "
        "metrics_urls when given), or everything from the engines' live /metrics.",
    )
    trace: str | None = Field(
        None,
        description="Trace CSV (columns t_s, load: the share of the fleet's capacity serving "
        "needs); None: the shipped diurnal day (rollout/traces/diurnal.csv).",
        json_schema_extra=LOCAL,
    )
    time_scale: float = Field(
        1.0, gt=0, description="Trace seconds per wall second (a day in 10 minutes: 144)."
    )
    trace_origin_ms: int | None = Field(
        None,
        ge=0,
        description="Wall time (epoch ms) of the trace's t_s 0, so every region replays the same "
        "moment; None: when the role starts.",
    )
    metrics_urls: list[str] = Field(
        default_factory=list,
        description="The region's serving engines' Prometheus /metrics URLs.",
        json_schema_extra=LOCAL,
    )
    slots_per_engine: int = Field(
        16, ge=1, description="Requests an engine runs at once (vLLM's max_num_seqs)."
    )

    @model_validator(mode="after")
    def _source_given(self) -> CapacityConfig:
        if self.source == "metrics" and not self.metrics_urls:
            raise ValueError("source 'metrics' needs metrics_urls (each engine's /metrics)")
        if self.min_serving > self.engines and self.engines:
            raise ValueError(f"min_serving {self.min_serving} > engines {self.engines}")
        return self


@dataclass
class Guard:
    """The lending rule with its state (see the module rules)."""

    cfg: CapacityConfig
    lent: int = 0
    hold_until: float = 0.0

    def allowed(self, busy: float) -> int:
        """Engines the load alone leaves lendable."""
        need = math.ceil(max(0.0, busy) / (1.0 - self.cfg.headroom) - 1e-9)
        return max(0, self.cfg.engines - max(need, self.cfg.min_serving))

    def decide(self, busy: float, p99_ms: float | None, now: float) -> tuple[int, str]:
        """Engines to lend now, and why lending is below what the load allows ("" if not)."""
        allowed, reason = self.allowed(busy), ""
        if p99_ms is not None and p99_ms > self.cfg.slo_p99_ms:
            if self.lent > 0 or allowed > 0:
                reason = "p99 over the SLO"
            allowed = min(allowed, max(0, self.lent - 1))
            self.hold_until = now + self.cfg.cooldown_s
        elif now < self.hold_until and allowed > self.lent:
            allowed, reason = self.lent, "cooling down"
        if allowed > self.lent:
            allowed = min(allowed, self.lent + self.cfg.raise_step)
        self.lent = allowed
        return allowed, reason


@dataclass
class Reading:
    """One look at the serving side: its load in engines' worth and its recent p99."""

    busy: float
    p99_ms: float | None = None
    steady_s: float | None = None  # how long the load stays at or under this one (trace only)


class TraceLoad:
    """A load trace (``t_s,load`` rows; load as a share of the fleet) replayed from ``start``
    at ``time_scale`` trace seconds per wall second, looping; linear between rows."""

    def __init__(self, path: Path, engines: int, time_scale: float, start: float) -> None:
        self.name = path.stem
        self.engines, self.scale, self.start = engines, time_scale, start
        self.t, self.load = read_trace(path)
        self.period = self.t[-1]

    def at(self, trace_s: float) -> float:
        x = trace_s % self.period
        i = bisect.bisect_right(self.t, x)
        if i >= len(self.t):
            return self.load[-1]
        t0, t1 = self.t[i - 1], self.t[i]
        w = (x - t0) / (t1 - t0) if t1 > t0 else 0.0
        return self.load[i - 1] + w * (self.load[i] - self.load[i - 1])

    def read(self, now: float, guard: Guard) -> Reading:
        trace_s = (now - self.start) * self.scale
        busy = self.at(trace_s) * self.engines
        return Reading(busy, None, self._steady(trace_s, guard.allowed(busy), guard))

    def _steady(self, trace_s: float, lendable: int, guard: Guard) -> float | None:
        """Wall seconds until the trace's load allows fewer than ``lendable`` engines (None: not
        within one period)."""
        step = max(self.period / 2000, 1e-6)
        ahead = step
        while ahead < self.period:
            if guard.allowed(self.at(trace_s + ahead) * self.engines) < lendable:
                return ahead / self.scale
            ahead += step
        return None


def read_trace(path: Path) -> tuple[list[float], list[float]]:
    """The rows of a trace CSV, checked: times from 0, increasing; loads in [0, 1]."""
    try:
        with path.open(newline="") as fh:
            rows = [(float(r["t_s"]), float(r["load"])) for r in csv.DictReader(fh)]
    except FileNotFoundError as exc:
        raise CapacityError(f"trace {path}: no such file") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise CapacityError(f"trace {path}: rows must be t_s,load numbers ({exc})") from exc
    if len(rows) < 2 or rows[0][0] != 0:
        raise CapacityError(f"trace {path}: needs at least two rows, the first at t_s 0")
    ts, loads = [t for t, _ in rows], [x for _, x in rows]
    if any(b <= a for a, b in itertools.pairwise(ts)):
        raise CapacityError(f"trace {path}: t_s must increase")
    if any(not 0.0 <= x <= 1.0 for x in loads):
        raise CapacityError(f"trace {path}: load is a share of the fleet, in [0, 1]")
    return ts, loads


# --- live metrics ---------------------------------------------------------------------------

#: Gauges and histograms read, by what they mean: vLLM's names, then the policy server's.
RUNNING = ("vllm:num_requests_running", "rlstream_serve_requests_running")
WAITING = ("vllm:num_requests_waiting", "rlstream_serve_requests_waiting")
LATENCY = ("vllm:e2e_request_latency_seconds", "rlstream_serve_request_seconds")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')


def parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text exposition: metric name -> [(labels, value)] (comments skipped)."""
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((m.group(2) or "", value))
    return out


def _first(samples: dict[str, list[tuple[str, float]]], names: Iterable[str]) -> float:
    for name in names:
        if name in samples:
            return sum(v for _, v in samples[name])
    return 0.0


def buckets(samples: dict[str, list[tuple[str, float]]]) -> dict[float, float]:
    """The latency histogram's cumulative counts by upper bound (seconds), summed over series."""
    for name in LATENCY:
        rows = samples.get(f"{name}_bucket")
        if rows:
            out: dict[float, float] = {}
            for labels, value in rows:
                le = _LE.search(labels)
                if le is not None:
                    bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
                    out[bound] = out.get(bound, 0.0) + value
            return out
    return {}


def quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of the requests finished between two scrapes of a histogram: the upper
    bound of the first bucket holding it (conservative), in ms; None if none finished."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * counts[-1]:
            return bound * 1000 if math.isfinite(bound) else math.inf
    return math.inf


@dataclass
class MetricsLoad:
    """The serving engines' own ``/metrics``, scraped each tick."""

    urls: list[str]
    slots_per_engine: int
    fetch: Callable[[str], str] = field(default=lambda url: _get(url))
    _last: dict[str, dict[float, float]] = field(default_factory=dict)

    def read(self, now: float, guard: Guard) -> Reading:
        busy, p99s = 0.0, []
        for url in self.urls:
            samples = parse_metrics(self.fetch(url))
            running, waiting = _first(samples, RUNNING), _first(samples, WAITING)
            busy += (running + waiting) / self.slots_per_engine
            hist = buckets(samples)
            if url in self._last:
                p99 = quantile_ms(self._last[url], hist, 0.99)
                if p99 is not None:
                    p99s.append(p99)
            self._last[url] = hist
        return Reading(busy, max(p99s) if p99s else None)


def _get(url: str, timeout: float = 5.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode())
    except OSError as exc:
        raise CapacityError(f"metrics {url}: {exc}") from exc


# --- the role --------------------------------------------------------------------------------


@dataclass
class TracedLoad:
    """The load from a trace, the serving p99 from the engines' metrics."""

    trace: TraceLoad
    latency: MetricsLoad

    @property
    def name(self) -> str:
        return self.trace.name

    def read(self, now: float, guard: Guard) -> Reading:
        reading = self.trace.read(now, guard)
        reading.p99_ms = self.latency.read(now, guard).p99_ms
        return reading


def load_source(cfg: CapacityConfig, start: float) -> TraceLoad | MetricsLoad | TracedLoad:
    if cfg.source == "metrics":
        return MetricsLoad(list(cfg.metrics_urls), cfg.slots_per_engine)
    path = Path(cfg.trace) if cfg.trace else DIURNAL_TRACE
    origin = start if cfg.trace_origin_ms is None else cfg.trace_origin_ms / 1000
    trace = TraceLoad(path, cfg.engines, cfg.time_scale, origin)
    if cfg.metrics_urls:
        return TracedLoad(trace, MetricsLoad(list(cfg.metrics_urls), cfg.slots_per_engine))
    return trace


def capacity_record(
    run: str, region: str, cfg: CapacityConfig, source: str, reading: Reading, lent: int, why: str
) -> dict[str, Any]:
    return {
        "run": run,
        "region": region,
        "published_ms": int(time.time() * 1000),
        "source": source,
        "engines": cfg.engines,
        "dedicated": cfg.dedicated,
        "busy_engines": float(reading.busy),
        "lent": int(lent),
        "headroom": cfg.headroom,
        "slo_p99_ms": cfg.slo_p99_ms,
        "serving_p99_ms": reading.p99_ms,
        "guard": why,
        "steady_ms": None if reading.steady_s is None else int(reading.steady_s * 1000),
    }


def run_role(ctx: RoleContext[CapacityConfig]) -> int:
    """Publish the region's capacity every ``interval_s`` until stopped; returns the count."""
    run, region, log = ctx.run, ctx.region, ctx.log
    cfg = derive(ctx.cfg, engines=ctx.cfg.engines_by_region.get(region, ctx.cfg.engines))
    guard = Guard(cfg)
    src = load_source(cfg, time.time())
    name = "metrics" if isinstance(src, MetricsLoad) else f"trace:{src.name}"
    topic = topics.topic_name(run, "capacity")
    log(f"capacity: {region}: {cfg.engines} engines, load from {name}")
    count, last = 0, -1
    with EventProducer.connect(ctx.settings) as producer:
        while not ctx.stopper.stopped:
            now = time.time()
            try:
                reading = src.read(now, guard)
            except CapacityError as exc:  # lend nothing while the load cannot be read
                log(f"capacity: {exc}; lending nothing")
                reading = Reading(busy=float(cfg.engines))
            lent, why = guard.decide(reading.busy, reading.p99_ms, now)
            rec = capacity_record(run, region, cfg, name, reading, lent, why)
            producer.produce(topic, "capacity", rec, topics.record_key("capacity", rec))
            producer.flush()
            if lent != last:
                guarded = f"; {why}" if why else ""
                log(
                    f"capacity: {region} lends {lent}/{cfg.engines} (busy {reading.busy:.1f}{guarded})"
                )
                last = lent
            count += 1
            ctx.stopper.wait(cfg.interval_s)
    return count

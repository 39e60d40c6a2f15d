"""Prometheus metrics for the roles: a tiny registry and an HTTP exporter, standard library only.

Counters, gauges and histograms with labels, rendered in the Prometheus text exposition format
(version 0.0.4) at ``GET /metrics``. Every role process may export; roles in any layer import
this module (it lives in ``consumers`` for that reason and imports nothing of ours).

Rules:
- names and label names follow Prometheus' grammar, checked when a metric is created;
- a name is registered once per registry: asking again with the same kind and label names
  returns the same metric (a role may rebuild its loop in-process), anything else is an error;
- counters only go up; histogram buckets are cumulative, with ``+Inf``, ``_sum`` and ``_count``;
- every update takes the metric's lock, so roles may update from any thread;
- the exporter is off unless a port is given: the ``port`` argument, else ``RLSTREAM_METRICS_PORT``
  (0 or unset = off). It listens on ``RLSTREAM_METRICS_HOST`` (default 127.0.0.1: widen it on
  purpose, e.g. to 0.0.0.0 for a Prometheus on another host). One exporter per process; a busy
  port is logged and leaves the exporter off rather than failing the role it observes.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PORT_ENV, HOST_ENV = "RLSTREAM_METRICS_PORT", "RLSTREAM_METRICS_HOST"
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: integers plainly, ``+Inf``/``-Inf``/``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape_label(value: str) -> str:
    """A label value escaped for the text format: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{n}="{escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


class Metric:
    """One metric family: a name, a help text, label names and one child per label values."""

    kind = "untyped"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}")
        bad = [n for n in labelnames if not _LABEL.fullmatch(n) or n.startswith("__") or n == "le"]
        if bad:
            raise ValueError(f"invalid label name(s) {bad} for {name}")
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], list[float]] = {}
        if not self.labelnames:
            self._children[()] = self._zero()  # an unlabelled metric shows 0 before any update

    def _child(self, values: tuple[str, ...]) -> list[float]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children.setdefault(values, self._zero())
        return child

    def _zero(self) -> list[float]:
        return [0.0]

    def _values(self, labels: Mapping[str, str] | None, args: Sequence[str]) -> tuple[str, ...]:
        if labels:
            return tuple(str(labels[n]) for n in self.labelnames)
        return tuple(str(a) for a in args)

    def samples(self) -> Iterator[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._children.items())
        for values, data in items:
            yield f"{self.name}{_labels(self.labelnames, values)} {format_value(data[0])}"

    def render(self) -> str:
        doc = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        lines = [f"# HELP {self.name} {doc}", f"# TYPE {self.name} {self.kind}", *self.samples()]
        return "\n".join(lines) + "\n"


class Counter(Metric):
    """A value that only goes up (restarts from 0 with the process)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, *labels: str, **by_name: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only go up, got {amount}")
        with self._lock:
            self._child(self._values(by_name, labels))[0] += amount

    def value(self, *labels: str, **by_name: str) -> float:
        with self._lock:
            return self._child(self._values(by_name, labels))[0]


class Gauge(Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, *labels: str, **by_name: str) -> None:
        with self._lock:
            self._child(self._values(by_name, labels))[0] = float(value)

    def inc(self, amount: float = 1.0, *labels: str, **by_name: str) -> None:
        with self._lock:
            self._child(self._values(by_name, labels))[0] += amount

    def value(self, *labels: str, **by_name: str) -> float:
        with self._lock:
            return self._child(self._values(by_name, labels))[0]


class Histogram(Metric):
    """Observations counted in cumulative buckets ``le``, with their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds or len(set(bounds)) != len(bounds):
            raise ValueError(f"histogram {name} needs distinct finite buckets, got {buckets}")
        self.buckets = tuple(bounds)

    def _zero(self) -> list[float]:
        # per-bucket (non-cumulative) counts, then +Inf, then sum
        return [0.0] * (len(self.buckets) + 2)

    def observe(self, value: float, *labels: str, **by_name: str) -> None:
        with self._lock:
            child = self._child(self._values(by_name, labels))
            child[bisect.bisect_left(self.buckets, value)] += 1
            child[-1] += value

    def samples(self) -> Iterator[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._children.items())
        for values, data in items:
            running = 0.0
            for bound, n in zip([*self.buckets, math.inf], data[:-1], strict=True):
                running += n
                le = f'le="{format_value(bound)}"'
                yield f"{self.name}_bucket{_labels(self.labelnames, values, le)} {format_value(running)}"
            yield f"{self.name}_sum{_labels(self.labelnames, values)} {format_value(data[-1])}"
            yield f"{self.name}_count{_labels(self.labelnames, values)} {format_value(running)}"


class Registry:
    """Metrics by name, rendered together (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, Metric] = {}

    def _get(
        self,
        cls: type[Metric],
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        **kw: object,
    ) -> Metric:
        with self._lock:
            have = self._metrics.get(name)
            if have is not None:
                if type(have) is not cls or have.labelnames != tuple(labelnames):
                    raise ValueError(
                        f"metric {name} already registered as {have.kind}{have.labelnames}"
                    )
                return have
            metric = cls(name, documentation, labelnames, **kw)
            self._metrics[name] = metric
            return metric

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._get(Counter, name, documentation, labelnames)  # type: ignore[return-value]

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, documentation, labelnames)  # type: ignore[return-value]

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        return self._get(Histogram, name, documentation, labelnames, buckets=buckets)  # type: ignore[return-value]

    def exposition(self) -> str:
        """Every metric in the text exposition format."""
        with self._lock:
            metrics = sorted(self._metrics.values(), key=lambda m: m.name)
        return "".join(m.render() for m in metrics)


REGISTRY = Registry()
"""The process-wide registry that roles and the exporter share."""


class MetricsExporter:
    """``GET /metrics`` for ``registry`` on ``host:port`` (0: a free port), in a daemon thread."""

    def __init__(
        self, registry: Registry = REGISTRY, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        handler = type("Handler", (_Handler,), {"registry": registry})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.host, self.port = host, int(self.server.server_address[1])
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    registry: Registry

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404, "metrics are at /metrics")
            return
        body = self.registry.exposition().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds must not flood the role's log


_exporter: MetricsExporter | None = None
_exporter_lock = threading.Lock()


def metrics_port(port: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """The port to export on: ``port`` if given, else ``RLSTREAM_METRICS_PORT``; 0 means off."""
    if port is not None:
        return port
    raw = (env if env is not None else os.environ).get(PORT_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{PORT_ENV} must be a port number, got {raw!r}") from exc
    if not 0 <= value < 65536:
        raise ValueError(f"{PORT_ENV} must be in 0..65535, got {value}")
    return value


def start_exporter(
    port: int | None = None, registry: Registry = REGISTRY, host: str | None = None
) -> MetricsExporter | None:
    """Start this process's exporter once (see the module docstring); None when off."""
    global _exporter
    chosen = metrics_port(port)
    if chosen == 0:
        return None
    with _exporter_lock:
        if _exporter is None:
            bind = host or os.environ.get(HOST_ENV, "127.0.0.1")
            try:
                _exporter = MetricsExporter(registry, bind, chosen)
            except OSError as exc:
                log.warning("metrics exporter not started on %s:%s: %s", bind, chosen, exc)
                return None
            log.info("metrics at %s", _exporter.url)
        return _exporter


class StatsLike(Protocol):
    batches: int
    records: int
    outputs: int
    dead_letters: int
    aborts: int
    last_batch_s: float
    extra: dict[str, float]


class LoopMetrics:
    """A transactional loop's ``LoopStats`` as Prometheus series, labelled by consumer group.

    ``observe(stats)`` turns the growth of the stats since the last call into counter increments,
    so the loop keeps its own plain counters and this stays a one-line hook.
    """

    def __init__(self, group: str, registry: Registry = REGISTRY) -> None:
        self.group = group
        c = lambda n, d: registry.counter(f"rlstream_loop_{n}_total", d, ("group",))  # noqa: E731
        self.counters = {
            "batches": c("batches", "Transactions committed by the loop."),
            "records": c("records", "Input records consumed in committed transactions."),
            "outputs": c("outputs", "Records produced by the processor."),
            "dead_letters": c("dead_letters", "Records sent to the dead-letter stream."),
            "aborts": c("aborts", "Transactions aborted (the batch is re-read)."),
        }
        self.batch_seconds = registry.histogram(
            "rlstream_loop_batch_seconds",
            "Wall time of one committed batch transaction.",
            ("group",),
        )
        self.extra = registry.gauge(
            "rlstream_loop_stat", "Role-specific loop statistics.", ("group", "name")
        )
        self._seen = dict.fromkeys(self.counters, 0)

    @classmethod
    def for_loop(cls, group: str, port: int | None = None) -> LoopMetrics:
        """Metrics for the loop of ``group``, starting the process's exporter if configured."""
        start_exporter(port)
        return cls(group)

    def observe(self, stats: StatsLike) -> None:
        """Publish what ``stats`` gained since the last call."""
        new_batches = stats.batches - self._seen["batches"]
        for name, counter in self.counters.items():
            now = int(getattr(stats, name))
            if now > self._seen[name]:
                counter.inc(now - self._seen[name], self.group)
            self._seen[name] = now
        if new_batches > 0:
            # only the newest batch's time is known; the loop calls this after every batch
            self.batch_seconds.observe(stats.last_batch_s, self.group)
        for name, value in stats.extra.items():
            self.extra.set(value, self.group, name)

"""Prometheus metrics of every rlstream process, on prometheus_client: the one registry module.

The roles' loops (``LoopMetrics``) and the HTTP services (feedback-ingest's ``/metrics``) declare
their metrics here; prometheus_client keeps the values and writes the text exposition format.
It lives in ``producers`` so that every layer above may import it (it imports nothing of ours).

Rules:
- a ``Registry`` declares a name once: asking again with the same kind and label names returns
  the same metric (a role may rebuild its loop in-process), anything else is a ValueError;
- names and label names follow the classic Prometheus grammar (prometheus_client's own
  expressions; it would also take UTF-8 names, which older servers cannot scrape);
- ``REGISTRY`` is the process-wide registry (prometheus_client's default, which already carries
  the process, platform and garbage-collector metrics); a service that serves its own
  ``/metrics`` takes a fresh ``Registry(process=True)``;
- refused weight manifests are one counter, ``rlstream_weights_refused_total{model, reason}``
  (``weight_refusals``; reason: the refusal's kind, e.g. ``signature``, ``epoch``,
  ``ManifestInvalid``, ``MemoryError``), written by the manifest log and the weight subscriber;
- every bounded in-memory buffer of a role reports its size and its bound as
  ``rlstream_buffer_items{buffer}`` and ``rlstream_buffer_bound{buffer}`` (``track_buffer``),
  so a buffer near its bound shows before it refuses or evicts anything;
- the exporter is off unless a port is given: the ``port`` argument, else ``RLSTREAM_METRICS_PORT``
  (0 or unset = off). It listens on ``RLSTREAM_METRICS_HOST`` (default 127.0.0.1: widen it on
  purpose, e.g. to 0.0.0.0 for a Prometheus on another host) and answers ``/metrics`` (and
  ``/``) only, 404 elsewhere. One exporter per process; a busy port is logged and leaves the
  exporter off rather than failing the role it observes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any, Protocol, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.validation import METRIC_LABEL_NAME_RE, METRIC_NAME_RE

log = logging.getLogger(__name__)

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
"""What ``Registry.exposition`` writes (and the exporter serves to a scrape without Accept)."""
PORT_ENV, HOST_ENV = "RLSTREAM_METRICS_PORT", "RLSTREAM_METRICS_HOST"
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
M = TypeVar("M", Counter, Gauge, Histogram)


class Registry:
    """A prometheus_client registry whose metrics are declared once by name (see the rules)."""

    def __init__(self, collectors: CollectorRegistry | None = None, process: bool = False) -> None:
        if collectors is None:
            collectors = CollectorRegistry()
            if process:
                ProcessCollector(registry=collectors)
                PlatformCollector(registry=collectors)
                GCCollector(registry=collectors)
        self.collectors = collectors
        self._lock = threading.Lock()
        self._declared: dict[str, tuple[Any, tuple[str, ...]]] = {}
        # (metric name, label values) -> its child, for callers on a hot path (``child``)
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def _get(
        self, kind: type[M], name: str, documentation: str, labelnames: Sequence[str], **kw: Any
    ) -> M:
        labels = tuple(labelnames)
        if not METRIC_NAME_RE.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}")
        bad = [n for n in labels if not METRIC_LABEL_NAME_RE.fullmatch(n)]
        if bad:
            raise ValueError(f"invalid label name(s) {bad} for {name}")
        with self._lock:
            have = self._declared.get(name)
            if have is not None:
                metric, have_labels = have
                if type(metric) is not kind or have_labels != labels:
                    raise ValueError(
                        f"metric {name} already registered as {type(metric).__name__}{have_labels}"
                    )
                return metric
            metric = kind(name, documentation, labels, registry=self.collectors, **kw)
            self._declared[name] = (metric, labels)
            return metric

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._get(Counter, name, documentation, labelnames)

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, documentation, labelnames)

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        return self._get(Histogram, name, documentation, labelnames, buckets=tuple(buckets))

    def child(self, metric: M, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: a hot path (one call per record) skips
        prometheus_client's label validation and lock after the first call."""
        key = (metric._name, values)
        found = self._children.get(key)
        if found is None:
            found = self._children.setdefault(key, metric.labels(*values))
        return found

    def exposition(self) -> str:
        """Every metric of the registry in the text exposition format (``CONTENT_TYPE``)."""
        return prometheus_client.generate_latest(self.collectors).decode()


REGISTRY = Registry(prometheus_client.REGISTRY)
"""The process-wide registry that roles and the exporter share."""


# --- the exporter ----------------------------------------------------------------------------

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _metrics_only(app: WSGIApp) -> WSGIApp:
    """prometheus_client's app answers every path; ours answers /metrics and / only."""

    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"metrics are at /metrics\n"]
        return app(environ, start_response)

    return routed


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds must not flood the role's log


class MetricsExporter:
    """``GET /metrics`` for ``registry`` on ``host:port`` (0: a free port), in a daemon thread."""

    def __init__(
        self, registry: Registry = REGISTRY, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        app = _metrics_only(prometheus_client.make_wsgi_app(registry.collectors))
        self.server = make_server(host, port, app, _Server, _QuietHandler)
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


# --- the transactional loop's hook -----------------------------------------------------------


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
                counter.labels(self.group).inc(now - self._seen[name])
            self._seen[name] = now
        if new_batches > 0:
            # only the newest batch's time is known; the loop calls this after every batch
            self.batch_seconds.labels(self.group).observe(stats.last_batch_s)
        for name, value in stats.extra.items():
            self.extra.labels(self.group, name).set(value)


# --- refusals and buffers --------------------------------------------------------------------


def weight_refusals(registry: Registry = REGISTRY) -> Counter:
    """``rlstream_weights_refused_total{model, reason}``: weight manifests refused."""
    return registry.counter(
        "rlstream_weights_refused_total",
        "Weight manifests refused (not authentic, a non-cryptographic hash in a signed run, "
        "another run's, stale or jumping epoch, implausible or replayed version, out of "
        "bounds, corrupt, out of memory); the old weights keep serving.",
        ("model", "reason"),
    )


def freshness_lag(registry: Registry = REGISTRY) -> Gauge:
    """``rlstream_weights_freshness_lag_versions{model}``: versions between the newest verified
    weight manifest a reader knows and the version it serves."""
    return registry.gauge(
        "rlstream_weights_freshness_lag_versions",
        "Versions the newest verified weight manifest is ahead of the one served (a region "
        "held back by a link, a mirror or refused versions).",
        ("model",),
    )


def track_buffer(name: str, size: int, bound: int, registry: Registry = REGISTRY) -> None:
    """Report a buffer's current ``size`` and its ``bound`` (items) under ``name``.

    Cheap enough to call per record (feedback-ingest does): after the first call for a name,
    two dict lookups and two sets."""
    items = registry._children.get(("rlstream_buffer_items", (name,)))
    bounds = registry._children.get(("rlstream_buffer_bound", (name,)))
    if items is None or bounds is None:
        items = registry.child(
            registry.gauge(
                "rlstream_buffer_items", "Items held by a bounded in-memory buffer.", ("buffer",)
            ),
            name,
        )
        bounds = registry.child(
            registry.gauge(
                "rlstream_buffer_bound",
                "The most items a bounded in-memory buffer holds.",
                ("buffer",),
            ),
            name,
        )
    items.set(size)
    bounds.set(bound)

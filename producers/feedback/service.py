"""feedback-ingest: the HTTP service that turns editor feedback into records of rl.RUN.feedback.

``rlstream serve feedback --run RUN`` runs it: ``POST /v1/feedback``, ``GET /healthz``,
``GET /metrics`` and ``GET /openapi.json`` (generated from the pydantic models).

Rules a maintainer must keep:
- 202 means stored: the answer waits for the broker's acknowledgement (idempotent, acks=all);
- a retried request is stored once (feedback ids per client, within the idempotency window);
- when Kafka cannot take the write the answer is 503 with ``Retry-After``;
- refusals happen before Kafka, in a fixed order, and say why; every 401 carries the same
  message;
- large bodies are parsed in a worker thread, never on the event loop;
- no request can crash the service.

Details: docs/feedback.md (feedback-ingest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

from aiohttp import web
from pydantic import BaseModel

from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback.auth import UNAUTHORIZED, Caller, Target, check_body, identify
from rlstream.producers.feedback.dedupe import Dedupe, IdempotencyLRU, dedupe_key, record_headers
from rlstream.producers.feedback.limits import ParseSlots, RateLimiter
from rlstream.producers.feedback.models import (
    FEEDBACK_PATH,
    IDEMPOTENCY_HEADER,
    AcceptedResponse,
    ErrorDetail,
    ErrorResponse,
    EventResult,
    FeedbackEvent,
    FeedbackServiceConfig,
    RequestError,
    parse_body,
    to_record,
)
from rlstream.producers.feedback.openapi import openapi_document
from rlstream.producers.feedback.sink import Delivery, KafkaSink, Sink, Unavailable
from rlstream.producers.runtime import aio
from rlstream.producers.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rlstream.producers.runtime.metrics import Registry
from rlstream.schemas import events, topics

log = logging.getLogger(__name__)

#: Bodies up to this size are parsed, validated and encoded on the event loop (a few hundred
#: microseconds); larger ones in a worker thread, so that no request stalls the loop.
INLINE_PARSE_BYTES = 16 * 1024
JSON = "application/json"


# --- metrics --------------------------------------------------------------------------------


class Metrics:
    """The service's Prometheus metrics, in its own registry with the process's own metrics."""

    BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    PATHS = frozenset({FEEDBACK_PATH, "/healthz", "/metrics", "/openapi.json"})
    OUTCOMES = ("stored", "duplicate", "failed")

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry = registry or Registry(process=True)
        self.requests = self.registry.counter(
            "rlstream_feedback_requests_total",
            "HTTP requests answered, by path and status.",
            ("path", "status"),
        )
        self.events = self.registry.counter(
            "rlstream_feedback_events_total",
            "Feedback events by outcome (stored, duplicate, failed).",
            ("outcome",),
        )
        for outcome in self.OUTCOMES:
            registry.child(self.events, outcome)  # every outcome shows at 0 before any event
        self.refusals = self.registry.counter(
            "rlstream_feedback_auth_refused_total",
            "Requests refused with 401, by the reason only the service sees.",
            ("reason",),
        )
        self.latency = self.registry.histogram(
            "rlstream_feedback_request_seconds",
            f"Latency of POST {FEEDBACK_PATH}, receipt to answer.",
            buckets=self.BUCKETS,
        )

    def observe(self, method: str, path: str, status: int, seconds: float) -> None:
        """Count one answered request; POST /v1/feedback latencies go to the histogram."""
        label = path if path in self.PATHS else "other"  # bounded label values
        self.registry.child(self.requests, label, str(status)).inc()
        if label == FEEDBACK_PATH and method == "POST":
            self.latency.observe(seconds)

    def count_refusal(self, reason: str) -> None:
        """Count one refused authentication by its reason (a small fixed set of strings)."""
        self.registry.child(self.refusals, reason).inc()

    def count_events(self, outcomes: Mapping[Any, int]) -> None:
        """Count the events of one request by outcome."""
        for outcome, n in outcomes.items():
            self.registry.child(self.events, str(outcome)).inc(n)

    def render(self) -> str:
        return self.registry.exposition()


# --- the service ----------------------------------------------------------------------------


def _answer(status: int, body: BaseModel, headers: Mapping[str, str] | None = None) -> web.Response:
    """``body`` as JSON, written by pydantic-core straight to bytes (no dict, no json.dumps)."""
    payload = body.__pydantic_serializer__.to_json(body)
    return web.Response(
        body=payload, status=status, headers=headers, content_type=JSON, charset="utf-8"
    )


def _error(status: int, error: str, message: str, **extra: Any) -> web.Response:
    headers = extra.pop("headers", None)
    return _answer(status, ErrorResponse(error=error, message=message, **extra), headers)


class FeedbackService:
    """The feedback-ingest HTTP application (see the module docstring for its guarantees)."""

    def __init__(
        self,
        cfg: FeedbackServiceConfig,
        sink: Sink,
        environ: Mapping[str, str] | None = None,
        dedupe: Dedupe | None = None,
    ) -> None:
        self.cfg, self.sink = cfg, sink
        self.topic = topics.topic_name(cfg.run, "feedback")
        self.max_value_bytes = topics.STREAMS["feedback"].max_value_bytes
        self.tokens = cfg.accepted_tokens(environ)
        self.keys = {k: v.get_secret_value().encode() for k, v in cfg.hmac_keys.items()}
        if not self.tokens and not self.keys:
            raise ValueError(
                "no credentials configured: give tokens, hmac_keys or $RLSTREAM_FEEDBACK_TOKENS"
            )
        self.salt, stable = cfg.salt(environ)
        if not stable:
            log.warning("no user id salt configured: user hashes will differ across restarts")
        self.acked: Dedupe = (
            dedupe
            if dedupe is not None  # (an empty one is falsy: it has a length)
            else IdempotencyLRU(cfg.idempotency_window_s, cfg.idempotency_max_ids)
        )
        self._parsing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="feedback-parse")
        self.parse_slots = ParseSlots(cfg.max_parse_queue)
        self.rates = RateLimiter(cfg.rate_per_client_s, cfg.rate_burst)
        self.inflight: dict[str, asyncio.Future[Delivery]] = {}
        # to_record builds each record from a validated FeedbackEvent (tests/unit/
        # test_feedback_models.py checks those records against the schema): not walked again
        self.serialize = events.serializer("feedback", validate=False)
        self.metrics = Metrics()
        self.openapi = openapi_document()
        self.kafka = "unknown"  # until the first write: ok or unavailable
        self._runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        # client_max_size makes aiohttp refuse a longer body while reading it (413).
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._observe])
        app.router.add_post(FEEDBACK_PATH, self._post_feedback)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/openapi.json", self._openapi)
        return app

    @web.middleware
    async def _observe(
        self, request: web.Request, handler: Callable[..., Any]
    ) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            if request.path == FEEDBACK_PATH and self._connections() > self.cfg.max_connections:
                why = f"more than {self.cfg.max_connections} open connections; retry"
                retry = {"Retry-After": str(self.cfg.retry_after_s), "Connection": "close"}
                response = _error(429, "too_many_connections", why, headers=retry)
            else:
                response = await handler(request)
        except web.HTTPException as exc:  # routing (404, 405) and aiohttp's own refusals
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            response = _error(
                exc.status, exc.reason.lower().replace(" ", "_"), exc.reason, headers=headers
            )
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            response = _error(500, "internal", "unexpected error; the event was not stored")
        self.metrics.observe(
            request.method, request.path, response.status, time.perf_counter() - started
        )
        return response

    def _connections(self) -> int:
        """Open connections (those of the server ``start`` runs; 0 under another runner)."""
        server = self._runner.server if self._runner is not None else None
        return len(server.connections) if server is not None else 0

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(
                413, ErrorResponse(error="too_large", message=f"body over {limit} bytes")
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(
                413, ErrorResponse(error="too_large", message=f"body over {limit} bytes")
            ) from None

    async def _post_feedback(self, request: web.Request) -> web.Response:
        try:
            principal, records = await self._accept(request)
        except RequestError as exc:
            headers = {"WWW-Authenticate": 'Bearer realm="rlstream"'} if exc.status == 401 else None
            return _answer(exc.status, exc.body, headers or exc.headers)
        results = await self._store(principal, records)
        return self._stored_answer(results)

    async def _accept(self, request: web.Request) -> tuple[str, list[tuple[str, bytes, bytes]]]:
        """Identify the caller from the headers, read, authenticate, then parse, validate and
        encode (a large body off the event loop): the caller's principal and (feedback id,
        key, value) per event. The refusals before the body: 401, 415, 413, 429, 503."""
        headers, skew = request.headers, self.cfg.hmac_skew_s
        target = Target(request.method, request.path, self.cfg.run)
        caller = identify(headers, target, self.tokens, self.keys, time.time(), skew)
        if isinstance(caller, str):
            self._refuse(caller)
        if request.content_type != JSON:
            why = f"Content-Type must be application/json, got {request.content_type!r}"
            raise RequestError(415, ErrorResponse(error="unsupported_media_type", message=why))
        self._bound_unproven(caller, request.content_length)
        if caller.proven:
            self._charge(caller.principal)
        off_loop = request.content_length is None or request.content_length > INLINE_PARSE_BYTES
        if off_loop and not self.parse_slots.reserve():
            why = f"{self.cfg.max_parse_queue} bodies are waiting to be parsed; retry"
            retry = {"Retry-After": str(self.cfg.retry_after_s)}
            raise RequestError(503, ErrorResponse(error="busy", message=why), retry)
        try:
            body = await self._read_body(request)
            self._authorize(check_body(caller, headers, target, body, self.keys, time.time(), skew))
            if not caller.proven:
                self._charge(caller.principal)
            key = headers.get(IDEMPOTENCY_HEADER)
            if len(body) <= INLINE_PARSE_BYTES:
                return caller.principal, self._decode(body, key)
            loop = asyncio.get_running_loop()
            return caller.principal, await loop.run_in_executor(
                self._parsing, self._decode, body, key
            )
        finally:
            if off_loop:
                self.parse_slots.release()

    def _bound_unproven(self, caller: Caller, declared: int | None) -> None:
        """A signature over the body itself is checked only after reading it: such a body is
        read only when it declares a length within ``max_unhashed_body_bytes`` (413)."""
        limit = self.cfg.max_unhashed_body_bytes
        if not caller.proven and (declared is None or declared > limit):
            why = (
                f"a body signed without its digest is read up to {limit} bytes with a declared "
                "Content-Length: sign X-Rlstream-Content-SHA256 for a larger one"
            )
            raise RequestError(413, ErrorResponse(error="too_large", message=why))

    def _charge(self, principal: str) -> None:
        """One request on ``principal``'s rate (429 with Retry-After when over it)."""
        wait = self.rates.take(principal)
        if wait is not None:
            why = f"over {self.cfg.rate_per_client_s:g} requests per second for this client"
            body = ErrorResponse(error="rate_limited", message=why)
            raise RequestError(429, body, {"Retry-After": str(wait)})

    def _authorize(self, why: str | None) -> None:
        if why is not None:
            self._refuse(why)

    def _refuse(self, why: str) -> NoReturn:
        """Refuse with the one 401 answer; the reason only goes to the log and the metrics."""
        log.info("feedback request refused: %s", why)
        self.metrics.count_refusal(why)
        raise RequestError(401, ErrorResponse(error="unauthorized", message=UNAUTHORIZED))

    def _decode(self, body: bytes, idempotency_key: str | None) -> list[tuple[str, bytes, bytes]]:
        """JSON, validation and Avro encoding of an authenticated body (a large one in a worker
        thread)."""
        parsed, batch = parse_body(body, idempotency_key, self.cfg.max_batch, self.cfg.max_tokens)
        received_ms = int(time.time() * 1000)
        prefix = "events." if batch else ""
        return [
            self._encode(e, received_ms, f"{prefix}{i}" if prefix else "")
            for i, e in enumerate(parsed)
        ]

    def _encode(
        self, event: FeedbackEvent, received_ms: int, where: str
    ) -> tuple[str, bytes, bytes]:
        try:
            record = to_record(event, self.cfg.run, received_ms, self.salt)
            value = self.serialize(record, None)
        except events.EventError as exc:  # validated models should never get here
            detail = ErrorDetail(field=where, message=str(exc)[:300])
            raise RequestError(422, ErrorResponse(error="validation", details=[detail])) from None
        if len(value) > self.max_value_bytes:
            why = f"encoded record of {len(value)} bytes exceeds {self.max_value_bytes}"
            detail = ErrorDetail(field=where, message=why)
            raise RequestError(413, ErrorResponse(error="too_large", message=why, details=[detail]))
        return record["feedback_id"], topics.record_key("feedback", record), value

    async def _store(
        self, principal: str, items: list[tuple[str, bytes, bytes]]
    ) -> list[EventResult]:
        """Write the events not stored yet; wait for every delivery report (see guarantees).
        Ids are deduplicated in the caller's namespace (``dedupe.dedupe_key``)."""
        schema = await self.sink.ready()
        if not schema.ok:
            self.kafka = "unavailable"
            return [EventResult(feedback_id=fid, status="failed") for fid, _, _ in items]
        waits: list[tuple[str, asyncio.Future[Delivery] | None, bool]] = []
        for fid, key, value in items:
            seen = dedupe_key(principal, fid)
            if seen in self.acked:
                waits.append((fid, None, True))
            elif seen in self.inflight:  # a concurrent retry, or a repeat in this batch
                waits.append((fid, self.inflight[seen], True))
            else:
                waits.append(
                    (fid, self._submit(seen, record_headers(principal, fid), key, value), False)
                )
        # shielded: a client that goes away must not cancel the wait for the broker's answer
        pending = [f for _, f, _ in waits if f is not None]
        if len(pending) == 1:
            await asyncio.shield(pending[0])
        elif pending:
            await asyncio.gather(*map(asyncio.shield, pending))
        return [self._result(fid, future, dup) for fid, future, dup in waits]

    def _submit(
        self, seen: str, headers: list[tuple[str, bytes]], key: bytes, value: bytes
    ) -> asyncio.Future[Delivery] | None:
        try:
            future = self.sink.submit(self.topic, key, value, headers)
        except Unavailable as exc:
            log.warning("kafka refused a record: %s", exc)
            return None
        self.inflight[seen] = future
        future.add_done_callback(lambda f: self._delivered(seen, f))
        return future

    def _delivered(self, fid: str, future: asyncio.Future[Delivery]) -> None:
        # Runs whatever happens to the request (even if the client went away): an acknowledged
        # id is remembered, so a retry is answered duplicate.
        if self.inflight.get(fid) is future:
            del self.inflight[fid]
        if not future.cancelled() and future.result().ok:
            self.acked.add(fid)
            self.kafka = "ok"
        else:
            self.kafka = "unavailable"

    def _result(self, fid: str, future: asyncio.Future[Delivery] | None, dup: bool) -> EventResult:
        if future is None:
            return EventResult(feedback_id=fid, status="duplicate" if dup else "failed")
        delivery = future.result()
        if not delivery.ok:
            return EventResult(feedback_id=fid, status="failed")
        if dup:
            return EventResult(feedback_id=fid, status="duplicate")
        return EventResult(
            feedback_id=fid, status="stored", partition=delivery.partition, offset=delivery.offset
        )

    def _stored_answer(self, results: list[EventResult]) -> web.Response:
        counts = dict.fromkeys(Metrics.OUTCOMES, 0)
        for r in results:
            counts[r.status] += 1
        self.metrics.count_events({outcome: n for outcome, n in counts.items() if n})
        if counts["failed"]:
            retry = str(self.cfg.retry_after_s)
            message = f"Kafka did not acknowledge {counts['failed']} event(s); retry"
            done = [r for r in results if r.status != "failed"]
            return _error(503, "unavailable", message, results=done, headers={"Retry-After": retry})
        body = AcceptedResponse(
            accepted=counts["stored"],
            duplicates=counts["duplicate"],
            duplicate=counts["stored"] == 0,
            results=results,
        )
        return _answer(202 if counts["stored"] else 200, body)

    async def _healthz(self, request: web.Request) -> web.Response:
        # Liveness is 200 whatever Kafka does: writes answer 503 on their own while it is away.
        body = {"status": "ok", "run": self.cfg.run, "topic": self.topic, "kafka": self.kafka}
        return web.json_response(body)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.render().encode()
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi)

    async def start(self) -> str:
        """Listen on the configured host and port (HTTPS when a certificate is configured);
        returns the base URL (with the real port if the configured one is 0)."""
        tls = _tls_context(self.cfg)
        self._runner = web.AppRunner(self.application(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, ssl_context=tls)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        return f"{'https' if tls else 'http'}://{host}:{port}"

    async def stop(self) -> None:
        """Stop listening, then flush what Kafka still holds."""
        if self._runner is not None:
            await self._runner.cleanup()
        self._parsing.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self.sink.close)


def _tls_context(cfg: FeedbackServiceConfig) -> ssl.SSLContext | None:
    if cfg.tls_cert_file is None and cfg.tls_key_file is None:
        return None
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    return context


# --- running it -----------------------------------------------------------------------------


async def _serve_until_stopped(service: FeedbackService, on_start: Callable[[str], None]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    on_start(await service.start())
    try:
        await stop.wait()
    finally:
        await service.stop()


def serve(
    cfg: FeedbackServiceConfig,
    settings: KafkaSettings,
    on_start: Callable[[str], None] = print,
    dedupe: Dedupe | None = None,
) -> None:
    """Run the service until SIGTERM/SIGINT; ``on_start`` gets the base URL once listening."""

    async def main() -> None:
        sink = KafkaSink(settings, cfg.message_timeout_ms)
        service = FeedbackService(cfg, sink, dedupe=dedupe)
        await _serve_until_stopped(service, on_start)

    aio.run(main())


@dataclass
class RunningService:
    """A service running in a background thread (tests, benchmarks): its URL and object."""

    url: str
    service: FeedbackService


@contextlib.contextmanager
def running_service(
    cfg: FeedbackServiceConfig,
    settings: KafkaSettings | None = None,
    sink: Sink | None = None,
    environ: Mapping[str, str] | None = None,
    dedupe: Dedupe | None = None,
) -> Iterator[RunningService]:
    """Run the service on its own event loop thread; stopped (and flushed) on exit."""
    if sink is None and settings is None:
        raise ValueError("give settings (Kafka) or a sink")
    started = threading.Event()
    box: list[RunningService] = []
    failure: list[BaseException] = []
    loop = aio.new_event_loop()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            if sink is not None:
                use = sink
            elif settings is not None:
                use = KafkaSink(settings, cfg.message_timeout_ms)
            else:
                raise ValueError("the feedback service needs Kafka settings or a sink")
            service = FeedbackService(cfg, use, environ, dedupe)
            box.append(RunningService(loop.run_until_complete(service.start()), service))
        except BaseException as exc:
            failure.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(service.stop())
        loop.close()

    thread = threading.Thread(target=main, name="feedback-http", daemon=True)
    thread.start()
    started.wait()
    if failure:
        raise failure[0]
    try:
        yield box[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)

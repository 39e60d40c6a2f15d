"""``rlstream dashboard``: a live web page of a run's figures, pushed by server-sent events.

One process: a reader thread folds the run's streams (``ops.observe.run_reader``, no consumer group,
nothing committed) into ``ops.observe.analytics.RunAnalytics``; a second thread measures the
consumer lag of every group ``rlstream.RUN.*`` every ``lag_every_s``; an aiohttp server serves

- ``GET /``: the page (``ops/observe/static/dashboard.html``, with its own small canvas charts; no
  CDN, so it works on a machine without internet),
- ``GET /events``: ``text/event-stream``, one ``snapshot`` event (the JSON of
  ``RunAnalytics.snapshot`` plus a ``status`` block) every ``interval_s``,
- ``GET /api/snapshot``: the same JSON once.

Guarantees: the dashboard only reads (it cannot disturb a run); figures follow the rules of
``ops.observe.analytics``, so they match ``rlstream report``; the analytics are touched under one
lock, so a snapshot is never taken halfway through folding a record; stopping ends every SSE stream
and both threads, and closes the Kafka clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from rlstream.consumers.consumer import Stopper
from rlstream.ops.observe.analytics import RunAnalytics
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.runtime import aio

log = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).parent / "static"
CLOSING = web.AppKey("closing", asyncio.Event)
"""Set when the server stops: every SSE stream returns, so shutdown does not wait for them."""


class Dashboard:
    """The run's figures, kept current by two background threads (see the module docstring)."""

    def __init__(self, settings: KafkaSettings, run: str, lag_every_s: float = 2.0) -> None:
        self.settings, self.run, self.lag_every_s = settings, run, lag_every_s
        self.analytics = RunAnalytics(run=run)
        self.lock = threading.Lock()
        self.stopper = Stopper()
        self.status: dict[str, Any] = {"reader": "starting", "lag": "starting", "records": 0}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target in (self._follow, self._poll_lag):
            thread = threading.Thread(
                target=target, name=f"dashboard{target.__name__}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopper.stop()
        for thread in self._threads:
            thread.join(timeout)

    def snapshot(self) -> dict[str, Any]:
        now_ms = int(time.time() * 1000)
        with self.lock:
            snap = self.analytics.snapshot(now_ms)
            snap["status"] = dict(self.status)
        return snap

    def _take(self, topic: str, record: dict[str, Any], ts_ms: int | None) -> None:
        with self.lock:
            self.analytics.take(topic, record, ts_ms)

    def _undecodable(self, topic: str, reason: str) -> None:
        with self.lock:
            self.analytics.take_undecodable(topic, reason)

    def _follow(self) -> None:
        """Fold the run's records until stopped; on a Kafka error, report it and start over."""
        from rlstream.ops.observe.run_reader import RunReader

        while not self.stopper.stopped:
            reader = None
            try:
                reader = RunReader(self.settings, self.run)
                self.status["reader"] = "following"
                while not self.stopper.stopped:
                    reader.pump(self._take, self._undecodable, max_records=500, timeout=0.5)
                    self.status["records"] = reader.records
                    self.status["topics"] = sorted({t for t, _ in reader.assigned})
            except Exception as exc:  # Kafka down or a bad record: show it, retry
                log.warning("dashboard reader: %s", exc)
                self.status["reader"] = f"error: {exc}"
                # Restarting re-reads from the beginning: start from empty figures, not doubled.
                with self.lock:
                    self.analytics = RunAnalytics(run=self.run)
                self.stopper.wait(2.0)
            finally:
                if reader is not None:
                    reader.close()

    def _poll_lag(self) -> None:
        from rlstream.ops.observe.run_reader import measure_lag
        from rlstream.producers.client.admin import admin_client

        admin = admin_client(self.settings)
        while not self.stopper.stopped:
            try:
                lags = measure_lag(admin, self.run)
                with self.lock:
                    self.analytics.set_lag(lags)
                self.status["lag"] = f"{len(lags)} group(s)"
            except Exception as exc:
                log.warning("dashboard lag: %s", exc)
                self.status["lag"] = f"error: {exc}"
            self.stopper.wait(self.lag_every_s)


def make_app(snapshot: Callable[[], dict[str, Any]], interval_s: float = 1.0) -> web.Application:
    """The web app over any ``snapshot`` function (so it is testable without Kafka)."""
    app = web.Application()
    app[CLOSING] = asyncio.Event()

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "dashboard.html")

    async def api_snapshot(request: web.Request) -> web.Response:
        return web.json_response(snapshot(), dumps=_dumps)

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # a reverse proxy must not hold events back
            }
        )
        await resp.prepare(request)
        await resp.write(b"retry: 2000\n\n")
        closing, seq = app[CLOSING], 0
        try:
            while not closing.is_set():
                payload = _dumps(snapshot())
                await resp.write(f"id: {seq}\nevent: snapshot\ndata: {payload}\n\n".encode())
                seq += 1
                with contextlib.suppress(TimeoutError):  # the interval passed: push again
                    await asyncio.wait_for(closing.wait(), interval_s)
        except (ConnectionResetError, ConnectionError):
            pass  # the browser went away
        return resp

    app.router.add_get("/", index)
    app.router.add_get("/events", events)
    app.router.add_get("/api/snapshot", api_snapshot)
    app.router.add_static("/static/", STATIC_DIR)
    return app


def _dumps(value: Any) -> str:
    # allow_nan=False: a NaN would make the browser's JSON.parse throw; analytics use None
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Server:
    """An aiohttp server for ``app`` on its own uvloop thread; ``url`` once started."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.loop = aio.new_event_loop()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="dashboard-http", daemon=True
        )

    def start(self) -> str:
        """Bind (port 0 takes a free port), serve in the background, return the page's URL."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(sock), self.loop).result(30)
        port = sock.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/"
        return self.url

    async def _serve(self, sock: socket.socket) -> None:
        self._runner = web.AppRunner(self.app, shutdown_timeout=2.0, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def stop(self) -> None:
        async def close() -> None:
            self.app[CLOSING].set()
            if self._runner is not None:
                await self._runner.cleanup()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.loop.close()


def serve_dashboard(
    settings: KafkaSettings,
    run: str,
    host: str = "127.0.0.1",
    port: int = 0,
    interval_s: float = 1.0,
) -> tuple[Dashboard, Server]:
    """Start the figures' threads and the web server; the caller stops both (server first)."""
    dashboard = Dashboard(settings, run)
    dashboard.start()
    server = Server(make_app(dashboard.snapshot, interval_s), host, port)
    try:
        server.start()
    except BaseException:
        dashboard.stop()
        raise
    return dashboard, server

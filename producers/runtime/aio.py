"""The event loop of rlstream's HTTP services: uvloop, chosen here and nowhere else.

feedback-ingest (``serve feedback``), the policy server (``serve policy``) and the dashboard are
aiohttp applications; they create or run their loop through this module, so all of them run on
uvloop (libuv) instead of the default selector loop. It lives in ``producers`` so that every
layer that serves HTTP may import it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop
from aiohttp import web

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh uvloop event loop (for a service that runs its loop in its own thread)."""
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a fresh uvloop event loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def run_app(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` on ``host:port`` on a fresh uvloop event loop until SIGINT or SIGTERM."""
    web.run_app(app, host=host, port=port, print=None, loop=new_event_loop())

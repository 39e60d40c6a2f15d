"""The HTTP services' event loop: every way ``producers.runtime.aio`` gives one out is a uvloop
loop."""

from __future__ import annotations

import asyncio

import uvloop

from rlstream.producers.runtime import aio


def test_services_run_on_uvloop() -> None:
    async def running_loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert isinstance(aio.run(running_loop()), uvloop.Loop)
    loop = aio.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()

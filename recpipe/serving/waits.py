"""Waiting for an ``asyncio.Event`` at most so long, in a way that a cancellation always ends.

Not ``asyncio.wait_for(event.wait(), seconds)``: before Python 3.12 it returns normally when the event
is set in the same moment as its task is cancelled, swallowing the cancellation, and a loop around it
runs on. The gateway's stop cancels its readiness loop just as the stages go down (which sets that
loop's event), and then waited for it until the supervisor killed the gateway after its grace.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` have passed; whether it is set. A cancellation of the
    caller always propagates."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=seconds)
    finally:
        waiter.cancel()
    return event.is_set()

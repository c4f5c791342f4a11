"""A wait on an event with a timeout ends when its task is cancelled, even if the event is set in the
same moment: the gateway's stop cancels its readiness loop just as its stages go down (which sets the
loop's "connection lost" event); ``asyncio.wait_for`` before Python 3.12 returned normally instead, the
loop ran on, and the supervisor killed the gateway after its grace. Batchers and hops wait the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from recpipe.serving.batcher import wait_while
from recpipe.serving.waits import wait_event


def cancelled_as_set(wait: Callable[[asyncio.Event], Awaitable[object]]) -> bool:
    async def race() -> bool:
        event = asyncio.Event()
        task = asyncio.ensure_future(wait(event))
        await asyncio.sleep(0.01)  # the task is waiting
        event.set()
        task.cancel()
        done, _ = await asyncio.wait((task,), timeout=5)
        return bool(done) and task.cancelled()

    return asyncio.run(race())


def test_wait_event_is_cancelled_even_as_its_event_is_set() -> None:
    assert cancelled_as_set(lambda e: wait_event(e, 60.0))


def test_a_batchers_wait_is_cancelled_even_as_it_is_woken() -> None:
    assert cancelled_as_set(lambda e: wait_while(lambda: True, e, time.monotonic() + 60.0))


@pytest.mark.parametrize("set_it", [True, False])
def test_wait_event_says_whether_the_event_was_set(set_it: bool) -> None:
    async def run() -> tuple[bool, float]:
        event = asyncio.Event()
        if set_it:
            asyncio.get_running_loop().call_later(0.01, event.set)
        start = time.monotonic()
        return await wait_event(event, 0.5), time.monotonic() - start

    was_set, took = asyncio.run(run())
    assert was_set is set_it
    assert took < 0.45 if set_it else took >= 0.49  # set: it returned early; not set: it waited it out

"""A hop's batch calls as the messages of one long-lived bidirectional stream (``<Method>Stream``).

A unary call costs gRPC's Python layer a call object, metadata, a status and a task on each side; a
message on a stream that is already open costs about half the CPU (bare grpc.aio echo of 2 kB, one
at a time, 2-core EPYC: server 280-315 against 117-135 µs, client 175-205 against 130-155 µs per
message; BENCHMARKS.md). The gateway's hops send one batch call per batch of queries, so each hop's
route keeps one ``HopStream`` per stage method and replica:

- ``__call__(request, timeout)`` stamps the batch request with a new ``sequence``, hands it to the
  stream's writer (one write at a time, as gRPC allows) and waits, up to ``timeout``, for the answer
  message with the same sequence; the stage answers each message as soon as it is done, so answers
  may pass each other;
- the stream has no deadline: each entry carries its own (``timeout_us``), which the stage honours;
  a caller whose ``timeout`` passes gets ``TimeoutError`` (DEADLINE_EXCEEDED to the stage client's
  caller), and the stage drops the entry when its own deadline passes; its message is written all the
  same, by the stream's writer task, so a caller's deadline never cancels a write (grpc.aio would
  cancel the whole stream, and the calls of others on it);
- a stream lives ``max_age_s`` at most: then its writing side is closed (it still delivers the answers
  it owes) and the next call opens a new one, so it never outlives a server's ``max_connection_age``
  grace (``recpipe.serving.connection_age``: 30 s + 10 s) with answers owed;
- a stage that stops ends its streams once it has answered what it read (``CoreStage.drain``), and
  the next call opens a new one;
- a stream that breaks (the stage restarted, the connection was closed) fails the calls waiting on it
  with its status; a call sent on a stream that had already answered is sent once more on a new one
  (the stage's work is a read, so a second try is safe), and its failure is the caller's;
- a stage that has no stream method (UNIMPLEMENTED: an older stage) sets ``unsupported``, and the
  route goes back to the batch RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
from grpc import aio

#: what ``read()`` returns once a stream has ended (grpc-stubs lacks it)
_EOF: Any = aio.EOF  # type: ignore[attr-defined]
#: what a stream's read or write raises once the stream has ended or failed
_ENDED = (aio.AioRpcError, aio.UsageError, asyncio.InvalidStateError)
#: seconds a stream takes new calls (see the module doc): well inside the servers' connection age grace
DEFAULT_MAX_AGE_S = 5.0


class StreamBroken(Exception):
    """The stream ended or failed with ``code`` while a call waited on it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Stream:
    """One open stream: its call, what is to be written (``outbox``; None: close the sending side), the
    calls waiting for an answer (by sequence), its writer and reader tasks."""

    def __init__(self, call: Any, opened: float) -> None:
        self.call = call
        self.opened = opened
        self.outbox: deque[Any] = deque()
        self.wake = asyncio.Event()
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.answered = 0
        self.broken: StreamBroken | None = None
        self.tasks: list[asyncio.Task[None]] = []


class HopStream:
    """One stage method's batch calls on a stream over one channel (see the module doc); ``open()``
    starts a new stream call (``stub.<Method>Stream``).

    Each stream's messages are written by a task of its own, never by a caller: grpc.aio cancels the
    whole stream when a write in progress is cancelled, and a caller's own deadline or cancellation
    must not fail the calls of others on the same stream."""

    def __init__(self, name: str, open: Callable[[], Any], max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.name = name
        self._open = open
        self.max_age_s = max_age_s
        self._stream: _Stream | None = None
        self._sequence = itertools.count(1)
        self._retired: set[_Stream] = set()
        #: the stage has no stream method: the caller should use the batch RPC instead
        self.unsupported = False
        #: streams opened and calls sent a second time (for the tests and ``GetInfo``)
        self.opened = 0
        self.resent = 0

    async def __call__(self, request: Any, timeout: float | None) -> Any:
        """The answer message to ``request`` (a ``<Method>BatchRequest``); ``StreamBroken`` if the
        stream failed, ``TimeoutError`` if ``timeout`` passed first."""
        sent = time.monotonic()
        stream = self._current()
        try:
            return await self._send(stream, request, timeout)
        except StreamBroken as e:
            if not stream.answered or e.code == grpc.StatusCode.UNIMPLEMENTED:
                raise
        # the stream had worked and broke (a restart, a closed connection): once more on a new one, with
        # the time the first try took off each entry's deadline
        waited = time.monotonic() - sent
        if timeout is not None:
            timeout -= waited
            if timeout <= 0:
                raise TimeoutError
        lefts = list(request.timeout_us)
        del request.timeout_us[:]
        request.timeout_us.extend(max(1, t - int(waited * 1e6)) if t > 0 else 0 for t in lefts)
        self.resent += 1
        return await self._send(self._current(), request, timeout)

    async def _send(self, stream: _Stream, request: Any, timeout: float | None) -> Any:
        if stream.broken is not None:
            raise stream.broken
        sequence = next(self._sequence)
        request.sequence = sequence
        answer = asyncio.get_running_loop().create_future()
        stream.waiting[sequence] = answer
        stream.outbox.append(request)
        stream.wake.set()
        try:
            async with asyncio.timeout(timeout):
                return await answer
        finally:
            stream.waiting.pop(sequence, None)
            if not answer.done():
                answer.cancel()

    def _current(self) -> _Stream:
        """The stream new calls go on: the open one, else a new one (the old one, past its age,
        delivers what it owes and ends; a broken one has ended)."""
        stream = self._stream
        now = time.monotonic()
        if stream is not None and stream.broken is None and now - stream.opened < self.max_age_s:
            return stream
        if stream is not None and stream.broken is None:
            stream.outbox.append(None)  # its writer closes the sending side once the rest is written
            stream.wake.set()
            self._retired.add(stream)
        stream = _Stream(self._open(), now)
        loop = asyncio.get_running_loop()
        stream.tasks = [loop.create_task(self._write(stream), name=f"stream-{self.name}-writer"),
                        loop.create_task(self._read(stream), name=f"stream-{self.name}-reader")]
        stream.tasks[1].add_done_callback(lambda _: self._retired.discard(stream))
        self._stream = stream
        self.opened += 1
        return stream

    async def _write(self, stream: _Stream) -> None:
        """Write the stream's messages in order, one at a time (as gRPC allows), until it is retired."""
        try:
            while True:
                while not stream.outbox:
                    if stream.broken is not None:
                        return
                    stream.wake.clear()
                    await stream.wake.wait()
                request = stream.outbox.popleft()
                if request is None:
                    await stream.call.done_writing()
                    return
                await stream.call.write(request)
        except _ENDED as e:
            self._break(stream, _broken(e))

    async def _read(self, stream: _Stream) -> None:
        """Hand each answer to the call waiting for its sequence, until the stream ends."""
        try:
            while True:
                reply = await stream.call.read()
                if reply is _EOF:
                    self._break(stream, StreamBroken(grpc.StatusCode.UNAVAILABLE, "the stage ended the stream"))
                    return
                stream.answered += 1
                waiter = stream.waiting.get(reply.sequence)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)
        except _ENDED as e:
            self._break(stream, _broken(e))

    def _break(self, stream: _Stream, error: StreamBroken) -> None:
        if stream.broken is None:
            stream.broken = error
        if error.code == grpc.StatusCode.UNIMPLEMENTED:
            self.unsupported = True
        for waiter in stream.waiting.values():
            if not waiter.done():
                waiter.set_exception(stream.broken)
                waiter.exception()  # retrieved: its caller may have stopped waiting
        stream.outbox.clear()
        stream.wake.set()
        if self._stream is stream:
            self._stream = None

    async def close(self) -> None:
        for stream in [*self._retired, *([self._stream] if self._stream is not None else [])]:
            stream.call.cancel()
            for task in stream.tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._stream = None
        self._retired.clear()


def _broken(error: BaseException) -> StreamBroken:
    if isinstance(error, aio.AioRpcError):
        return StreamBroken(error.code(), error.details() or "")
    return StreamBroken(grpc.StatusCode.UNAVAILABLE, f"the stream ended ({type(error).__name__})")

"""A one-line progress display (elapsed, sent, achieved rate, running p99), only on a terminal."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import TextIO

from recpipe.querygen.recorder import Recorder


class Progress:
    """Redraws one status line every ``interval`` seconds while a loop runs; silent unless a TTY."""

    def __init__(self, stream: TextIO | None = None, label: str = "", interval: float = 0.5) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.interval = interval
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, rec: Recorder, base: float) -> str:
        elapsed = time.perf_counter() - base
        sent = rec.sent + rec.warmup_queries
        rate = sent / elapsed if elapsed > 0 else 0.0
        p99_ms = rec.running_p99_us() / 1000
        prefix = f"{self.label} " if self.label else ""
        return f"{prefix}{elapsed:6.1f}s  sent {sent:>8d}  {rate:8.1f} q/s  p99 {p99_ms:8.2f} ms"

    def start(self, rec: Recorder, base: float) -> asyncio.Task[None] | None:
        if not self.enabled:
            return None

        async def tick() -> None:
            while True:
                await asyncio.sleep(self.interval)
                self.stream.write("\r" + self.line(rec, base))
                self.stream.flush()

        return asyncio.create_task(tick())

    async def stop(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.stream.write("\n")
        self.stream.flush()

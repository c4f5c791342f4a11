"""Progress on stderr while a run goes: a bar on a terminal, nothing otherwise.

The bar appears only once a run has gone on for ``quiet_s`` seconds (short runs stay silent) and shows
how far the run is (by time or by queries), the queries sent, the achieved rate and the running p99.
The SLO search adds one line per finished step ("step k of at most n, rate, p99, verdict").
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import TextIO

from recpipe.querygen.recorder import Recorder

BAR_WIDTH = 24


def is_terminal(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """Redraws one status line every ``interval`` seconds while a loop runs; silent unless a TTY."""

    def __init__(self, stream: TextIO | None = None, label: str = "", interval: float = 0.5, *,
                 total_s: float | None = None, total_queries: int | None = None, quiet_s: float = 2.0,
                 enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.interval = interval
        self.total_s = total_s
        self.total_queries = total_queries
        self.quiet_s = quiet_s
        self.enabled = is_terminal(self.stream) if enabled is None else enabled
        self.drawn = False

    def fraction(self, rec: Recorder, elapsed: float) -> float | None:
        if self.total_queries:
            return min(1.0, rec.sent / self.total_queries)
        if self.total_s:
            return min(1.0, elapsed / self.total_s)
        return None

    def line(self, rec: Recorder, base: float) -> str:
        elapsed = time.perf_counter() - base
        sent = rec.sent + rec.warmup_queries
        rate = sent / elapsed if elapsed > 0 else 0.0
        p99_ms = rec.running_p99_us() / 1000
        prefix = f"{self.label} " if self.label else ""
        frac = self.fraction(rec, elapsed)
        bar = ""
        if frac is not None:
            filled = round(frac * BAR_WIDTH)
            bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {frac * 100:3.0f}%  "
        return f"{prefix}{bar}{elapsed:6.1f} s  sent {sent:>7d}  {rate:8.1f} q/s  p99 {p99_ms:8.2f} ms"

    def start(self, rec: Recorder, base: float) -> asyncio.Task[None] | None:
        if not self.enabled:
            return None

        async def tick() -> None:
            while True:
                await asyncio.sleep(self.interval)
                if time.perf_counter() - base < self.quiet_s:
                    continue
                self.stream.write("\r" + self.line(rec, base) + "\033[K")
                self.stream.flush()
                self.drawn = True

        return asyncio.create_task(tick())

    async def stop(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()

    def say(self, text: str) -> None:
        """A whole line (e.g. one SLO step's result), on a terminal only."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

"""The load loops with an in-process ``send`` (asyncio sleeps standing in for a server)."""

from __future__ import annotations

import asyncio
import io
import time

from recpipe.querygen import loops
from recpipe.querygen.loops import Outcome
from recpipe.querygen.progress import Progress
from recpipe.querygen.workload import poisson_arrivals


class _Server:
    """Answers after ``delay`` seconds; counts how many queries are in flight at once."""

    def __init__(self, delay: float, fail_every: int = 0) -> None:
        self.delay, self.fail_every = delay, fail_every
        self.in_flight = self.max_in_flight = self.calls = 0

    async def send(self, i: int) -> Outcome:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        if self.fail_every and i % self.fail_every == 0:
            return "UNAVAILABLE", ()
        return "OK", [("rank", int(self.delay * 1e6), int(self.delay * 1e6))]


def test_open_loop_never_waits_for_answers() -> None:
    server = _Server(delay=0.3)
    arrivals = poisson_arrivals(100, 0.5, seed=1).tolist()
    t0 = time.perf_counter()
    rec = loops.run(loops.run_open(server.send, arrivals, warmup=0.0))
    wall = time.perf_counter() - t0
    # 50 queries of 300 ms each: back to back that is 15 s; open loop overlaps them.
    assert server.calls == 50 and wall < 2.0
    assert server.max_in_flight >= 20
    m = rec.finish()
    assert m.ok == 50 and m.end_to_end.percentile_us(50) >= 300_000


def test_open_loop_warmup_and_errors_by_code() -> None:
    server = _Server(delay=0.001, fail_every=5)
    arrivals = poisson_arrivals(200, 1.0, seed=2).tolist()
    rec = loops.run(loops.run_open(server.send, arrivals, warmup=0.5))
    m = rec.finish()
    assert m.warmup_queries + m.queries == 200
    assert 70 <= m.queries <= 130  # about half of them fall after the warm-up
    assert m.errors["UNAVAILABLE"] == sum(1 for i in range(m.warmup_queries, 200) if i % 5 == 0)


def test_closed_loop_keeps_exactly_concurrency_in_flight() -> None:
    server = _Server(delay=0.02)
    rec = loops.run(loops.run_closed(server.send, concurrency=4, warmup=0.0, queries=40))
    m = rec.finish()
    assert m.queries == 40 and server.max_in_flight == 4
    # Latency counts from the real send: a closed loop has no send lag.
    assert m.send_lag.percentile_us(99) < 5_000
    rec = loops.run(loops.run_closed(server.send, concurrency=2, warmup=0.1, duration=0.3))
    m = rec.finish()
    assert m.warmup_queries >= 2 and 10 <= m.queries <= 32


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal() -> None:
    server = _Server(delay=0.005)
    tty, pipe, short = _Tty(), io.StringIO(), _Tty()
    arrivals = poisson_arrivals(100, 0.7, seed=3).tolist()
    loops.run(loops.run_open(server.send, arrivals, 0.0, Progress(tty, "run", interval=0.2, quiet_s=0,
                                                                  total_s=0.7)))
    loops.run(loops.run_open(server.send, arrivals, 0.0, Progress(pipe, "run", interval=0.2, quiet_s=0)))
    # A run shorter than quiet_s (2 s by default) draws nothing, even on a terminal.
    loops.run(loops.run_open(server.send, arrivals, 0.0, Progress(short, "run", interval=0.2)))
    lines = [ln for ln in tty.getvalue().split("\r") if ln.strip()]
    assert len(lines) >= 2 and all("q/s" in ln and "p99" in ln and "sent" in ln for ln in lines)
    assert all("[" in ln and "%" in ln for ln in lines)  # the bar: how far the 0.7 s run is
    assert pipe.getvalue() == "" and short.getvalue() == ""


def test_sleep_until_is_never_early() -> None:
    async def lateness() -> list[float]:
        out = []
        for k in range(20):
            due = time.perf_counter() + 0.0003 * k
            await loops.sleep_until(due)
            out.append(time.perf_counter() - due)
        return out

    assert min(loops.run(lateness())) >= 0

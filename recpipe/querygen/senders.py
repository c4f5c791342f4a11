"""Sender processes: one run's load offered from N processes and merged into one measurement.

A Python sender spends 0.1-0.65 ms of CPU per query (gRPC and asyncio per call), so one process cannot
offer more than a few thousand queries per second, and well before that its timers fire late. With
``--processes N`` the generator sends from N processes (``multiprocessing``, spawn start method: a fresh
interpreter, nothing forked after grpc is imported), each with its own channels:

- open loop: this process computes the one seeded schedule and deals it round-robin, process k taking
  queries k, k + N, k + 2N, ... (``open_share``). Every process starts on one shared instant
  (``perf_counter`` is the system's monotonic clock, the same in every process), so the union of the
  shares is exactly the one-process schedule, each share is a thinned Poisson process spread over the
  whole run, and every latency still counts from its query's scheduled instant.
- closed loop: the clients are divided among the processes (``closed_share``); process k draws queries
  k, k + N, ... of the same query stream, so no query is sent twice.
- sequential: one query at a time, so one process (``QuerygenConfig`` refuses more).

Each sender returns its ``Measurement`` as plain data (``Measurement.to_wire``: HdrHistogram's lossless
encoding), with the CPU seconds it spent; the caller merges them exactly (``recorder.merge``) and keeps
each process's send lag, so a report shows whether every sender kept up. Only plain dicts, lists and
numbers cross the pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import resource
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from recpipe.errors import SenderFailed, UsageError
from recpipe.querygen.config import AUTO, QuerygenConfig
from recpipe.querygen.recorder import Measurement
from recpipe.querygen.workload import ArrivalIntervals, CandidateSpec

#: queries/s one sender process is asked to offer under ``--processes auto``. A sender costs 0.1-0.65
#: ms of CPU per query (0.1-0.25 ms on a 2-core EPYC dev host, ``recpipe bench querygen``; 0.4-0.65 ms
#: on the H200 box under load), so at 1,000 q/s it is at most ~65% busy: room for its timers to fire on
#: time, which is what the open loop needs from it.
PROCESS_RATE = 1000.0
#: closed-loop clients per sender process under ``auto``: a client of a chain answering in ~8 ms (the
#: sequential end to end on the H200 box) sends ~125 q/s, so 8 clients come to about PROCESS_RATE.
CLIENTS_PER_PROCESS = 8
#: seconds a fresh sender may take to start (a new interpreter importing grpc) and connect
START_S = 60.0
#: how far ahead of now the shared start instant is set, so every sender is waiting when it comes
START_LEAD_S = 0.1
#: seconds a sender gets to stop after being told to, before it is terminated
STOP_S = 5.0


def plan(requested: int | str, mode: str, rate: float | None, concurrency: int,
         cores: int) -> tuple[int, str]:
    """How many sender processes a run uses, and why.

    A number is used as given. ``auto``: sequential, 1; open loop, one process per ``PROCESS_RATE`` q/s
    of the offered rate; closed loop, one per ``CLIENTS_PER_PROCESS`` clients; never more than the
    usable ``cores`` (more senders than cores only compete with each other and with the chain).
    """
    if requested != AUTO:
        return int(requested), f"--processes {requested}"
    if mode == "sequential":
        return 1, "auto: sequential runs in one process"
    if mode == "open":
        need = math.ceil((rate or 0.0) / PROCESS_RATE)
        why = f"auto: {rate or 0:g} q/s at {PROCESS_RATE:g} q/s per sender"
    else:
        need = math.ceil(concurrency / CLIENTS_PER_PROCESS)
        why = f"auto: {concurrency} clients at {CLIENTS_PER_PROCESS} per sender"
    n = max(1, min(need, cores))
    if n < need:
        why += f", capped at the {cores} usable cores"
    return n, why


def open_share(arrivals: np.ndarray, k: int, n: int) -> tuple[range, np.ndarray]:
    """Process ``k`` of ``n``'s part of an open-loop schedule: (query indices, their arrival times),
    every ``n``-th query from the ``k``-th; the ``n`` parts together hold each query exactly once."""
    return range(k, len(arrivals), n), arrivals[k::n]


def closed_share(total: int, k: int, n: int) -> int:
    """Process ``k`` of ``n``'s part of ``total`` (clients or queries): the first ``total % n`` processes
    take one more, so the parts add up to ``total``."""
    return total // n + (1 if k < total % n else 0)


@dataclass
class SenderResult:
    """What one sender process measured and the CPU seconds (all its threads) it spent doing so."""

    process: int
    measurement: Measurement
    cpu_s: float | None


def cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has spent."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def config_to_wire(config: QuerygenConfig) -> dict[str, Any]:
    """The configuration as plain data (nested dicts, tuples, numbers, strings) for a sender."""
    return dataclasses.asdict(config)


def config_from_wire(wire: Mapping[str, Any]) -> QuerygenConfig:
    fields = dict(wire)
    fields["candidates"] = CandidateSpec(**fields["candidates"])
    if fields.get("arrivals") is not None:
        fields["arrivals"] = ArrivalIntervals(**fields["arrivals"])
    return QuerygenConfig(**fields)


def open_job(arrivals: np.ndarray, warmup: float, k: int, n: int) -> dict[str, Any]:
    indices, times = open_share(arrivals, k, n)
    return {"op": "open", "warmup": warmup, "first": indices.start, "step": indices.step,
            "arrivals": times.tolist()}


def closed_job(concurrency: int, warmup: float, duration: float | None, queries: int | None,
               k: int, n: int) -> dict[str, Any]:
    return {"op": "closed", "warmup": warmup, "duration": duration,
            "queries": None if queries is None else closed_share(queries, k, n),
            "concurrency": closed_share(concurrency, k, n), "first": k, "step": n}


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Processes started inside inherit an ignored SIGINT (an ignored signal stays ignored across exec),
    so Ctrl-C on a terminal reaches only this process, which then stops them: no traceback from each."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait(objects: list[Any], timeout: float | None) -> list[Any]:
    """``multiprocessing.connection.wait`` (blocking: run it in an executor thread)."""
    return list(multiprocessing.connection.wait(objects, timeout))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection


class SenderPool:
    """Sender processes for one session: started once (and added to when a later step needs more),
    told what to send per measurement, stopped at the end."""

    def __init__(self, config: QuerygenConfig, num_users: int) -> None:
        self._wire = config_to_wire(config)
        self._num_users = num_users
        self._connect_timeout = config.connect_timeout
        self._workers: list[_Worker] = []
        self._busy = False

    @property
    def pids(self) -> list[int | None]:
        return [w.process.pid for w in self._workers]

    async def grow(self, n: int) -> None:
        """Have at least ``n`` senders, each connected and ready."""
        if n <= len(self._workers):
            return
        ctx = multiprocessing.get_context("spawn")
        new: list[int] = []
        with _children_ignore_sigint():
            for k in range(len(self._workers), n):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_main, args=(child, self._wire, self._num_users),
                                      name=f"recpipe-querygen-sender-{k}", daemon=True)
                process.start()
                child.close()  # ours: the parent end then sees EOF once the sender is gone
                self._workers.append(_Worker(process, parent))
                new.append(k)
        await self._collect(new, time.monotonic() + START_S + self._connect_timeout, "start")

    async def measure(self, jobs: Sequence[dict[str, Any]]) -> list[SenderResult]:
        """Run ``jobs[k]`` on sender ``k``, all from one shared start instant; their results in order."""
        if len(jobs) > len(self._workers):
            raise ValueError(f"{len(jobs)} jobs for {len(self._workers)} senders")
        self._busy = True
        for worker, job in zip(self._workers, jobs, strict=False):
            self._send(worker, job)
        base = time.perf_counter() + START_LEAD_S
        for worker in self._workers[:len(jobs)]:
            self._send(worker, {"op": "go", "base": base})
        replies = await self._collect(list(range(len(jobs))), None, "measure")
        self._busy = False
        return [SenderResult(k, Measurement.from_wire(replies[k]["result"]), replies[k]["cpu_s"])
                for k in range(len(jobs))]

    def _send(self, worker: _Worker, message: dict[str, Any]) -> None:
        try:
            worker.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            k = self._workers.index(worker)
            raise SenderFailed(self._gone(k)) from None

    def _gone(self, k: int) -> str:
        process = self._workers[k].process
        process.join(1.0)
        code = process.exitcode
        how = "stopped answering" if code is None else (f"was killed by signal {-code}" if code < 0
                                                         else f"exited with code {code}")
        return f"sender process {k} of {len(self._workers)} {how} before it reported"

    async def _collect(self, ks: list[int], deadline: float | None, what: str) -> dict[int, dict[str, Any]]:
        """The next message of each sender in ``ks``; a sender that reports an error, dies or (with a
        ``deadline``) does not answer in time raises, with one line that names it."""
        loop = asyncio.get_running_loop()
        waiting = {self._workers[k].conn: k for k in ks}
        sentinels = {self._workers[k].process.sentinel: k for k in ks}
        replies: dict[int, dict[str, Any]] = {}
        while waiting:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = await loop.run_in_executor(None, _wait, [*waiting, *sentinels], timeout)
            if not ready:
                late = sorted(waiting.values())
                raise SenderFailed(f"sender process{'es' * (len(late) > 1)} {', '.join(map(str, late))} did "
                                   f"not {what} within {START_S + self._connect_timeout:g} s")
            # Messages first: a sender that reported and then exited has said what it had to say.
            for obj in ready:
                if isinstance(obj, Connection) and obj in waiting:
                    k = waiting.pop(obj)
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        raise SenderFailed(self._gone(k)) from None
                    if "error" in message:
                        cls = UsageError if message.get("usage") else SenderFailed
                        raise cls(f"sender process {k} of {len(self._workers)}: {message['error']}")
                    replies[k] = message
            for obj in ready:
                if not isinstance(obj, Connection) and obj in sentinels:
                    k = sentinels[obj]
                    if k not in replies:
                        raise SenderFailed(self._gone(k))
            sentinels = {s: k for s, k in sentinels.items() if k not in replies}
        return replies

    def close(self) -> None:
        """Stop every sender: told to stop when idle, terminated when interrupted mid-run (Ctrl-C, an
        error elsewhere), killed if it does not go."""
        workers, self._workers = self._workers, []
        if not self._busy:
            for w in workers:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send({"op": "stop"})
            deadline = time.monotonic() + STOP_S
            for w in workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.terminate()
        for w in workers:
            w.process.join(STOP_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        self._busy = False


# ----------------------------------------------------------------------------------------------------
# The sender side (runs in the spawned process)


def _main(conn: Connection, wire: dict[str, Any], num_users: int) -> None:
    """A sender process: connect, say ready, then run each job it is sent until told to stop (or until
    the parent is gone). Errors go back as one line; nothing is printed here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (see _children_ignore_sigint)
    from recpipe.querygen import loops

    with contextlib.suppress(BrokenPipeError, ConnectionResetError, EOFError, OSError):
        try:
            loops.run(_serve(conn, config_from_wire(wire), num_users))
        except UsageError as e:
            conn.send({"error": str(e), "usage": True})
        except Exception as e:  # any failure goes back to the parent as one line
            conn.send({"error": f"{type(e).__name__}: {e}", "usage": False})
    conn.close()


async def _serve(conn: Connection, config: QuerygenConfig, num_users: int) -> None:
    from recpipe.querygen import clients, loops

    loop = asyncio.get_running_loop()
    by_role, channels = await clients.open_roles(clients.roles(config), config.connect_timeout)
    try:
        send = clients.send_for(config, by_role, num_users)
        conn.send({"ready": True})
        while True:
            try:
                job = await loop.run_in_executor(None, conn.recv)
            except EOFError:
                return  # the parent is gone
            if job.get("op") == "stop":
                return
            go = await loop.run_in_executor(None, conn.recv)
            before = cpu_s()
            if job["op"] == "open":
                times = job["arrivals"]
                indices = range(job["first"], job["first"] + job["step"] * len(times), job["step"])
                rec = await loops.run_open(send, times, job["warmup"], indices=indices, base=go["base"])
            else:
                rec = await loops.run_closed(send, job["concurrency"], job["warmup"], job["duration"],
                                             job["queries"], base=go["base"], index_start=job["first"],
                                             index_step=job["step"])
            spent = cpu_s() - before
            conn.send({"result": rec.finish(config.timeout).to_wire(), "cpu_s": round(spent, 6)})
    finally:
        for channel in channels:
            await channel.close(None)

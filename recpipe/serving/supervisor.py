"""``recpipe serve --stage all``: one OS process per stage, started, watched and stopped together.

``start()`` launches every stage process at once (the gateway's channels connect lazily, so it need not
wait for the others) and returns when all of them report SERVING on the gRPC health service. ``run()``
then polls: a stage process that exits is logged and started again on the same port (with a backoff
when it keeps dying right after start), and is reported again once it is SERVING. A stage process whose
health service has answered before but has not answered for ``unresponsive_s`` seconds (frozen by
SIGSTOP, a hung event loop) is logged, killed with SIGKILL and restarted the same way; before its first
answer a stage is still starting, which ``startup_timeout_s`` bounds instead. ``stop()`` sends
SIGTERM to every stage, callers before the stages they call (``StageProcess.calls``), each of which
drains its in-flight requests, and SIGKILLs what is still there after the grace period.

With ``standby``, once the stages are SERVING each also gets a warm standby process (loaded, not
bound: ``recpipe.serving.runner``): a restart then activates it, which takes milliseconds where a new
process spends seconds on imports and artifacts, and a new standby is started behind it.

A stage run as several processes (replicas, ``recpipe.serving.launch``) is several ``StageProcess``es
with the same ``stage``: each replica is probed on its own address, restarted and given a standby like
a stage of its own, and ``start()`` waits for every replica. ``addresses()`` gives per stage the target
that reaches all its replicas.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recpipe.errors import RecpipeError
from recpipe.serving.channels import make_blocking_channel
from recpipe.serving.config import DEFAULT_UNRESPONSIVE_S
from recpipe.serving.runner import ACTIVATE, STANDBY_FD_ENV, SUPERVISOR_ENV

log = logging.getLogger(__name__)

#: A stage that dies sooner than this after starting counts as a failed start (backoff grows).
STABLE_AFTER_S = 10.0
MAX_BACKOFF_S = 30.0
#: Deadline of one health check.
PROBE_TIMEOUT_S = 1.0
#: the file descriptor a stage's stdout is sent to (this process's stderr)
STDERR_FD = 2


@dataclass(frozen=True)
class StageProcess:
    """How to run one stage process: its name, the gRPC address where it alone answers (health checks,
    GetInfo), its command line and metrics port; ``stage``, the stage it runs (default: ``name``; a
    replica is named ``STAGE#K``), and ``target``, the gRPC target that reaches every process of that
    stage (default: ``address``); ``calls``, the stages it calls (``stop`` stops its callers first)."""

    name: str
    address: str
    argv: tuple[str, ...]
    metrics_port: int | None = None
    stage: str = ""
    target: str = ""
    calls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.stage:
            object.__setattr__(self, "stage", self.name)
        if not self.target:
            object.__setattr__(self, "target", self.address)

    @property
    def standby_argv(self) -> tuple[str, ...]:
        """The command line of its warm standby (``recpipe serve --stage NAME ... --standby``)."""
        return (*self.argv, "--standby")


@dataclass
class _Child:
    spec: StageProcess
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    serving: bool = False
    restarts: int = 0
    quick_failures: int = 0
    restart_at: float | None = None
    #: When its health service last answered (any status); None until the first answer.
    answered_at: float | None = None
    channel: grpc.Channel | None = field(default=None, repr=False)
    #: A process loading or loaded to take over (``Supervisor(standby=True)``), and the read end of the
    #: pipe on which it says it has loaded.
    standby: subprocess.Popen[bytes] | None = None
    standby_ready: int | None = None
    standby_loaded: bool = False


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the stage binds it; a collision fails loudly, never shares)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _terminate(procs: Sequence[subprocess.Popen[bytes]]) -> list[subprocess.Popen[bytes]]:
    """SIGTERM those of ``procs`` still running; -> them."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    return running


def health_status(channel: grpc.Channel, timeout: float = 1.0) -> str:
    """The overall health status name of the server behind ``channel`` ("UNREACHABLE" on failure)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError:
        return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class Supervisor:
    def __init__(self, stages: Sequence[StageProcess], *, startup_timeout_s: float = 600.0, grace_s: float = 5.0,
                 unresponsive_s: float = DEFAULT_UNRESPONSIVE_S, standby: bool = False):
        self.children = {s.name: _Child(s) for s in stages}
        self.standby = standby
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.unresponsive_s = unresponsive_s
        self._stopping = False
        self._lock = threading.Lock()

    # --- life cycle --------------------------------------------------------------------------------

    def launch(self) -> None:
        """Start every stage process without waiting (``wait_serving`` waits)."""
        for child in self.children.values():
            self._spawn(child)

    def start(self, stop: threading.Event | None = None) -> None:
        """Start every stage and wait until all are SERVING; on failure, or when ``stop`` is set
        meanwhile (KeyboardInterrupt), stop them all and raise."""
        self.launch()
        try:
            self.wait_serving(timeout_s=self.startup_timeout_s, during_startup=True, stop=stop)
        except BaseException:
            self.stop()
            raise
        if self.standby:
            for child in self.children.values():
                self._spawn_standby(child)

    def wait_serving(self, names: Sequence[str] | None = None, *, timeout_s: float = 60.0,
                     during_startup: bool = False, stop: threading.Event | None = None) -> None:
        """Block until the named processes or stages (a stage: every replica; default all) report
        SERVING. During start-up a stage that exits is an error; afterwards it is restarted by
        ``check``, which this keeps calling."""
        wanted = self._processes(names)
        deadline = time.monotonic() + timeout_s
        while True:
            if during_startup:
                for name in wanted:
                    proc = self.children[name].proc
                    if proc is not None and proc.poll() is not None:
                        raise RecpipeError(
                            f"stage {name} exited with code {proc.returncode} during start-up (see its log above)"
                        )
            else:
                self.check()
            self._probe()
            if all(self.children[n].serving for n in wanted):
                return
            if time.monotonic() > deadline:
                late = [n for n in wanted if not self.children[n].serving]
                raise RecpipeError(f"stages not SERVING after {timeout_s:.0f}s: {', '.join(late)}")
            if stop is not None and stop.wait(0.1):
                raise KeyboardInterrupt
            if stop is None:
                time.sleep(0.1)

    def run(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        """Watch the stages until ``stop`` is set (a signal handler sets it), then stop them all."""
        try:
            while not stop.wait(poll_s):
                self.check()
                self._probe()
        finally:
            self.stop()

    def check(self) -> list[str]:
        """Restart stage processes that exited; returns the names (re)spawned by this call."""
        spawned = []
        now = time.monotonic()
        with self._lock:
            if self._stopping:
                return []
            for child in self.children.values():
                proc = child.proc
                if proc is not None and proc.poll() is None:
                    continue
                if child.restart_at is None:
                    code = proc.returncode if proc is not None else None
                    lived = now - child.started_at
                    child.quick_failures = child.quick_failures + 1 if lived < STABLE_AFTER_S else 0
                    # one crash restarts at once; a stage that keeps dying right after start backs off
                    delay = 0.0 if child.quick_failures <= 1 else min(MAX_BACKOFF_S, 0.5 * 2 ** (child.quick_failures - 1))
                    child.restart_at = now + delay
                    child.serving = False
                    log.warning(
                        "stage %s (pid %s) exited with code %s after %.1fs; restarting in %.1fs",
                        child.spec.name, proc.pid if proc else "-", code, lived, delay,
                    )
                if now >= child.restart_at:
                    child.restart_at = None
                    child.restarts += 1
                    if self._activate_standby(child):
                        how = "from its warm standby"
                    else:
                        self._spawn(child)
                        how = "as a new process"
                    log.warning("stage %s restarted %s (pid %s, restart #%d)", child.spec.name, how,
                                child.proc.pid if child.proc else "-", child.restarts)
                    if self.standby:
                        self._spawn_standby(child)
                    spawned.append(child.spec.name)
        return spawned

    def stop(self) -> None:
        """SIGTERM the stages (they drain in-flight requests) callers first, SIGKILL stragglers after the
        grace: a stage is signalled once every process that calls it has exited, so the calls a caller
        drains still find the stages they need (signalled together, the gateway's queries in flight
        failed with UNAVAILABLE from a stage that had stopped under them). The standbys, which serve
        nothing, are signalled at once and waited for last (one still loading stops once loaded)."""
        with self._lock:
            self._stopping = True
        standbys = [c.standby for c in self.children.values() if c.standby is not None]
        _terminate(standbys)
        for wave in self._stop_waves():
            self._reap(_terminate(wave))
        self._reap(standbys)
        for child in self.children.values():
            if child.channel is not None:
                child.channel.close()
                child.channel = None

    def _stop_waves(self) -> list[list[subprocess.Popen[bytes]]]:
        """The stage processes in the order ``stop`` signals them: first the stages no stage calls, then
        the ones those call, and so on."""
        left = list(self.children.values())
        waves = []
        while left:
            called = {stage for c in left for stage in c.spec.calls}
            wave = [c for c in left if c.spec.stage not in called] or left  # a cycle: the rest together
            waves.append([c.proc for c in wave if c.proc is not None])
            left = [c for c in left if c not in wave]
        return waves

    def _reap(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """Wait for ``procs`` to exit, SIGKILL those still there after the grace."""
        deadline = time.monotonic() + self.grace_s + 5.0
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("stage pid %s did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.wait()

    # --- helpers -----------------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        """The pid of process ``name`` (a stage's name, or ``STAGE#K`` for a replica)."""
        proc = self.children[name].proc
        return proc.pid if proc is not None else None

    def addresses(self) -> dict[str, str]:
        """Per stage, the target that reaches it: its address, or every replica's (``StageProcess.target``)."""
        return {c.spec.stage: c.spec.target for c in self.children.values()}

    def replicas(self) -> dict[str, list[str]]:
        """Per stage, the names of its processes (one, or ``STAGE#1`` ... for replicas)."""
        out: dict[str, list[str]] = {}
        for name, c in self.children.items():
            out.setdefault(c.spec.stage, []).append(name)
        return out

    def _processes(self, names: Sequence[str] | None) -> list[str]:
        """Process names for ``names`` of processes or stages (a stage's: all its replicas); default all."""
        if not names:
            return list(self.children)
        by_stage = self.replicas()
        return [p for n in names for p in ([n] if n in self.children else by_stage[n])]

    def _spawn(self, child: _Child) -> None:
        env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        # Its own session: a terminal's Ctrl-C reaches only the supervisor, which stops the stages in
        # order instead of racing them to their own shutdown.
        # Its stdout goes to our stderr: what a stage prints (its recpipe-stage-ready handshake, logs)
        # is diagnostics, and our stdout is for the summaries a user may redirect or parse.
        child.proc = subprocess.Popen(list(child.spec.argv), env=env, start_new_session=True,
                                      stdout=STDERR_FD)
        child.started_at = time.monotonic()
        child.serving = False
        child.answered_at = None

    def _spawn_standby(self, child: _Child) -> None:
        read, write = os.pipe()
        env = {**os.environ, SUPERVISOR_ENV: str(os.getpid()), STANDBY_FD_ENV: str(write)}
        try:
            child.standby = subprocess.Popen(list(child.spec.standby_argv), env=env, start_new_session=True,
                                             stdout=STDERR_FD, pass_fds=(write,))
        finally:
            os.close(write)
        child.standby_ready = read
        child.standby_loaded = False

    def _standby_loaded(self, child: _Child) -> bool:
        """Whether ``child``'s standby has said it loaded (read once from its pipe, without waiting)."""
        ready = child.standby_ready
        if not child.standby_loaded and ready is not None and select.select([ready], [], [], 0)[0]:
            child.standby_loaded = os.read(ready, 1) == b"1"
            os.close(ready)
            child.standby_ready = None
        return child.standby_loaded

    def wait_standbys(self, timeout_s: float = 120.0) -> bool:
        """Block until every stage's standby has loaded (False after ``timeout_s``); for benchmarks."""
        deadline = time.monotonic() + timeout_s
        while not all(self._standby_loaded(c) for c in self.children.values()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _activate_standby(self, child: _Child) -> bool:
        """Make ``child``'s standby its serving process, if it is alive and has loaded; else end it and
        return False (a standby still loading would die of the signal, or keep the chain waiting)."""
        loaded = self._standby_loaded(child)
        standby, ready = child.standby, child.standby_ready
        child.standby, child.standby_ready, child.standby_loaded = None, None, False
        if ready is not None:
            os.close(ready)
        if standby is None:
            return False
        if not loaded or standby.poll() is not None:
            with contextlib.suppress(ProcessLookupError):
                standby.kill()
            standby.wait()
            return False
        try:
            os.kill(standby.pid, ACTIVATE)
        except ProcessLookupError:
            return False
        child.proc = standby
        child.started_at = time.monotonic()
        child.serving = False
        child.answered_at = None
        return True

    def _probe(self) -> None:
        """Ask every live stage's health at once: note SERVING, note that it answered at all, and kill
        the ones silent for longer than ``unresponsive_s`` (``check`` restarts them)."""
        watching = self.unresponsive_s > 0
        asked = []
        for child in self.children.values():
            if child.proc is None or child.proc.poll() is not None or (child.serving and not watching):
                continue
            if child.channel is None:
                child.channel = make_blocking_channel(child.spec.address)
            check = health_pb2_grpc.HealthStub(child.channel).Check
            asked.append((child, check.future(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)))
        for child, future in asked:
            try:
                reply = future.result()
            except grpc.RpcError:
                continue
            child.answered_at = time.monotonic()
            if reply.status == health_pb2.HealthCheckResponse.SERVING and not child.serving:
                child.serving = True
                if child.restarts:
                    log.warning("stage %s is SERVING again on %s", child.spec.name, child.spec.address)
        if watching:
            self._kill_unresponsive()

    def _kill_unresponsive(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._stopping:
                return
            for child in self.children.values():
                proc = child.proc
                if proc is None or proc.poll() is not None or child.answered_at is None:
                    continue
                silent = now - child.answered_at
                if silent <= self.unresponsive_s:
                    continue
                log.warning(
                    "stage %s (pid %s) has not answered its health check for %.1fs (limit %.1fs; frozen or hung); "
                    "killing it to restart it", child.spec.name, proc.pid, silent, self.unresponsive_s,
                )
                proc.kill()  # SIGKILL also ends a SIGSTOPped process, which SIGTERM would not
                child.serving = False
                child.answered_at = None

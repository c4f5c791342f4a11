"""Launching a registry's stages as processes: ports, and the command line of each supervised stage.

``recpipe serve --stage all``, ``recpipe demo`` and the benches that start a chain do it this way: one
``python -m recpipe serve --stage NAME`` process per stage, each with explicit ports, so a restarted
stage comes back where the stages calling it expect it. The ports follow each spec's ``port_offset``
from the entry stage's base port; a stage's upstream targets are the ports of the stages it calls.
``plan_chain`` takes the steps from the commands' flags (replicas, ports, threads, CPUs, command lines);
the benches that start one process per stage call ``allocate_ports`` and ``supervised_stages`` alone.

A stage may run as several processes, its *replicas* (``--replicas STAGE=N``, or ``auto`` from the
cores and each stage's ``cost``: ``Registry.auto_replicas``), because one Python process is capped by its
GIL at about a core of gRPC and asyncio work. How its callers reach them depends on who calls it:

- a stage that other stages call gets one port per replica (its port, + ``REPLICA_PORT_STRIDE``, ...),
  and its callers get every address in one target, ``ipv4:127.0.0.1:50054,127.0.0.1:50154``: the
  gateway opens a channel per address and sends each batch to the first free replica, passing over
  one that is down (``recpipe.gateway.hops``). Per call, not per connection: balancing a gateway's
  connections would pin all of a stage's calls from one gateway to one replica.
- the entry stage, which clients outside the chain call at one published address, shares that port
  among its replicas (SO_REUSEPORT, an opt-in for these processes only) and the kernel spreads the
  client connections; each replica also listens alone on its own port for its supervisor's health
  checks and GetInfo.

Replicas load before they take their ports (``StageConfig.bind_after_load``), so no caller is handed a
replica that is still loading.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from recpipe.accel.device import certainly_cpu
from recpipe.errors import UsageError
from recpipe.serving.affinity import format_cpus, plan
from recpipe.serving.config import METRICS_PORT_OFFSET
from recpipe.serving.spec import CORES_PER_PROCESS, GPU_CORES_PER_PROCESS, Registry, cores_per_process
from recpipe.serving.supervisor import StageProcess, free_port
from recpipe.serving.threads import usable_cores

#: Replica k (from 0) of a stage listens on the stage's port + k x this (50054, 50154, ...; an entry
#: stage's replicas share its port and listen alone on + (k + 1) x this), its metrics 1000 above as usual.
REPLICA_PORT_STRIDE = 100
#: The most replicas of one stage: more would reach the metrics ports (+ METRICS_PORT_OFFSET).
MAX_REPLICAS = METRICS_PORT_OFFSET // REPLICA_PORT_STRIDE - 1


def metrics_port(flag: int | None, grpc_port: int, offset: int) -> int | None:
    """A stage's metrics port: gRPC port + 1000 by default (0 when the gRPC port is free-picked), the
    flag's value + the stage's port offset, 0 for a free port, None (off) for a negative flag."""
    if flag is None:
        return grpc_port + METRICS_PORT_OFFSET if grpc_port else 0
    if flag < 0:
        return None
    return flag + offset if flag else 0


@dataclass(frozen=True)
class ProcessPorts:
    """Where one process of a stage listens: ``port`` is the stage's (shared by its replicas where
    ``shared``), ``own`` the one this process alone answers on (equal to ``port`` unless shared),
    ``metrics`` its Prometheus port (None: off)."""

    port: int
    own: int
    metrics: int | None

    @property
    def shared(self) -> bool:
        return self.own != self.port


def shares_port(registry: Registry, name: str) -> bool:
    """Whether the replicas of stage ``name`` share one port: no stage calls it, so its clients are
    outside the chain and know one address."""
    return not any(name in s.upstream for s in registry)


def allocate_ports(registry: Registry, host: str, base: int, metrics_flag: int | None,
                   replicas: Mapping[str, int] | None = None) -> dict[str, list[ProcessPorts]]:
    """The ports of every process, per stage (one per replica, ``replicas`` default one each): gRPC at
    ``base`` + the stage's offset (+ ``REPLICA_PORT_STRIDE`` per replica), ``base`` 0 picks free ports;
    metrics at each process's own port + 1000, or from ``metrics_flag`` (0 free, -1 off).
    ``UsageError`` when a port would pass 65535."""
    free_metrics = metrics_flag == 0 or (metrics_flag is None and not base)
    out: dict[str, list[ProcessPorts]] = {}
    taken: set[int] = set()

    def pick() -> int:
        """A free port none of the others got: the kernel may hand a just-released port out again (seen:
        a replica's own port equal to the entry stage's, whose replicas had not bound it yet)."""
        while (port := free_port(host)) in taken:
            pass
        taken.add(port)
        return port

    for spec in registry:
        n = (replicas or {}).get(spec.name, 1)
        shared = n > 1 and shares_port(registry, spec.name)
        port = base + spec.port_offset if base else pick()
        processes = []
        for k in range(n):
            offset = spec.port_offset + (k + 1 if shared else k) * REPLICA_PORT_STRIDE
            own = port if offset == spec.port_offset else (base + offset if base else pick())
            metrics = pick() if free_metrics else metrics_port(metrics_flag, own, offset)
            processes.append(ProcessPorts(port if shared else own, own, metrics))
        out[spec.name] = processes
    top = max(max(p.own, p.metrics or 0) for ps in out.values() for p in ps)
    if top > 65535:
        raise UsageError(f"the ports from {base} reach {top} (over 65535, metrics ports included): choose a lower "
                         "--port or --metrics-port, or fewer replicas")
    return out


#: ``--replicas`` help, shared by every command that starts the chain.
REPLICAS_HELP = (f"processes per stage: STAGE=N[,STAGE=N...] (the others 1; N up to {MAX_REPLICAS}), N for "
                 f"every stage, or auto (one process per {CORES_PER_PROCESS} cores, {GPU_CORES_PER_PROCESS} with a GPU, "
                 "shared by each stage's cost on the device it uses; 1 each below that)")

_NAMED = re.compile(r"^([A-Za-z_][\w-]*)=(\d+)$")


def _parse_replicas(text: str) -> str | int | dict[str, int]:
    """``auto``, N (every stage) or {STAGE: N}; ``ValueError`` with a one-line reason otherwise."""
    t = text.strip()
    if t == "auto":
        return t
    if t.isdigit():
        return _count(t, "every stage")
    named: dict[str, int] = {}
    for part in t.split(","):
        m = _NAMED.match(part.strip())
        if m is None:
            raise ValueError(f"must be auto, N, or STAGE=N[,STAGE=N...], got {text!r}")
        name, count = m.groups()
        if name in named:
            raise ValueError(f"{name} is named twice in {text!r}")
        named[name] = _count(count, name)
    return named


def _count(text: str, what: str) -> int:
    n = int(text)
    if not 1 <= n <= MAX_REPLICAS:
        raise ValueError(f"{what}: replicas must be in 1..{MAX_REPLICAS}, got {n}")
    return n


def replicas_arg(text: str) -> str:
    """``--replicas``: its syntax checked here (stage names by ``resolve_replicas``), returned as given."""
    try:
        _parse_replicas(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def resolve_replicas(registry: Registry, flag: str | None, device: str = "auto") -> tuple[dict[str, int], str]:
    """Processes per stage from ``--replicas`` (None: one each) and a line saying what was chosen;
    ``UsageError`` for a stage the registry does not have. ``auto`` weighs the stages by their CPU per
    query on ``device`` (a stage computing on a GPU costs its serving alone)."""
    parsed = _parse_replicas(flag or "1")
    if parsed == "auto":
        cores = usable_cores()
        gpu = not certainly_cpu(device)
        counts = registry.auto_replicas(cores, MAX_REPLICAS, gpu=gpu)
        smallest = math.ceil(cores_per_process(gpu) * (len(registry) + 1))
        why = (f"one process per stage (more from {smallest} cores)"
               if max(counts.values()) == 1 else _describe(counts))
        return counts, f"replicas: auto on {cores} core{'s' * (cores != 1)}: {why} (by each stage's cost" \
                       f"{' with a GPU' if gpu else ''}; --replicas STAGE=N to set)"
    if isinstance(parsed, int):
        counts = {s.name: parsed for s in registry}
    else:
        assert isinstance(parsed, dict)
        for name in parsed:
            if name not in registry:
                raise UsageError(f"--replicas: unknown stage {name!r}: choose {', '.join(registry.names)}")
        counts = {s.name: parsed.get(s.name, 1) for s in registry}
    return counts, f"replicas: {_describe(counts)}"


def _describe(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items()) if max(counts.values()) > 1 else "one process per stage"


def replica_target(addresses: Sequence[str]) -> str:
    """The gRPC target that reaches every one of ``addresses`` (``host:port``, IPv6 in brackets): the
    address itself for one, else the ``ipv4:`` / ``ipv6:`` list (the gateway's hops split it into a
    channel per replica, ``recpipe.gateway.hops.replica_targets``; other clients' round_robin channel
    balances over it call by call). Several need IP addresses (gRPC lists only addresses)."""
    unique = list(dict.fromkeys(addresses))
    if len(unique) == 1:
        return unique[0]
    listed = []
    for address in unique:
        host, _, port = address.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise UsageError(f"replicas behind one target need --host to be an IP address, got {host!r}") from None
        listed.append((ip.version, f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"))
    if len({version for version, _ in listed}) > 1:
        raise UsageError(f"one target cannot list IPv4 and IPv6 addresses: {', '.join(unique)}")
    return f"ipv{listed[0][0]}:" + ",".join(a for _, a in listed)


def direct_target(processes: Sequence[StageProcess], stage: str) -> str:
    """The target naming each process of ``stage`` at its own address, balanced per call: how one client
    process reaches all the replicas of the entry stage (its one shared port would give all the calls
    of one process, over one connection, to one replica)."""
    return replica_target([p.address for p in processes if p.stage == stage])


#: ``--threads`` help, shared by every command that starts the chain.
THREADS_HELP = ("compute threads per stage process: auto (default) shares this machine's cores among the stages "
                "in proportion to their cost (a stage's share split among its replicas); N for every process; "
                "0 = the libraries' defaults")


def threads_arg(text: str) -> int | None:
    """``--threads``: "auto" (None) or a count >= 0."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto or a number >= 0, got {text!r}")
    return value


def resolve_threads(registry: Registry, flag: int | None,
                    replicas: Mapping[str, int] | None = None) -> tuple[int | dict[str, int], str]:
    """The ``threads`` for ``supervised_stages`` and a line saying what was chosen: ``flag`` for every
    stage process, or with ``auto`` (None) each stage's share of the cores this process may use, split
    among its ``replicas``."""
    if flag is not None:
        return flag, f"threads: {flag or 'library default'} per stage process"
    cores = usable_cores()
    shares = registry.auto_threads(cores, replicas)
    n = replicas or {}
    chosen = ", ".join(f"{name} {t}" + (f" x{n[name]} processes" if n.get(name, 1) > 1 else "")
                       for name, t in shares.items() if t)
    return shares, f"threads: auto on {cores} core{'s' * (cores != 1)}: {chosen} (by each stage's cost; --threads N to set)"


def busy_port(processes: Sequence[StageProcess], host: str) -> tuple[str, int] | None:
    """The first (process, port) of the chain's gRPC and metrics ports that another server holds on
    ``host`` now, else None. Checked before anything starts: a stage that cannot listen dies, but the
    supervisor's health probe on that address would meet the other server, take it for its own stage
    and restart it from its standby forever (a second ``serve`` on a busy port did, and said it served)."""
    for p in processes:
        ports = [_port_of(p.address), p.metrics_port]
        if p.target != p.address and not p.target.startswith(("ipv4:", "ipv6:")):
            ports.append(_port_of(p.target))  # replicas behind one shared port
        for port in ports:
            if port and not _bindable(host, port):
                return p.name, port
    return None


def _port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def _bindable(host: str, port: int) -> bool:
    """Whether a listening socket on ``host:port`` could be bound now (as the stages bind theirs:
    SO_REUSEADDR, so a closed connection's TIME_WAIT does not count; no SO_REUSEPORT)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except OSError:
        return True  # an address the stage itself will refuse, with its own message
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return False
    return True


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine (a wildcard is not a destination)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def supervised_stages(
    registry: Registry, *, models: Path, data: Path, host: str, ports: Mapping[str, Sequence[ProcessPorts]],
    device: str = "auto", threads: int | dict[str, int] = 0, workers: int = 0, grace: float = 5.0,
    log_level: str = "WARNING", extra: Sequence[str] = (), cpus: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> list[StageProcess]:
    """One ``StageProcess`` per stage process, in the registry's order: ``python -m recpipe serve --stage
    NAME`` with explicit ports (``allocate_ports``: one per replica) and its upstream targets (every
    replica of the stage it calls: ``replica_target``). ``threads``: for every process, or per stage
    (``--threads auto``: ``Registry.auto_threads``). ``extra`` is appended to every stage's arguments
    (the batching flags and the stages' own options). ``cpus``: each process's CPUs, per stage
    (``recpipe.serving.affinity.plan``; a stage left out runs anywhere). Replicas are named ``STAGE#1``,
    ``STAGE#2``, ...
    """
    connect = connect_host(host)
    targets = {name: replica_target([f"{connect}:{p.port}" for p in ps]) for name, ps in ports.items()}
    processes = []
    for spec in registry:
        name = spec.name
        replicas = ports[name]
        for k, p in enumerate(replicas):
            argv = [
                sys.executable, "-m", "recpipe", "--log-level", log_level, "serve", "--stage", name,
                "--models", str(models), "--data", str(data), "--host", host, "--port", str(p.port),
                "--metrics-port", str(-1 if p.metrics is None else p.metrics),
                "--device", device, "--threads", str(threads if isinstance(threads, int) else threads[name]),
                "--workers", str(workers), "--grace", str(grace),
                *extra,
            ]
            placed = (cpus or {}).get(name)
            if placed:
                argv += ["--cpus", format_cpus(placed[k])]
            if len(replicas) > 1:
                argv.append("--bind-after-load")
            if p.shared:
                argv += ["--reuse-port", "--own-port", str(p.own)]
            for upstream in spec.upstream:
                argv += [f"--{upstream}", targets[upstream]]
            process = name if len(replicas) == 1 else f"{name}#{k + 1}"
            processes.append(StageProcess(process, f"{connect}:{p.own}", tuple(argv), p.metrics, stage=name,
                                          target=targets[name], calls=tuple(spec.upstream)))
    return processes


@dataclass(frozen=True)
class ChainPlan:
    """What ``plan_chain`` chose: the processes to supervise, and a line each saying how many processes
    each stage got, their threads, and their CPUs."""

    processes: list[StageProcess]
    said: tuple[str, str, str]


def plan_chain(registry: Registry, *, models: Path, data: Path, host: str, replicas: str | None = None,
               threads: int | None = None, affinity: str = "auto", device: str = "auto", base: int = 0,
               metrics: int | None = -1, workers: int = 0, grace: float = 5.0, log_level: str = "WARNING",
               extra: Sequence[str] = ()) -> ChainPlan:
    """Every process of the chain the way ``recpipe serve --stage all``, ``demo`` and ``characterize``
    start it, from their flags: ``--replicas`` (``resolve_replicas``), ports from ``base`` (0: free ones)
    and ``metrics`` (``allocate_ports``), ``--threads`` (None: auto, ``resolve_threads``), ``--affinity``
    (``recpipe.serving.affinity.plan``); the rest as ``supervised_stages`` takes them. ``UsageError``
    for a bad flag, or ``models`` or ``data`` not a directory."""
    counts, replicas_line = resolve_replicas(registry, replicas, device)
    for path, what in ((models, "--models"), (data, "--data")):
        if not Path(path).is_dir():
            raise UsageError(f"{what} {path}: no such directory")
    ports = allocate_ports(registry, host, base, metrics, counts)
    chosen, threads_line = resolve_threads(registry, threads, counts)
    cpus, placed = plan(registry, affinity, counts, chosen)
    processes = supervised_stages(registry, models=models, data=data, host=host, ports=ports, device=device,
                                  threads=chosen, workers=workers, grace=grace, log_level=log_level, extra=extra,
                                  cpus=cpus)
    return ChainPlan(processes, (replicas_line, threads_line, placed))

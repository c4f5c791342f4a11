"""CPU seconds a process has used (user + system), from /proc/PID/stat: the cost of a query per process;
and the whole machine's, from /proc/stat: what the processes measured leave to the rest (the kernel's
network work done outside any process, other jobs, the hypervisor's steal)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: A machine at least this busy (share of all its cores) over a run was saturated: its cores, not what
#: ran on them, were the run's limit (querygen warns, bench querygen and characterize name it the limit).
SATURATED = 0.95


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds; None when it cannot be read (gone, or not Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / _TICKS


def snapshot(pids: Mapping[str, Sequence[int | None]]) -> dict[str, float | None]:
    """CPU seconds per name, over its processes together (a stage's replicas); None when one is
    unreadable."""
    out: dict[str, float | None] = {}
    for name, group in pids.items():
        seconds = [cpu_seconds(pid) if pid else None for pid in group]
        out[name] = None if not seconds or None in seconds else sum(s for s in seconds if s is not None)
    return out


def per_query(before: Mapping[str, float | None], after: Mapping[str, float | None],
              queries: int) -> dict[str, float | None]:
    """CPU seconds per query per process between two snapshots (None where a process was unreadable or
    restarted in between, i.e. its counter went backwards)."""
    out: dict[str, float | None] = {}
    for name, a in before.items():
        b = after.get(name)
        if a is None or b is None or b < a or queries <= 0:
            out[name] = None
        else:
            out[name] = round((b - a) / queries, 6)
    return out


@dataclass(frozen=True)
class MachineTicks:
    """Jiffies of all CPUs together since boot, from /proc/stat's ``cpu`` line: ``busy`` (user, nice,
    system, irq, softirq), ``steal`` (the hypervisor ran someone else) and ``total`` (those, idle and
    iowait)."""

    busy: int
    steal: int
    total: int

    def busy_share(self, later: MachineTicks) -> float | None:
        """The share of the machine's time (all CPUs) that was busy from this reading to ``later``."""
        span = later.total - self.total
        return (later.busy - self.busy) / span if span > 0 else None

    def busy_seconds(self, later: MachineTicks) -> float:
        """CPU seconds the whole machine spent busy from this reading to ``later``."""
        return (later.busy - self.busy) / _TICKS


def machine_ticks(stat: Path = Path("/proc/stat")) -> MachineTicks | None:
    """The machine's CPU time so far; None where /proc/stat is missing or has no steal column."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return MachineTicks(user + nice + system + irq + softirq, steal,
                        user + nice + system + idle + iowait + irq + softirq + steal)

"""CPU seconds a process has used (user + system), from /proc/PID/stat: the cost of a query per process."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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

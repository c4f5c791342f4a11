"""Per-stage latency summaries of a run of Recommend calls (p50/p90/p99 of server and observed time).

Small on purpose: ``recpipe demo`` and ``recpipe bench chain`` summarise a few hundred raw samples
with it; ``recpipe querygen`` is the full instrument (HdrHistogram, open/closed loops).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.percentiles import Summary
from recpipe.types import Recommendation

PERCENTILES = (50, 90, 99)


def stage_summaries(recs: Iterable[Recommendation]) -> dict[str, tuple[Summary, Summary]]:
    """stage (the four stages and total) -> (server summary, observed summary)."""
    server: dict[str, list[int]] = {s: [] for s in (*STEPS, TOTAL_STEP)}
    observed: dict[str, list[int]] = {s: [] for s in (*STEPS, TOTAL_STEP)}
    for rec in recs:
        for t in rec.timings:
            if t.stage in server:
                server[t.stage].append(t.server_us)
                observed[t.stage].append(t.observed_us)
    return {s: (Summary.of(server[s]), Summary.of(observed[s])) for s in server}


def format_table(recs: Sequence[Recommendation], client_us: Sequence[float] | None = None) -> str:
    """The per-stage table: p50/p90/p99 of server and gateway-observed time, in milliseconds."""
    head = f"{'stage':<14}" + "".join(f"{'server p' + str(p):>12}" for p in PERCENTILES)
    head += "".join(f"{'observed p' + str(p):>14}" for p in PERCENTILES)
    lines = [head + "   (ms)", "-" * len(head)]
    for stage, (srv, obs) in stage_summaries(recs).items():
        row = f"{stage:<14}" + "".join(f"{v / 1000:>12.3f}" for v in (srv.p50, srv.p90, srv.p99))
        row += "".join(f"{v / 1000:>14.3f}" for v in (obs.p50, obs.p90, obs.p99))
        lines.append(row)
    if client_us is not None:
        c = Summary.of(client_us)
        lines.append(f"{'client':<14}" + " " * 36 + "".join(f"{v / 1000:>14.3f}" for v in (c.p50, c.p90, c.p99)))
    return "\n".join(lines)

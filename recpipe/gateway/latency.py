"""Per-stage latency summaries of a run of Recommend calls (p50/p90/p99 of server and observed time).

Small on purpose: ``recpipe bench chain`` summarises a few hundred raw samples with it; ``recpipe
querygen`` is the full instrument (HdrHistogram, open/closed loops).
"""

from __future__ import annotations

from collections.abc import Iterable

from recpipe.config import STEPS, TOTAL_STEP
from recpipe.percentiles import Summary
from recpipe.types import Recommendation


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

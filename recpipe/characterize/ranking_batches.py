"""Ranking at B queries x k candidates per core call (B = 1, 2, 4, ... 32): what the ranking stage's
batcher hands its core under load, timed in process through ``RankingCore.rank_batch``.

``recpipe bench ranking`` times one query per call; this adds the batched calls. On CUDA the same
batches run on two more cores side by side, as in that bench: CUDA graphs off, and the tables in host
memory. Timed with the benches' own ``measure_interleaved`` (batch sizes alternate call by call).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recpipe.characterize.settings import Settings

NAME = "ranking batched"


def run(settings: Settings) -> dict[str, Any]:
    """A bench block (as ``micro.run_one`` returns): rows ``{form, p50_ms, p99_ms, per_query_ms}``."""
    from recpipe.serving.threads import torch_threads

    t0 = time.perf_counter()
    try:
        import torch

        # the characterization's thread count for these timings; the process's own comes back after
        # (``recpipe characterize`` also runs in its caller's process)
        n = int(settings.threads) if settings.threads.isdigit() and int(settings.threads) else torch.get_num_threads()
        with torch_threads(n):
            rows, text = _measure(settings)
        error = ""
    except Exception as e:  # one failing bench must not lose the others' results
        rows, text, error = [], "", f"{type(e).__name__}: {e}"
    return {"name": NAME, "command": f"in process: RankingCore.rank_batch, B in {settings.sizes.ranking_query_batches}"
            f" x {settings.num_candidates} candidates", "rc": 0 if not error else None, "error": error,
            "elapsed_s": round(time.perf_counter() - t0, 2), "rows": rows, "recalls": [], "stdout": text}


def _measure(settings: Settings) -> tuple[list[dict[str, Any]], str]:
    import numpy as np
    import torch

    from recpipe.bench._timing import measure_interleaved, table
    from recpipe.features.core import FeatureCore
    from recpipe.ranking.contract import RankQuery
    from recpipe.ranking.core import RankingCore

    s = settings.sizes
    features = FeatureCore.load(Path(settings.models), Path(settings.data))
    cores = [("served", RankingCore.load(Path(settings.models), device=settings.device))]
    if cores[0][1].torch_device.type == "cuda":
        cores += [("no CUDA graphs", RankingCore.load(Path(settings.models), device=settings.device, cuda_graphs=False)),
                  ("tables in host memory", RankingCore.load(Path(settings.models), device=settings.device,
                                                             embeddings="host"))]
    rng = np.random.default_rng(settings.seed)
    k = min(settings.num_candidates, features.num_items)
    most = max(s.ranking_query_batches)
    queries = []
    for _ in range(most):
        uid = int(rng.integers(0, features.num_users))
        user = features.augment_user(uid)
        items = features.augment_items(uid, rng.choice(features.num_items, k, replace=False))
        queries.append(RankQuery.checked(user.dense, user.sparse, items.dense, items.sparse, cores[0][1].limits))

    def call(core: Any, b: int) -> Callable[[int], object]:
        return lambda i: core.rank_batch(queries[:b])

    forms = [(f"{name}, batch {b} x {k}", call(core, b)) for b in s.ranking_query_batches for name, core in cores]
    calls = max(s.bench_calls // 4, 10)
    timings = measure_interleaved(forms, calls, s.bench_warmup)
    by_form = {t.name: t for t in timings}
    rows = []
    for b in s.ranking_query_batches:
        for name, _ in cores:
            t = by_form[f"{name}, batch {b} x {k}"]
            rows.append({"form": t.name, "p50_ms": round(t.pct_ms(50), 4), "p99_ms": round(t.pct_ms(99), 4),
                         "per_query_ms": round(t.pct_ms(50) / b, 4)})
    out = io.StringIO()
    out.write(f"ranking batched: {cores[0][1].device}, torch threads {torch.get_num_threads()}, {calls} calls per form\n")
    out.write(table(timings, forms[0][0]) + "\n")
    return rows, out.getvalue()

"""DLRM ranking of one user's candidates: fused embedding lookup vs one EmbeddingBag call per table.

Forms, same trained weights, same inputs, alternating in blocks of ``BLOCK`` calls (the first call after
each switch untimed: as in a serving stage, each form is timed after itself, not after a form that
evicted its caches):
- ``naive``: the textbook DLRM forward with one ``nn.EmbeddingBag`` call per table (60 calls);
- ``fused``: the same forward with one lookup over all tables concatenated (per-table offsets);
- ``served``: what ``RankingCore.rank`` runs — the fused lookup plus the user-side work done once per
  request instead of once per candidate (on CUDA: replayed from a CUDA graph per bucketed shape).
On a CUDA device two more forms, side by side: ``served, no CUDA graphs`` (the same padded shapes run
eagerly) and ``served, tables in host memory`` (``--embeddings host``: the DLRM tables stay in pinned
host memory and the GPU reads the rows it needs over PCIe / NVLink-C2C instead of from HBM).
On the CPU, the served forward in each precision this CPU runs (``--ranking-precision``: fp32, bf16
compiled, int8), with the held-out AUC ``recpipe train`` measured for each on the same model and its
delta to fp32, each form's check against the bound at load (``recpipe.ranking.probe``) and the form
``auto`` would pick; and ``served, full item Gram``, the fp32 form over the full (ni, ni) item x item
Gram matrix (the CUDA forms' layout) instead of its upper triangle, and the same beside the compiled
segmented form (``served bf16 (torch.compile), full item Gram``, also in the ``--requests`` table). The
fp32 forms are checked to give the same scores before timing, each full-Gram twin of a compiled form
its own form's up to bf16 rounding; the lower precisions are reported against the bound, never asserted
(a form that breaks it is what ``auto`` skips).
``--requests N`` adds N requests as one batch (what a batched hop hands the stage) against the same N
one by one in each form: the time per request, and how far a score moved between the two.
``--idle-ms MS`` also times the served forward in each precision after MS of sleep before every call,
against the same calls back to back: what a stage pays when its queries come apart. The forms above are
timed warm, call after call, as a loaded stage runs them. On the 2-core EPYC VM (``--idle-ms 5``) the
bf16 forward of 1 x 500 took 0.84 ms back to back and 1.63 ms after 5 ms asleep (fp32 1.17 / 1.90,
int8 1.11 / 1.69), and 1.38-1.45 ms after 5 ms of spinning in Python instead of sleeping. So it is not
the idle core waking up; presumably what the forward left in the core (caches, predictors) is gone
meanwhile on this shared VM. Its compiled prepare part slowed most (0.34 to 0.72-0.93 ms), the one
matmul per user least, and the tables on 2-MB pages changed nothing. That is why a lone query's rank
compute in the chain (``recpipe querygen --mode sequential``: 1.77 ms p50) is about twice this
bench's p50.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recpipe.bench._args import at_least, require_dirs, within
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, DEFAULT_NUM_CANDIDATES, MAX_NUM_CANDIDATES
from recpipe.errors import UsageError

#: calls of one form in a row before the next form's (``measure_interleaved``)
BLOCK = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--batch", type=int, default=DEFAULT_NUM_CANDIDATES, help="candidates per call")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="auto|cpu|cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=1, metavar="N",
                        help="also time N requests as one batch (what a batched hop hands the stage) against "
                             "the same N one by one, in each precision, and how far their scores moved")
    parser.add_argument("--idle-ms", type=float, default=0.0, metavar="MS",
                        help="also time the served forward in each precision after MS of sleep before every "
                             "call, against the same calls back to back (0 = off; a stage between sparse "
                             "queries runs it cold)")


def run(args: argparse.Namespace) -> int:
    within(1, MAX_NUM_CANDIDATES, ("--batch", args.batch))
    at_least(1, ("--calls", args.calls), ("--requests", args.requests))
    at_least(0, ("--warmup", args.warmup), ("--threads", args.threads), ("--seed", args.seed))
    if not 0 <= args.idle_ms <= 1000:
        raise UsageError(f"--idle-ms must be in [0, 1000], got {args.idle_ms}")
    require_dirs(("--models", args.models), ("--data", args.data))
    from recpipe.serving import threads

    threads.configure(args.threads, torch=True)  # before Polars and torch size their pools
    import numpy as np
    import torch

    from recpipe.bench._timing import measure_interleaved, table
    from recpipe.features.core import FeatureCore
    from recpipe.ranking.core import RankingCore
    from recpipe.ranking.model import NaiveSparseArch, SparseArch

    features = FeatureCore.load(args.models, args.data)
    ranking = RankingCore.load(args.models, device=args.device)
    cuda = ranking.torch_device.type == "cuda"
    model = ranking.predictor.model
    naive_model = copy.deepcopy(model)
    if not isinstance(model.sparse_arch, SparseArch):
        raise UsageError("the trained model has no fused SparseArch to compare against")
    naive_model.sparse_arch = NaiveSparseArch.from_fused(model.sparse_arch).to(ranking.torch_device)
    naive_model.eval()

    rng = np.random.default_rng(args.seed)
    k = min(args.batch, features.num_items)
    n = args.calls + args.warmup
    requests = []
    for _ in range(min(n, 50)):
        uid = int(rng.integers(0, features.num_users))
        requests.append((features.augment_user(uid), features.augment_items(uid, rng.choice(features.num_items, k,
                                                                                             replace=False))))
    dev = ranking.torch_device

    def tensors(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        user, items = requests[i % len(requests)]
        dense = np.concatenate([np.repeat(user.dense[None], k, 0), items.dense], 1)
        sparse = np.concatenate([np.repeat(user.sparse[None], k, 0), items.sparse], 1)
        return torch.from_numpy(dense).to(dev), torch.from_numpy(sparse).to(dev)

    inputs = [tensors(i) for i in range(len(requests))]

    def plain(m: torch.nn.Module, i: int) -> np.ndarray:
        dense, sparse = inputs[i % len(inputs)]
        with torch.inference_mode():
            out = torch.sigmoid(m(dense, sparse)).float().cpu().numpy()
        return out

    def served(i: int) -> np.ndarray:
        user, items = requests[i % len(requests)]
        return ranking.rank(user, items)

    forms = [
        ("naive (60 EmbeddingBag calls)", lambda i: plain(naive_model, i)),
        ("fused lookup", lambda i: plain(model, i)),
        ("served (fused + user-side once)", served),
    ]
    low_forms: list[str] = []
    low_cores: dict[str, Any] = {}
    #: the compiled forms over the full item x item Gram matrix, and each one's served form by name
    full_gram: dict[str, Any] = {}
    twins: dict[str, str] = {}
    if not cuda:  # the served forward in every precision this CPU runs, side by side
        from recpipe.ranking import precision as precisions

        for form in precisions.available(ranking.torch_device):
            if form != "fp32":
                # every precision on purpose: the table says which break the bound, not a stage's warning
                core = RankingCore.load(args.models, device=args.device, precision=form, warn=False)
                forms.append((f"served {core.details['precision']}", _served_by(core, requests)))
                low_forms.append(forms[-1][0])
                low_cores[form] = core
                if core.predictor.segmented:  # its item x item triangle against the full Gram matrix
                    twin = full_gram[f"{form}, full item Gram"] = _full_gram_twin(core)
                    forms.append((f"served {core.details['precision']}, full item Gram", _served_by(twin, requests)))
                    twins[forms[-1][0]] = low_forms[-1]
    if ranking.predictor.gram_pairs:  # the eager CPU forward against the full item x item Gram matrix
        forms.append(("served, full item Gram", _served_by(_full_gram_twin(ranking), requests)))
    if cuda:  # the placements and graphs side by side (each core keeps its own copy of the weights)
        for name, core in (("served, no CUDA graphs", RankingCore.load(args.models, device=args.device,
                                                                      cuda_graphs=False)),
                           ("served, tables in host memory", RankingCore.load(args.models, device=args.device,
                                                                             embeddings="host"))):
            forms.append((name, _served_by(core, requests)))
    low_dp = {name: 0.0 for name in low_forms}
    for i in range(3):
        np.testing.assert_allclose(plain(naive_model, i), plain(model, i), rtol=1e-4, atol=1e-6)
        for name, fn in forms[2:]:
            if name in low_forms:  # bf16 / int8: held to the bound, checked at load and reported below
                low_dp[name] = max(low_dp[name], float(np.max(np.abs(fn(i) - plain(model, i)))))
            elif name in twins:  # the other layout of a compiled form: the same scores up to its rounding
                np.testing.assert_allclose(fn(i), dict(forms)[twins[name]](i), atol=2e-2)
            else:
                np.testing.assert_allclose(fn(i), plain(model, i), rtol=1e-4, atol=1e-5)
    print(f"ranking bench: {ranking.device}, torch threads {torch.get_num_threads()}, batch {k}, "
          f"{model.config.num_tables} tables ({sum(model.config.table_sizes):,} rows x {model.config.embedding_dim}), "
          f"{model.config.interaction} interaction, CUDA graphs {ranking.predictor.graphs}, "
          f"CPU {ranking.details['cpu_isa']}")
    if not cuda:
        print("tables in host memory (--embeddings host) and CUDA graphs: need a CUDA device, not timed here")
    timings = measure_interleaved(forms, args.calls, args.warmup, rows_per_call=k, block=BLOCK)
    print(table(timings, "naive (60 EmbeddingBag calls)"))
    if not cuda:
        _precision_table(args.models, timings, low_forms, ranking, low_cores, low_dp)
    if args.requests > 1:
        _batch_table({ranking.details["precision"]: ranking, **{c.details["precision"]: c for c in low_cores.values()},
                      **full_gram}, requests, args)
    if args.idle_ms:
        served_forms = [("fp32", served)] + [(name.removeprefix("served "), fn) for name, fn in forms
                                             if name in low_forms]
        _idle_table(served_forms, args)
    return 0


def _precision_table(models: Path, timings: list[Any], low_forms: list[str], ranking: Any,
                     low_cores: dict[str, Any], low_dp: dict[str, float]) -> None:
    """Each precision's served p50 against fp32's, with the held-out AUC ``recpipe train`` measured for
    it and its check against the bound at load (``recpipe.ranking.probe``): what ``auto`` weighs."""
    from recpipe.ranking import precision as precisions
    from recpipe.ranking import probe
    from recpipe.repository import Repository

    by_form = Repository.open(Path(models)).section("metrics").get("ranking_auc_by_precision") or {}
    fp32 = next(t for t in timings if t.name.startswith("served (fused"))
    rows = [("fp32", fp32, "")] + [(name.removeprefix("served ").split(" ")[0], t, name) for t in timings
                                   for name in low_forms if t.name == name]
    print(f"\n{'precision':<10} {'p50 ms':>8} {'vs fp32':>8} {'held-out AUC':>13} {'dAUC':>8} {'max |dp|':>9} "
          f"{'here':>7}  bound at load")
    best, best_ms = "fp32", fp32.pct_ms(50)
    for form, t, name in rows:
        a = by_form.get(form)
        delta = None if a is None or "fp32" not in by_form else a - by_form["fp32"]
        auc_text = "n/a" if a is None else f"{a:.5f}"
        delta_text = "n/a" if delta is None else f"{delta:+.5f}"
        check = low_cores[form].checks.get(form) if form in low_cores else None
        dp_text = "-" if check is None else f"{check.max_abs_dp:.4f}"
        here = f"{low_dp[name]:.4f}" if name in low_dp else "-"
        verdict = "(the reference)" if form == "fp32" else "n/a" if check is None else \
            ("within" if check.ok else "BREAKS") + f" (on {check.source})"
        print(f"{form:<10} {t.pct_ms(50):>8.3f} {fp32.pct_ms(50) / t.pct_ms(50):>7.2f}x {auc_text:>13} {delta_text:>8} "
              f"{dp_text:>9} {here:>7}  {verdict}")
        eligible = delta is not None and -delta <= precisions.AUC_BUDGET and (check is None or check.ok)
        if eligible and t.pct_ms(50) < best_ms:
            best, best_ms = form, t.pct_ms(50)
    print(f"the bound: max |dp| <= {probe.MAX_ABS_DP:g} on the probe rows and dAUC >= -{precisions.AUC_BUDGET:g} "
          "against fp32 (max |dp| is on the probe at load; 'here' is on this bench's requests)")
    if by_form:
        print(f"auto would pick: {best} (fastest here within the bound)")
    else:
        print("auto would pick: fp32 (the repository has no per-precision AUC: retrain to measure it)")


def _batch_table(cores: dict[str, Any], requests: list[Any], args: argparse.Namespace) -> None:
    """N requests as one ``rank_batch`` (a batched hop's RankBatch) against the same N one by one, per
    form, alternating: the time per request and the ratio; the scores must be the same."""
    n = args.requests
    print(f"\n{n} requests x {args.batch} candidates: one batch against one by one (ms per request, p50)")
    print(f"{'form':<26} {'one by one':>11} {'one batch':>10} {'batch/one':>10} {'max |dp|':>9}  forward")
    for name, core in cores.items():
        one, batch, dp = _one_and_batch(core, requests, n, args.calls, args.warmup)
        print(f"{name:<26} {one / n:>11.3f} {batch / n:>10.3f} {batch / one:>9.2f}x {dp:>9.2g}  "
              f"{core.details['batch_forward']}")
    print("max |dp|: the largest change of a score between a request alone and in the batch (0: the same)")


def _one_and_batch(core: Any, requests: list[Any], n: int, calls: int,
                   warmup: int) -> tuple[float, float, float]:
    """p50 ms of N requests one by one and as one batch, and the largest change of a score between them."""
    import numpy as np

    from recpipe.bench._timing import measure_interleaved
    from recpipe.ranking.contract import RankQuery

    queries = [RankQuery.checked(u.dense, u.sparse, it.dense, it.sparse, core.limits) for u, it in requests]

    def group(i: int) -> list[Any]:
        return [queries[(i * n + j) % len(queries)] for j in range(n)]

    alone = [core.rank_batch([q])[0] for q in group(0)]
    dp = max(float(np.max(np.abs(b - a))) for a, b in zip(alone, core.rank_batch(group(0)), strict=True))
    one, batch = measure_interleaved([("one", lambda i: [core.rank_batch([q]) for q in group(i)]),
                                      ("batch", lambda i: core.rank_batch(group(i)))], calls, warmup)
    return one.pct_ms(50), batch.pct_ms(50), dp


def _idle_table(forms: list[tuple[str, Callable[[int], Any]]], args: argparse.Namespace) -> None:
    """Each served form's p50 / p99 after ``--idle-ms`` of sleep before every call against the same calls
    back to back, the two alternating in blocks of ``BLOCK`` calls (the sleep untimed)."""
    from recpipe.bench._timing import measure_interleaved

    print(f"\nthe served forward after {args.idle_ms:g} ms asleep before each call, against back to back "
          f"({args.calls} calls each; ms)")
    print(f"{'precision':<22} {'back to back p50 / p99':>24} {'after idle p50 / p99':>22} {'idle/warm p50':>14}")
    for name, fn in forms:
        warm, idle = measure_interleaved([("back to back", fn), ("after idle", fn)], args.calls, args.warmup,
                                         block=BLOCK, sleep_s=(0.0, args.idle_ms / 1000))
        print(f"{name:<22} {warm.pct_ms(50):>13.3f} / {warm.pct_ms(99):<8.3f} {idle.pct_ms(50):>11.3f} / "
              f"{idle.pct_ms(99):<8.3f} {idle.pct_ms(50) / warm.pct_ms(50):>13.2f}x")


def _full_gram_twin(core: Any) -> Any:
    """A copy of ``core`` whose forward takes the full item x item Gram matrix instead of its upper
    triangle (``Predictor(full_gram=True)``, over the same weights), compiled where ``core``'s form is and
    warmed for the same buckets."""
    from recpipe.ranking.predictor import Predictor

    p = core.predictor
    twin = copy.copy(core)
    twin.predictor = Predictor(p.model, p.device, p.graphs, p.precision, full_gram=True)
    twin.predictor.set_user_tables(p.num_user_tables)
    twin.predictor.warm_buckets(core.max_users)
    return twin


def _served_by(core: Any, requests: list[Any]) -> Callable[[int], Any]:
    return lambda i: core.rank(*requests[i % len(requests)])

"""Candidate retrieval: the served index vs exact search at k = 100 and 500, and every index kind.

Three parts, the same users throughout, timed call by call alternating (``measure_interleaved``):

1. The served path (``RetrievalCore.retrieve``: user tower + the index and parameters chosen at train
   time) and exact FAISS flat search at each ``--k``, with the user tower timed alone (the folded
   numpy form the CPU stage serves, and the torch module it was folded from): the tower/search split.
2. Every index kind in ``--kinds`` (default all: flat, ivf, ivfsq8, ivfpqfs, hnsw) built over the
   repository's item embeddings and tuned as ``recpipe train`` tunes them (recall@500 >= ``--target``
   on other users), then searched alone at each k: build seconds, bytes, recall@k against exact on
   these users, p50/p99. Also the table ``recpipe train`` recorded (``index.json``'s ``tried``).
3. The recall@k of the half-precision exact search (fp16 and bf16 scans, with and without the fp32
   re-score of the top ``--rescore`` x k) against fp32 exact search; timed on a CUDA device only (on
   the CPU they are a correctness twin, not a fast path).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recpipe.bench._args import at_least, require_dirs, within
from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, MAX_NUM_CANDIDATES
from recpipe.errors import UsageError
from recpipe.retrieval.options import RetrievalOptions

KINDS = ("flat", "ivf", "ivfsq8", "ivfpqfs", "hnsw")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--k", default="100,500", help="candidates per query, comma-separated (default %(default)s)")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--kinds", default="all",
                        help="index kinds to build and time, comma-separated, 'all' or 'none' (default %(default)s)")
    parser.add_argument("--target", type=float, default=0.95, help="recall@500 the kinds are tuned to")
    parser.add_argument("--tune-queries", type=int, default=300, help="other users the kinds are tuned on")
    parser.add_argument("--device", default="cpu", help="auto|cpu|cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch and FAISS threads (0 = library default)")
    parser.add_argument("--seed", type=int, default=0)
    RetrievalOptions.add_arguments(parser, only=("rescore",))


def _parse(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    try:
        ks = [int(x) for x in str(args.k).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--k must be integers separated by commas, got {args.k!r}") from None
    if not ks:
        raise UsageError("--k must name at least one k")
    within(1, MAX_NUM_CANDIDATES, *(("--k", k) for k in ks))
    at_least(1, ("--queries", args.queries), ("--tune-queries", args.tune_queries))
    at_least(0, ("--warmup", args.warmup), ("--threads", args.threads), ("--seed", args.seed))
    RetrievalOptions(rescore=args.rescore)  # its own check (UsageError)
    if not 0 < args.target <= 1:
        raise UsageError(f"--target must be in (0, 1], got {args.target}")
    named = {"all": list(KINDS), "none": []}
    kinds = named[args.kinds] if args.kinds in named else [x.strip() for x in args.kinds.split(",")]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise UsageError(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}, all or none")
    require_dirs(("--models", args.models), ("--data", args.data))
    from recpipe.repository import Repository

    num_items = int(Repository.open(args.models).section("shapes")["num_items"])
    if max(ks) > num_items:
        raise UsageError(f"--k must be at most the index's {num_items} items, got {max(ks)}")
    return sorted(set(ks)), kinds


def run(args: argparse.Namespace) -> int:
    ks, kinds = _parse(args)
    from recpipe.serving import threads

    threads.configure(args.threads, torch=True, faiss=True)  # before Polars, torch and FAISS size their pools
    import faiss
    import numpy as np
    import torch

    from recpipe.bench._timing import measure_interleaved, table
    from recpipe.features.core import FeatureCore
    from recpipe.retrieval import index as faiss_index
    from recpipe.retrieval.core import RetrievalCore

    features = FeatureCore.load(args.models, args.data)
    retrieval = RetrievalCore.load(args.models, device=args.device)
    emb = retrieval.item_embeddings()
    flat = faiss.IndexFlatIP(emb.shape[1])
    flat.add(emb)
    rng = np.random.default_rng(args.seed)
    drawn = rng.integers(0, features.num_users, args.queries + args.warmup + args.tune_queries)
    users = [features.augment_user(int(u)) for u in drawn]
    tune_users, users = users[len(users) - args.tune_queries :], users[: len(users) - args.tune_queries]

    def tower(i: int) -> torch.Tensor:
        u = users[i]
        return retrieval.query_embeddings(u.dense[None], u.sparse[None])

    def torch_tower(i: int) -> torch.Tensor:
        u = users[i]
        with torch.inference_mode():
            return retrieval.tower(torch.as_tensor(u.dense[None], device=retrieval.torch_device),
                                   torch.as_tensor(u.sparse[None], device=retrieval.torch_device))

    queries = np.concatenate([tower(i).float().cpu().numpy() for i in range(len(users))])
    truth = {k: flat.search(queries[: args.queries], k)[1] for k in ks}
    d = retrieval.details
    print(f"retrieval bench: {retrieval.num_items:,} items x {emb.shape[1]}, k={','.join(map(str, ks))}, "
          f"{retrieval.device}, served index {d['index_type']} (nlist {d['nlist']}, nprobe {d['nprobe']}, "
          f"k_factor {d['k_factor']}, efSearch {d['ef_search']}), user tower {d['user_tower']}, "
          f"threads torch {torch.get_num_threads()} / faiss {faiss.omp_get_max_threads()}")

    # 1. the served path and its split
    def served_at(k: int) -> Callable[[int], object]:
        return lambda i: retrieval.retrieve(users[i], k).item_ids

    def exact_at(k: int) -> Callable[[int], object]:
        return lambda i: flat.search(tower(i).float().cpu().numpy(), k)[1][0]

    for k in ks:
        found = np.stack([retrieval.retrieve(users[i], k).item_ids for i in range(args.queries)])
        print(f"served recall@{k} vs exact on these queries: {faiss_index.recall(found, truth[k]):.4f}")
    forms: list[tuple[str, Callable[[int], object]]] = [
        (f"user tower ({d['user_tower']}, served)", tower), ("user tower (torch module)", torch_tower)]
    for k in ks:
        forms += [(f"exact (faiss flat) k={k}", exact_at(k)), (f"served index k={k}", served_at(k))]
    timings = measure_interleaved(forms, args.queries, args.warmup)
    print(table(timings, f"exact (faiss flat) k={ks[-1]}"))

    # 2. every index kind, search alone
    _trained_table(retrieval)
    if kinds:
        _kinds_table(kinds, emb, queries, args, ks, truth)

    # 3. half precision
    for precision in ("fp16", "bf16"):
        for rescore in sorted({0, args.rescore}):
            r = faiss_index.half_recall(emb, retrieval.torch_device, precision, rescore, ks[-1], queries)
            how = f"+ fp32 re-score of top {rescore}k" if rescore else "alone"
            print(f"{precision} exact search {how}: recall@{ks[-1]} vs fp32 exact {r:.4f}")
            if retrieval.torch_device.type == "cuda":
                half = faiss_index.TorchExactSearch(emb, retrieval.torch_device, precision, rescore)
                name = f"torch {precision}" + (f" + re-score x{rescore}" if rescore else "")
                print(table(measure_interleaved([(name, _searched_by(half, tower, ks[-1]))], args.queries,
                                                args.warmup), name))
    del tune_users
    return 0


def _trained_table(retrieval: Any) -> None:
    tried = retrieval.repo.json("retrieval/index.json").get("tried") or []
    if not tried:
        return
    print(f"recorded by `recpipe train` (its machine, tuned to recall@{tried[0].get('tuned_k', 100)}; "
          f"served: {retrieval.spec.kind}):")
    print(f"{'kind':<9} {'build s':>8} {'MB':>8} {'recall@100':>11} {'recall@500':>11} {'p50@100 ms':>11} "
          f"{'p50@500 ms':>11}")
    for s in tried:
        print(f"{s['kind']:<9} {s.get('build_s', 0):>8.1f} {s.get('index_bytes', 0) / 2**20:>8.1f} "
              f"{s.get('recall_at_100', 0):>11.4f} {s.get('recall_at_500', 0):>11.4f} "
              f"{s.get('search_ms_p50_at_100', 0):>11.3f} {s.get('search_ms_p50', 0):>11.3f}")


def _kinds_table(kinds: list[str], emb: Any, queries: Any, args: argparse.Namespace, ks: list[int],
                 truth: dict[int, Any]) -> None:
    from recpipe.bench._timing import measure_interleaved
    from recpipe.retrieval import index as faiss_index

    measured, tune_q = queries[: args.queries], queries[len(queries) - args.tune_queries :]
    built = []
    for kind in kinds:
        t0 = time.perf_counter()
        index, nlist = faiss_index.build(emb, kind, args.seed)
        build_s = time.perf_counter() - t0
        spec = faiss_index.tune(index, kind, nlist, emb, tune_q, args.target)
        built.append((kind, index, spec, build_s, faiss_index.index_bytes(index)))
        print(f"built {kind} in {build_s:.1f} s, tuned: nprobe {spec.nprobe} k_factor {spec.k_factor} "
              f"efSearch {spec.ef_search}", flush=True)

    def search(index: Any, spec: Any, k: int) -> Callable[[int], object]:
        def call(i: int) -> object:
            faiss_index.set_search_params(index, spec, k=k)
            return index.search(measured[i : i + 1], k)[1]
        return call

    print(f"index kinds, search alone (user tower excluded), tuned to recall@500 >= {args.target} on "
          f"{args.tune_queries} other users, recall vs exact on these {args.queries}:")
    print(f"{'kind':<9} {'params':<22} {'build s':>8} {'MB':>8} {'k':>5} {'recall':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for k in ks:
        forms = [(kind, search(index, spec, k)) for kind, index, spec, _, _ in built]
        timings = {t.name: t for t in measure_interleaved(forms, args.queries, args.warmup)}
        for kind, index, spec, build_s, nbytes in built:
            faiss_index.set_search_params(index, spec, k=k)
            r = faiss_index.recall(index.search(measured, k)[1], truth[k])
            params = {"ivf": f"nprobe {spec.nprobe}", "ivfsq8": f"nprobe {spec.nprobe}",
                      "ivfpqfs": f"nprobe {spec.nprobe} kf {spec.k_factor}",
                      "hnsw": f"efSearch {max(spec.ef_search, k)}"}.get(kind, "-")
            t = timings[kind]
            print(f"{kind:<9} {params:<22} {build_s:>8.1f} {nbytes / 2**20:>8.1f} {k:>5} {r:>8.4f} "
                  f"{t.pct_ms(50):>8.3f} {t.pct_ms(99):>8.3f}")


def _searched_by(search: Any, tower: Callable[[int], Any], k: int) -> Callable[[int], Any]:
    return lambda i: search.search(tower(i), k)[1][0]

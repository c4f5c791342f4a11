"""Candidate retrieval: the served (tuned) index vs exact flat search, user tower included in both.

Forms, same queries, alternating call by call: ``exact`` (FAISS IndexFlatIP over the item
embeddings), ``torch exact`` (matmul + topk, the CUDA backend when faiss has no GPU support), and
``served`` (``RetrievalCore.retrieve`` with the index and nprobe/efSearch chosen at train time).
Also prints the served index's recall@k against exact search on the same queries, and the recall@k
of the half-precision exact search (fp16 and bf16 scans, with and without the fp32 re-score of the top
``--rescore`` x k) against the fp32 exact search; on a CUDA device the half-precision searches are
timed too (on the CPU they are a correctness twin, not a fast path).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recpipe.config import (
    DEFAULT_DATA_DIR,
    DEFAULT_MODELS_DIR,
    DEFAULT_NUM_CANDIDATES,
)
from recpipe.errors import UsageError
from recpipe.retrieval.options import RetrievalOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--k", type=int, default=DEFAULT_NUM_CANDIDATES, help="candidates per query")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="auto|cpu|cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch and FAISS threads (0 = library default)")
    parser.add_argument("--seed", type=int, default=0)
    RetrievalOptions.add_arguments(parser, only=("rescore",))


def run(args: argparse.Namespace) -> int:
    if args.k < 1 or args.queries < 1 or args.warmup < 0 or args.threads < 0:
        raise UsageError("--k and --queries must be >= 1, --warmup and --threads >= 0")
    RetrievalOptions(rescore=args.rescore)  # its own check (UsageError)
    for path, what in ((args.models, "--models"), (args.data, "--data")):
        if not Path(path).is_dir():
            raise UsageError(f"{what} {path}: no such directory")
    import faiss
    import numpy as np
    import torch

    from recpipe.bench._timing import measure_interleaved, table
    from recpipe.features.core import FeatureCore
    from recpipe.retrieval import index as faiss_index
    from recpipe.retrieval.core import RetrievalCore

    if args.threads:
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    features = FeatureCore.load(args.models, args.data)
    retrieval = RetrievalCore.load(args.models, device=args.device)
    emb = retrieval.item_embeddings()
    flat = faiss.IndexFlatIP(emb.shape[1])
    flat.add(emb)
    exact_torch = faiss_index.TorchExactSearch(emb, retrieval.torch_device)
    k = min(args.k, features.num_items)
    rng = np.random.default_rng(args.seed)
    users = [features.augment_user(int(u)) for u in rng.integers(0, features.num_users, args.queries + args.warmup)]

    def tower(i: int) -> torch.Tensor:
        u = users[i]
        return retrieval.query_embeddings(u.dense[None], u.sparse[None])

    def exact(i: int) -> np.ndarray:
        return flat.search(tower(i).float().cpu().numpy(), k)[1][0]

    def exact_t(i: int) -> np.ndarray:
        return exact_torch.search(tower(i), k)[1][0]

    def served(i: int) -> np.ndarray:
        return retrieval.retrieve(users[i], k).item_ids

    found = np.stack([served(i) for i in range(args.queries)])
    truth = np.stack([exact(i) for i in range(args.queries)])
    d = retrieval.details
    print(f"retrieval bench: {retrieval.num_items:,} items x {emb.shape[1]}, k={k}, {retrieval.device}, "
          f"index {d['index_type']} (nlist {d['nlist']}, nprobe {d['nprobe']}, efSearch {d['ef_search']}), "
          f"threads torch {torch.get_num_threads()} / faiss {faiss.omp_get_max_threads()}")
    print(f"served recall@{k} vs exact on these queries: {faiss_index.recall(found, truth):.4f}")
    queries = np.concatenate([tower(i).float().cpu().numpy() for i in range(args.queries)])
    forms: list[tuple[str, Callable[[int], object]]] = [
        ("exact (faiss flat)", exact), ("exact (torch matmul+topk)", exact_t), ("served index", served)]
    for precision in ("fp16", "bf16"):
        for rescore in sorted({0, args.rescore}):
            r = faiss_index.half_recall(emb, retrieval.torch_device, precision, rescore, k, queries)
            how = f"+ fp32 re-score of top {rescore}k" if rescore else "alone"
            print(f"{precision} exact search {how}: recall@{k} vs fp32 exact {r:.4f}")
            if retrieval.torch_device.type == "cuda":
                half = faiss_index.TorchExactSearch(emb, retrieval.torch_device, precision, rescore)
                forms.append((f"torch {precision}" + (f" + re-score x{rescore}" if rescore else ""),
                              _searched_by(half, tower, k)))
    timings = measure_interleaved(forms, args.queries, args.warmup)
    print(table(timings, "exact (faiss flat)"))
    return 0


def _searched_by(search: Any, tower: Callable[[int], Any], k: int) -> Callable[[int], Any]:
    return lambda i: search.search(tower(i), k)[1][0]

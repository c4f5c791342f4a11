"""DLRM ranking of one user's candidates: fused embedding lookup vs one EmbeddingBag call per table.

Forms, same trained weights, same inputs, alternating call by call:
- ``naive``: the textbook DLRM forward with one ``nn.EmbeddingBag`` call per table (60 calls);
- ``fused``: the same forward with one lookup over all tables concatenated (per-table offsets);
- ``served``: what ``RankingCore.rank`` runs — the fused lookup plus the user-side work done once per
  request instead of once per candidate (on CUDA: replayed from a CUDA graph per bucketed shape).
On a CUDA device two more forms, side by side: ``served, no CUDA graphs`` (the same padded shapes run
eagerly) and ``served, tables in host memory`` (``--embeddings host``: the DLRM tables stay in pinned
host memory and the GPU reads the rows it needs over PCIe / NVLink-C2C instead of from HBM).
All forms are checked to give the same scores before timing.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recpipe.config import DEFAULT_DATA_DIR, DEFAULT_MODELS_DIR, DEFAULT_NUM_CANDIDATES
from recpipe.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path(DEFAULT_MODELS_DIR))
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--batch", type=int, default=DEFAULT_NUM_CANDIDATES, help="candidates per call")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="auto|cpu|cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.calls < 1 or args.warmup < 0 or args.threads < 0:
        raise UsageError("--batch and --calls must be >= 1, --warmup and --threads >= 0")
    for path, what in ((args.models, "--models"), (args.data, "--data")):
        if not Path(path).is_dir():
            raise UsageError(f"{what} {path}: no such directory")
    import numpy as np
    import torch

    from recpipe.bench._timing import measure_interleaved, table
    from recpipe.features.core import FeatureCore
    from recpipe.ranking.core import RankingCore
    from recpipe.ranking.model import NaiveSparseArch, SparseArch

    if args.threads:
        torch.set_num_threads(args.threads)
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
    if cuda:  # the placements and graphs side by side (each core keeps its own copy of the weights)
        for name, core in (("served, no CUDA graphs", RankingCore.load(args.models, device=args.device,
                                                                      cuda_graphs=False)),
                           ("served, tables in host memory", RankingCore.load(args.models, device=args.device,
                                                                             embeddings="host"))):
            forms.append((name, _served_by(core, requests)))
    for i in range(3):
        np.testing.assert_allclose(plain(naive_model, i), plain(model, i), rtol=1e-4, atol=1e-6)
        for _, fn in forms[2:]:
            np.testing.assert_allclose(fn(i), plain(model, i), rtol=1e-4, atol=1e-5)
    print(f"ranking bench: {ranking.device}, torch threads {torch.get_num_threads()}, batch {k}, "
          f"{model.config.num_tables} tables ({sum(model.config.table_sizes):,} rows x {model.config.embedding_dim}), "
          f"CUDA graphs {ranking.predictor.graphs}")
    if not cuda:
        print("tables in host memory (--embeddings host) and CUDA graphs: need a CUDA device, not timed here")
    timings = measure_interleaved(forms, args.calls, args.warmup, rows_per_call=k)
    print(table(timings, "naive (60 EmbeddingBag calls)"))
    return 0


def _served_by(core: Any, requests: list[Any]) -> Callable[[int], Any]:
    return lambda i: core.rank(*requests[i % len(requests)])

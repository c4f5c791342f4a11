"""Training settings, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

INDEX_CHOICES = ("auto", "flat", "ivf", "ivfsq8", "ivfpqfs", "hnsw")
#: the DLRM's validation share by interaction when none is given. The dot model trains on every row
#: and keeps its last epoch: the latest rows are the nearest to the held-out period, and the validation
#: AUC peaked before the held-out AUC did (scale 0.1: +0.0017 and +0.003 held-out AUC over holding a
#: tenth back). DCN's cross layers memorise from the second or third epoch on, so it keeps the latest
#: tenth back to stop early (8 epochs on every row: 0.7308 against 0.7677). BENCHMARKS.md, issue 23
VAL_FRACTION_AUTO = {"dot": 0.0, "dcn": 0.1}
#: the DLRM's planned epochs by interaction. Dot on every row: 8 (+0.0024 held-out AUC at scale 0.1
#: over 4). DCN stops early at 2 or 3; its cosine schedule over 8 planned epochs decays too slowly
#: for that (0.7643 against 0.7677 over 4)
RANKING_EPOCHS_AUTO = {"dot": 8, "dcn": 4}
#: FAISS's k-means seed (``ClusteringParameters.seed``) is a C int: a larger one failed the IVF build
#: with an OverflowError after both models had trained
MAX_SEED = 2**31 - 1
#: torch's thread pool segfaulted at 100,000 threads; no machine recpipe runs on has more than this
MAX_THREADS = 1024


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``recpipe train`` decides. ``epochs``, when set, applies to both models."""

    epochs: int | None = None
    #: defaults when ``epochs`` is not set. The DLRM's (None: ``RANKING_EPOCHS_AUTO`` by interaction) is
    #: a ceiling: ``ranking_row_budget`` cuts it to four epochs at full scale; with a validation split
    #: (``val_fraction``) training also stops early at the epoch after which the validation AUC stopped
    #: improving, keeping the best weights. The learning-rate schedule spans the planned epochs
    retrieval_epochs_default: int = 2
    ranking_epochs_default: int | None = None
    seed: int = 0
    device: str = "auto"
    index: str = "auto"
    history_len: int = 20
    max_vocab: int = 50_000
    embedding_dim: int = 16
    retrieval_dim: int = 64
    temperature: float = 0.05
    retrieval_batch: int = 1024
    retrieval_lr: float = 2e-3
    ranking_batch: int = 4096
    ranking_lr: float = 2e-3
    #: hidden widths of the DLRM's bottom MLPs (user and item dense -> embedding_dim); none: each is one
    #: linear map, so the user-item dot is a bilinear form of the two dense rows, which is learned
    #: faster and better than through ReLU layers (BENCHMARKS.md, issue 23)
    ranking_bottom_dims: tuple[int, ...] = ()
    #: the bottom layers learn this much faster than the top MLP: their vectors reach the click only
    #: through the pairwise dots and the top MLP's small first-layer weights
    ranking_bottom_lr: float = 5e-2
    #: the DLRM's embedding tables' learning rate. At the MLPs' rate they memorise the training rows
    #: within two epochs (train AUC 0.96, held-out falling); at 3e-5 they learned nothing that held:
    #: fixed at their start (random, zero, or exposure rows) the held-out AUC was the same or higher at
    #: every scale and seed tried, and a step is twice as fast (``fixed_tables``). See BENCHMARKS.md
    ranking_embedding_lr: float = 0.0
    #: DLRM tables with fewer training rows per embedding row than this stay at zero (they could only
    #: memorise; ``recpipe.training.tables``); 0 lets every table learn
    ranking_min_rows_per_id: float = 100.0
    #: start the leaf-category table from the users it was shown to (``recpipe.training.tables``)
    ranking_exposure_init: bool = True
    #: a wide part beside the DLRM (``recpipe.ranking.model.WideArch``, wide & deep): a logistic
    #: regression on the products of the user's latent-signal columns with the item's and with the
    #: leaf category's exposure vector, learning at ``ranking_wide_lr``. The deep part's user-item dot
    #: is one bilinear form of rank ``embedding_dim`` that its dense vectors share with every other
    #: dot; the wide part gives each product its own weight: +0.0044 held-out AUC at full scale,
    #: +0.003 at scale 0.1 (seeds 11 and 7), +0.009 for DCN. Over every profile column instead: even
    #: at 0.1, a little lower at full scale; over the whole dense rows (history counts included) it
    #: lost AUC. BENCHMARKS.md, issue 23
    ranking_wide: bool = True
    ranking_wide_lr: float = 1e-2
    #: the DLRM's learning rates over its planned epochs: "cosine" (down to 2% of the start) or "constant"
    ranking_lr_schedule: str = "cosine"
    #: the DLRM's training steps under bf16 autocast: None (default) on CUDA and on CPUs with native
    #: bf16 (AVX512-BF16 / AMX, read from /proc/cpuinfo: ``ATEN_CPU_CAPABILITY`` does not change it),
    #: where a step is ~2x faster at the same held-out AUC (BENCHMARKS.md); False keeps them in
    #: float32 on every machine, True asks for bf16 anyway (emulated, slower, without native support).
    #: Two runs compared weight for weight need False: bf16 rounds every product to 8 bits, and two
    #: equal computations ordered differently part within a few Adam steps (``loops.dlrm_autocast``)
    ranking_bf16: bool | None = None
    #: DLRM interaction: "dot" (DLRM v1) or "dcn" (DCNv2 low-rank cross layers, MLPerf DLRM-v2)
    interaction: str = "dot"
    #: the latest share of the training rows (by time) held back to choose the DLRM's epoch; None:
    #: ``VAL_FRACTION_AUTO`` by interaction (``val_fraction``). 0 trains on every row for the planned
    #: epochs and keeps the last
    ranking_val_fraction: float | None = None
    #: DLRM rows over all epochs at most: four epochs at full scale (1M rows an epoch), for the time
    #: budget. Held-out AUC there before the wide part (the same negatives every epoch): 0.7912 after
    #: three, 0.7927 after five, 0.7933 after eight; with fresh negatives 0.7931 after five and 0.7933
    #: after six. With the wide part: 0.79744 after four and after five, so four, a fifth of the DLRM's
    #: time back. Scale 0.1 (360k rows an epoch) is not cut. See BENCHMARKS.md, issue 23
    ranking_row_budget: int = 4_000_000
    #: where ``max_ranking_rows`` leaves negatives out (full scale: 640k of 3.2M an epoch), each epoch
    #: draws its own; the positives are the same every epoch (unless they alone exceed the cap). Five
    #: epochs at full scale then saw 2.5M distinct rows instead of 1M, at the same cost: +0.0003-0.0004
    #: held-out AUC (two training seeds). Where every row fits (scale 0.1) it changes nothing.
    #: BENCHMARKS.md, issue 23
    ranking_fresh_negatives: bool = True
    #: batches shrink on small data so that an epoch has at least this many optimiser steps
    min_steps: int = 200
    #: negatives kept per positive for DLRM training at most (the rest are dropped, the kept ones
    #: up-weighted): 20 keeps them all at synth-data's click rates (about 10 per positive) until the
    #: row cap below binds, as it does at full scale. 3 lost 0.002 held-out AUC at scale 0.1
    negatives_per_positive: float = 20.0
    #: cap on DLRM training rows per epoch (uniform subsample beyond it), for the time budget
    max_ranking_rows: int = 1_000_000
    #: cap on two-tower training pairs (clicks) per epoch
    max_retrieval_rows: int = 400_000
    #: held-out rows scored for ranking_auc (uniform subsample beyond it)
    max_eval_rows: int = 200_000
    #: held-out rows (of those above) scored by the served forward in each precision: paired AUC deltas
    max_precision_rows: int = 100_000
    #: validation rows scored after each DLRM epoch (and half as many training rows, for train AUC)
    max_val_rows: int = 60_000
    #: users sampled for the recall@500 metrics and for tuning the index
    eval_users: int = 2000
    index_queries: int = 500
    index_recall_target: float = 0.95
    #: torch intra-op threads for training (0 = auto, see ``threads.training_threads``)
    threads: int = 0
    progress: bool = False

    @property
    def retrieval_epochs(self) -> int:
        return self.epochs or self.retrieval_epochs_default

    @property
    def ranking_epochs(self) -> int:
        return self.epochs or self.ranking_epochs_default or RANKING_EPOCHS_AUTO[self.interaction]

    @property
    def val_fraction(self) -> float:
        """The DLRM's validation share: ``ranking_val_fraction``, or the interaction's default."""
        if self.ranking_val_fraction is not None:
            return self.ranking_val_fraction
        return VAL_FRACTION_AUTO[self.interaction]

    def __post_init__(self) -> None:
        if self.epochs is not None and self.epochs < 1:
            raise ValueError("epochs must be >= 1")
        if self.index not in INDEX_CHOICES:
            raise ValueError(f"index must be one of {', '.join(INDEX_CHOICES)}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads must be in 0..{MAX_THREADS}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..{MAX_SEED}")
        if self.history_len < 0 or self.max_vocab < 2:
            raise ValueError("history_len must be >= 0 and max_vocab >= 2")
        if self.interaction not in ("dot", "dcn"):
            raise ValueError("interaction must be dot or dcn")
        if self.ranking_lr_schedule not in ("cosine", "constant"):
            raise ValueError("ranking_lr_schedule must be cosine or constant")
        if self.ranking_embedding_lr < 0:
            raise ValueError("ranking_embedding_lr must be >= 0")
        if self.ranking_wide_lr < 0:
            raise ValueError("ranking_wide_lr must be >= 0")
        if self.ranking_min_rows_per_id < 0:
            raise ValueError("ranking_min_rows_per_id must be >= 0")
        if self.ranking_val_fraction is not None and not 0 <= self.ranking_val_fraction < 0.5:
            raise ValueError("ranking_val_fraction must be in [0, 0.5)")
        if not 0 < self.index_recall_target <= 1:
            raise ValueError("index_recall_target must be in (0, 1]")

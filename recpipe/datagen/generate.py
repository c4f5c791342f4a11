"""Generate a whole dataset: world -> feature tables and interactions -> oracle -> manifest.

Work is cut into independent tasks (a block of users or items, a day of interactions, a chunk of
oracle users), run by two worker threads (NumPy and the Parquet encoder release the GIL), while this
thread writes each file's pieces strictly in order: the bytes do not depend on scheduling. The
held-out days are generated first so that the oracle runs alongside the rest.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recpipe import __version__, schema
from recpipe.datagen import features, oracle
from recpipe.datagen.blas import single_threaded_blas
from recpipe.datagen.click_model import DEFAULT_MODEL, ClickModel
from recpipe.datagen.config import DatagenConfig
from recpipe.datagen.interactions import DayBatch, InteractionSampler
from recpipe.datagen.manifest import dataset_sha256
from recpipe.datagen.world import World, blocks, make_world, serially
from recpipe.datagen.writer import MANIFEST_NAME, DatasetDir, TableFile

DAYS = 90
RECALL_K = 500
RECALL_MAX_USERS = 500
WORKERS = 2
#: Pieces of one file generated ahead of its writer (bounds memory: a day at --scale 10 is ~20 MB).
LOOKAHEAD = 3


class _Progress:
    """A tqdm bar (updated by the writing thread only), or nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="synth-data", unit="piece", leave=False)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Stream:
    """One output file: its pieces are made by the pool (or already submitted) and written here in order."""

    def __init__(self, file: TableFile, makers: list[Callable[[], Any] | Future[Any]],
                 write: Callable[[TableFile, Any], None]) -> None:
        self.file = file
        self.makers = deque(makers)
        self.pending: deque[Future[Any]] = deque()
        self.write = write

    @property
    def done(self) -> bool:
        return not self.makers and not self.pending


class _InteractionLog:
    """Running statistics over the interactions as they are written, and the held-out rows."""

    def __init__(self, world: World, sampler: InteractionSampler) -> None:
        self.n = int(sampler.day_start[-1])
        self.n_hold = min(self.n, round(self.n * schema.HOLDOUT_FRACTION))
        self.train_rows = self.n - self.n_hold
        self.day_start = sampler.day_start
        self.item_counts = np.zeros(world.items.n, np.int64)
        self.user_seen = np.zeros(world.users.n, bool)
        self.clicks = 0
        self.first_ts: int | None = None
        self.last_ts: int | None = None

    @property
    def holdout_days(self) -> list[int]:
        if self.n_hold == 0:
            return []
        first = int(np.searchsorted(self.day_start, self.train_rows, side="right")) - 1
        return list(range(first, len(self.day_start) - 1))

    def holdout_part(self, batch: DayBatch) -> tuple[np.ndarray, ...]:
        """(user, item, label, p_click, timestamp) of the batch's held-out rows."""
        skip = max(0, self.train_rows - int(self.day_start[batch.day]))
        return (batch.user_id[skip:], batch.item_id[skip:], batch.label[skip:], batch.p_click[skip:],
                batch.timestamp[skip:])

    def write(self, file: TableFile, batch: DayBatch) -> None:
        file.write(pa.Table.from_arrays([batch.user_id, batch.item_id, batch.label, batch.timestamp],
                                        names=schema.INTERACTIONS.column_names))
        self.item_counts += np.bincount(batch.item_id, minlength=self.item_counts.shape[0])
        self.user_seen[batch.user_id] = True
        self.clicks += int(batch.label.sum())
        if batch.timestamp.shape[0]:
            self.first_ts = int(batch.timestamp[0]) if self.first_ts is None else self.first_ts
            self.last_ts = int(batch.timestamp[-1])

    def stats(self) -> dict[str, Any]:
        top1 = max(1, self.item_counts.shape[0] // 100)
        counts = np.sort(self.item_counts)[::-1]
        return {
            "click_rate": self.clicks / max(1, self.n),
            "top1pct_item_share": float(counts[:top1].sum() / max(1, self.n)),
            "top500_item_share": float(counts[:500].sum() / max(1, self.n)),
            "items_with_interactions": int((self.item_counts > 0).sum()),
            "users_with_interactions": int(self.user_seen.sum()),
            "first_timestamp": self.first_ts,
            "last_timestamp": self.last_ts,
        }


def rebuild_world(manifest: dict[str, Any], model: ClickModel = DEFAULT_MODEL) -> World:
    """The hidden world a dataset was generated from, rebuilt from its manifest's scale and seed (the
    same bytes as the generator's: every draw is keyed by seed and block, not by thread)."""
    return make_world(DatagenConfig(scale=float(manifest["scale"]), seed=int(manifest["seed"])), model, DAYS, serially)


def write_dataset(cfg: DatagenConfig, out: Path, model: ClickModel = DEFAULT_MODEL,
                  progress: bool = False) -> dict[str, Any]:
    """Write the three tables and the manifest into the existing directory ``out``; returns the manifest."""
    with single_threaded_blas():
        return _write_dataset(cfg, out, model, progress)


def _write_dataset(cfg: DatagenConfig, out: Path, model: ClickModel, progress: bool) -> dict[str, Any]:
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="datagen")

    def each(fn: Callable[[int, int, int], None], bl: list[tuple[int, int]]) -> None:
        for f in [pool.submit(fn, b, lo, hi) for b, (lo, hi) in enumerate(bl)]:
            f.result()

    try:
        world = make_world(cfg, model, DAYS, each)
        return _write_files(cfg, out, world, pool, progress)
    finally:
        # on an error or Ctrl-C, drop the queued pieces instead of generating them for nothing
        pool.shutdown(wait=True, cancel_futures=True)


def _write_files(cfg: DatagenConfig, out: Path, world: World, pool: ThreadPoolExecutor,
                 progress: bool) -> dict[str, Any]:
    sampler = InteractionSampler(world, cfg.n_interactions, DAYS)
    log = _InteractionLog(world, sampler)
    user_blocks, item_blocks = blocks(world.users.n), blocks(world.items.n)
    bar = _Progress(len(user_blocks) + len(item_blocks) + DAYS, progress)
    files = {t.name: TableFile(out / schema.TABLE_FILES[t.name], t) for t in schema.TABLES}

    def write_table(file: TableFile, data: pa.Table) -> None:
        file.write(data)

    try:
        with files["users"], files["items"], files["interactions"]:
            # held-out days first, so that the oracle can start while the rest is generated
            early = {d: pool.submit(sampler.day, d) for d in log.holdout_days}

            days: list[Callable[[], Any] | Future[Any]] = [early.get(d) or partial(sampler.day, d)
                                                           for d in range(DAYS)]
            streams = [
                _Stream(files["users"], [partial(features.user_block, world, b, lo, hi)
                                         for b, (lo, hi) in enumerate(user_blocks)], write_table),
                _Stream(files["items"], [partial(features.item_block, world, b, lo, hi)
                                         for b, (lo, hi) in enumerate(item_blocks)], write_table),
                _Stream(files["interactions"], days, log.write),
            ]
            orc = _OracleTasks(world, log, early, pool)
            while not all(s.done for s in streams) or not orc.done:
                for s in streams:
                    while s.makers and len(s.pending) < LOOKAHEAD:
                        m = s.makers.popleft()
                        s.pending.append(m if isinstance(m, Future) else pool.submit(m))
                orc.advance()
                # only unfinished oracle futures: a finished one would make wait() return at once and
                # spin this loop, starving the workers of the GIL (measured: 3x slower at scale 1)
                heads = [s.pending[0] for s in streams if s.pending] + [f for f in orc.pending if not f.done()]
                wait(heads, return_when=FIRST_COMPLETED)
                for s in streams:
                    while s.pending and s.pending[0].done():
                        s.write(s.file, s.pending.popleft().result())
                        bar.update()
    finally:
        bar.close()
    manifest: dict[str, Any] = {
        "schema_version": schema.SCHEMA_VERSION,
        "generator": f"recpipe.datagen {__version__}",
        "seed": cfg.seed,
        "scale": cfg.scale,
        "rows": {"users": world.users.n, "items": world.items.n, "interactions": log.n},
        "files": dict(schema.TABLE_FILES),
        "sha256": {f.path.name: f.sha256 for f in sorted(files.values(), key=lambda f: f.path.name)},
        "cardinalities": {
            t.name: {c.name: c.cardinality_at(cfg.scale) for c in t.categorical} for t in (schema.USERS, schema.ITEMS)
        },
        "stats": log.stats(),
        "split": {
            "holdout_fraction": schema.HOLDOUT_FRACTION,
            "train_rows": log.train_rows,
            "holdout_rows": log.n_hold,
            "holdout_start_timestamp": orc.holdout_start_timestamp,
        },
        "oracle": orc.result(),
    }
    manifest["dataset_sha256"] = dataset_sha256(manifest)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


class _OracleTasks:
    """The oracle as a small chain of pool tasks: held-out days -> scorer -> chunks of users."""

    def __init__(self, world: World, log: _InteractionLog, days: dict[int, Future[DayBatch]],
                 pool: ThreadPoolExecutor) -> None:
        self.world, self.log, self.days, self.pool = world, log, days, pool
        self.pending: list[Future[Any]] = list(days.values())
        self.stage = "days"
        self.auc: float | None = None
        self.holdout_click_rate: float | None = None
        self.holdout_start_timestamp: int | None = None
        self.recall: oracle.RecallOracle | None = None
        self._hits: list[Future[int]] = []

    @property
    def done(self) -> bool:
        return self.stage == "done"

    def advance(self) -> None:
        if self.stage == "days" and all(f.done() for f in self.days.values()):
            parts = [self.log.holdout_part(self.days[d].result()) for d in sorted(self.days)]
            user, item, label, p, ts = (np.concatenate([x[i] for x in parts]) if parts else np.empty(0)
                                        for i in range(5))
            self.auc = oracle.auc(p, label)
            if label.shape[0]:
                self.holdout_click_rate = float(label.mean())
                self.holdout_start_timestamp = int(ts[0])
            self.recall = oracle.RecallOracle(self.world, user.astype(np.int64), item.astype(np.int64), label,
                                              RECALL_K, RECALL_MAX_USERS)
            self.pending = [self.pool.submit(self.recall.prepare)]
            self.stage = "prepare"
        elif self.stage == "prepare" and self.pending[0].done():
            assert self.recall is not None
            self.pending[0].result()
            self._hits = [self.pool.submit(self.recall.hits, c) for c in self.recall.chunks(4 * WORKERS)]
            self.pending = list(self._hits)
            self.stage = "hits"
        elif self.stage == "hits" and all(f.done() for f in self._hits):
            self.pending = []
            self.stage = "done"

    def result(self) -> dict[str, Any]:
        assert self.recall is not None
        rec = self.recall.result(sum(f.result() for f in self._hits))
        return {
            "auc": self.auc,
            f"recall_at_{RECALL_K}": rec.recall,
            "recall_users": rec.users,
            "recall_clicks": rec.clicks,
            "holdout_click_rate": self.holdout_click_rate,
        }


def generate(cfg: DatagenConfig, out: str | Path, *, force: bool = False, progress: bool = False,
             model: ClickModel = DEFAULT_MODEL) -> dict[str, Any]:
    """Generate the dataset into ``out`` atomically (see ``DatasetDir``); returns the manifest."""
    with DatasetDir(Path(out), force) as tmp:
        return write_dataset(cfg, tmp, model, progress)

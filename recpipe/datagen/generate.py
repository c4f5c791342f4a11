"""Generate a whole dataset: world -> feature tables and interactions (two threads) -> oracle -> manifest."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recpipe import __version__, schema
from recpipe.datagen import features, oracle
from recpipe.datagen.click_model import DEFAULT_MODEL, ClickModel
from recpipe.datagen.config import DatagenConfig
from recpipe.datagen.interactions import InteractionSampler
from recpipe.datagen.manifest import dataset_sha256, sha256_file
from recpipe.datagen.world import World, blocks, make_world
from recpipe.datagen.writer import MANIFEST_NAME, DatasetDir, open_writer, write_table

DAYS = 90
RECALL_K = 500
RECALL_MAX_USERS = 500


class _Progress:
    """A tqdm bar shared by the writer threads, or nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        self._lock = threading.Lock()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="synth-data", unit="block", leave=False)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _write_features(world: World, out: Path, progress: _Progress) -> dict[str, str]:
    sums = {}
    for table, make, n in ((schema.USERS, features.user_block, world.users.n),
                           (schema.ITEMS, features.item_block, world.items.n)):
        path = out / schema.TABLE_FILES[table.name]
        with open_writer(path, table) as writer:
            for b, (lo, hi) in enumerate(blocks(n)):
                write_table(writer, make(world, b, lo, hi))
                progress.update()
        sums[path.name] = sha256_file(path)
    return sums


def _write_interactions(world: World, sampler: InteractionSampler, out: Path,
                        progress: _Progress) -> tuple[dict[str, str], dict[str, Any]]:
    n = int(sampler.day_start[-1])
    n_hold = min(n, round(n * schema.HOLDOUT_FRACTION))
    n_train = n - n_hold
    item_counts = np.zeros(world.items.n, np.int64)
    user_seen = np.zeros(world.users.n, bool)
    clicks = 0
    hold: dict[str, list[np.ndarray]] = {"user": [], "item": [], "label": [], "p": [], "ts": []}
    first_ts = last_ts = None
    path = out / schema.TABLE_FILES["interactions"]
    with open_writer(path, schema.INTERACTIONS) as writer:
        for d in range(sampler.days):
            batch = sampler.day(d)
            write_table(writer, pa.Table.from_arrays(
                [batch.user_id, batch.item_id, batch.label, batch.timestamp],
                names=schema.INTERACTIONS.column_names))
            item_counts += np.bincount(batch.item_id, minlength=world.items.n)
            user_seen[batch.user_id] = True
            clicks += int(batch.label.sum())
            if batch.timestamp.shape[0]:
                first_ts = int(batch.timestamp[0]) if first_ts is None else first_ts
                last_ts = int(batch.timestamp[-1])
            skip = max(0, n_train - int(sampler.day_start[d]))
            if skip < batch.timestamp.shape[0]:
                hold["user"].append(batch.user_id[skip:])
                hold["item"].append(batch.item_id[skip:])
                hold["label"].append(batch.label[skip:])
                hold["p"].append(batch.p_click[skip:])
                hold["ts"].append(batch.timestamp[skip:])
            progress.update()
    sums = {path.name: sha256_file(path)}
    h = {k: np.concatenate(v) for k, v in hold.items()}
    top1 = max(1, world.items.n // 100)
    counts = np.sort(item_counts)[::-1]
    stats = {
        "click_rate": clicks / max(1, n),
        "top1pct_item_share": float(counts[:top1].sum() / max(1, n)),
        "top500_item_share": float(counts[:500].sum() / max(1, n)),
        "items_with_interactions": int((item_counts > 0).sum()),
        "users_with_interactions": int(user_seen.sum()),
        "first_timestamp": first_ts,
        "last_timestamp": last_ts,
    }
    split = {
        "holdout_fraction": schema.HOLDOUT_FRACTION,
        "train_rows": n_train,
        "holdout_rows": n_hold,
        "holdout_start_timestamp": int(h["ts"][0]) if n_hold else None,
    }
    a = oracle.auc(h["p"], h["label"])
    rec = oracle.recall_at_k(world, h["user"], h["item"], h["label"], k=RECALL_K, max_users=RECALL_MAX_USERS)
    orc = {
        "auc": a,
        f"recall_at_{RECALL_K}": rec.recall,
        "recall_users": rec.users,
        "recall_clicks": rec.clicks,
        "holdout_click_rate": float(h["label"].mean()) if n_hold else None,
    }
    return sums, {"stats": stats, "split": split, "oracle": orc}


def write_dataset(cfg: DatagenConfig, out: Path, model: ClickModel = DEFAULT_MODEL,
                  progress: bool = False) -> dict[str, Any]:
    """Write the three tables and the manifest into the existing directory ``out``; returns the manifest."""
    world = make_world(cfg, model, DAYS)
    sampler = InteractionSampler(world, cfg.n_interactions, DAYS)
    bar = _Progress(len(blocks(world.users.n)) + len(blocks(world.items.n)) + DAYS, progress)
    try:
        # two threads: numpy and the Parquet encoder release the GIL, and each stream of bytes is
        # produced by one thread in a fixed order, so the output does not depend on scheduling
        with ThreadPoolExecutor(max_workers=2) as pool:
            feat = pool.submit(_write_features, world, out, bar)
            inter = pool.submit(_write_interactions, world, sampler, out, bar)
            sums = feat.result()
            inter_sums, parts = inter.result()
    finally:
        bar.close()
    sums.update(inter_sums)
    manifest: dict[str, Any] = {
        "schema_version": schema.SCHEMA_VERSION,
        "generator": f"recpipe.datagen {__version__}",
        "seed": cfg.seed,
        "scale": cfg.scale,
        "rows": {"users": world.users.n, "items": world.items.n, "interactions": int(sampler.day_start[-1])},
        "files": dict(schema.TABLE_FILES),
        "sha256": dict(sorted(sums.items())),
        "cardinalities": {
            t.name: {c.name: c.cardinality_at(cfg.scale) for c in t.categorical} for t in (schema.USERS, schema.ITEMS)
        },
        **parts,
    }
    manifest["dataset_sha256"] = dataset_sha256(manifest)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def generate(cfg: DatagenConfig, out: str | Path, *, force: bool = False, progress: bool = False,
             model: ClickModel = DEFAULT_MODEL) -> dict[str, Any]:
    """Generate the dataset into ``out`` atomically (see ``DatasetDir``); returns the manifest."""
    with DatasetDir(Path(out), force) as tmp:
        return write_dataset(cfg, tmp, model, progress)

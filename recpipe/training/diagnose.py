"""Where the ranking AUC is lost against the oracle: the click logit's terms on the held-out rows.

The generator's click logit is ``u·v`` (scaled) + quality + preferred-category match + bias
(``recpipe.datagen.click_model``). This rebuilds the generator's hidden world from the dataset's
scale and seed, computes each term for the held-out rows, and reports each term's AUC alone, its
correlation with the trained DLRM's logit, and a least-squares fit of that logit on the three
terms: a coefficient well below the others' says the model carries that term only in part.
``--ceiling`` adds what the features allow (``recpipe.training.ceiling``): the held-out AUC of the
click logit's terms with the latent vectors read from the rows a model sees, beside the DLRM's; and
what the DLRM misses: its logit stacked with one such term, or with a history vector, at a time.

    python -m recpipe.training.diagnose --data DATA --models MODELS [--rows 100000] [--ceiling]

A measuring tool for model work, not part of training or serving; it reads the datagen internals.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recpipe.training.diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=100_000, help="held-out rows sampled at most")
    parser.add_argument("--ceiling", action="store_true",
                        help="also fit the feature ceilings on every training row (minutes at full scale)")
    args = parser.parse_args(argv)
    from recpipe.serving.threads import torch_threads

    with torch_threads(1):  # and the caller's count back after: main is also called in-process (tests)
        return _diagnose(args)


def _diagnose(args: argparse.Namespace) -> int:
    import polars as pl
    import torch

    from recpipe.datagen.generate import rebuild_world
    from recpipe.datagen.manifest import verify
    from recpipe.features.core import FeatureCore, read_tables
    from recpipe.ranking import artifacts
    from recpipe.repository import Repository
    from recpipe.timesplit import split_by_time
    from recpipe.training import loops
    from recpipe.training.metrics import auc

    manifest = verify(args.data)
    world = rebuild_world(manifest)
    user_rows, item_rows, interactions = read_tables(args.data)
    train, hold = split_by_time(interactions)
    if hold.height > args.rows:
        hold = hold.sample(args.rows, seed=0)
    u, i, y = (hold[c].to_numpy() for c in ("user_id", "item_id", "label"))
    m, users, items = world.model, world.users, world.items
    v = items.v(0, items.n)
    terms = {
        "u.v": np.einsum("nd,nd->n", users.u[u].astype(np.float64), v[i].astype(np.float64))
        * m.affinity / np.sqrt(m.latent_dim),
        "quality": items.q[i].astype(np.float64) * m.quality,
        "match": (items.cat[i] == users.pref[u]).astype(np.float64) * m.match,
    }
    truth = sum(terms.values())
    repo = Repository.open(args.models)
    model = artifacts.load_model(repo, artifacts.load_config(repo)).eval()
    core = FeatureCore.load(args.models, args.data)
    p = np.clip(loops.score_dlrm(model, core, u, i, torch.device("cpu")).astype(np.float64), 1e-7, 1 - 1e-7)
    logit = np.log(p / (1 - p))
    print(f"held-out rows {len(y)}: oracle AUC {auc(y, truth):.4f}, DLRM AUC {auc(y, logit):.4f} "
          f"({model.config.interaction} interaction)")
    for name, t in terms.items():
        print(f"  {name:8s} std {t.std():.3f}  AUC alone {auc(y, t):.4f}  corr with the DLRM logit "
              f"{np.corrcoef(t, logit)[0, 1]:+.3f}")
    x = np.stack([*terms.values(), np.ones_like(truth)], 1)
    coef = np.linalg.lstsq(x, logit, rcond=None)[0]
    resid = logit - x @ coef
    print("  DLRM logit ~ " + " + ".join(f"{c:.2f} {n}" for c, n in zip(coef, terms, strict=False))
          + f" (+ const): R^2 {1 - resid.var() / logit.var():.3f} (the truth: 1.00 each)")
    print(f"  corr(DLRM logit, true logit) {np.corrcoef(truth, logit)[0, 1]:.3f}; "
          f"mean predicted p {p.mean():.4f} vs click rate {y.mean():.4f}")
    if args.ceiling:
        from recpipe.training.ceiling import Latents, ceilings, stacked

        print("what the features allow (logistic regression on the logit's terms, fitted on the training "
              "rows; held-out AUC):")

        def dense_rows(frame: pl.DataFrame, training: bool) -> np.ndarray:
            counts = core.training_counts(frame) if training else None
            us, its = frame["user_id"].to_numpy(), frame["item_id"].to_numpy()
            return loops.ranking_batch(core, us, its, counts)[0].astype(np.float64)

        latents = Latents(world, user_rows, item_rows)
        for name, value in ceilings(world, user_rows, item_rows, train, hold, dense_rows, latents=latents).items():
            print(f"  {name:48s} {value:.4f}")
        print(f"  {'the DLRM':48s} {auc(y, logit):.4f}")
        print("what the DLRM misses (its logit + one term, fitted on half of the held-out rows, scored on "
              "the other half):")
        for name, value in stacked(world, user_rows, item_rows, train, hold, logit, latents=latents).items():
            print(f"  {name:48s} {value:.4f}")
        clicks = train["label"].to_numpy()
        for side, size, ids in (("item", world.items.n, i), ("user", world.users.n, u)):
            per = np.bincount(train[f"{side}_id"].to_numpy(), weights=clicks, minlength=size)[ids]
            p50, p90 = np.percentile(per, [50, 90])
            print(f"  training clicks on the held-out row's {side}: median {p50:.0f}, p90 {p90:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the features allow: held-out AUC ceilings for a ranking model of this data (issue 23).

The generator's click logit is ``affinity * u·v / sqrt(K) + quality * q + match * [cat == pref] + bias``
(``recpipe.datagen.click_model``). A model sees neither ``u`` nor ``v``: the user's row holds 32 noisy
projections of ``u``, the item's row 12 noisy projections of ``v``, and ``v`` is the leaf category's
vector + a brand vector + noise. Each ceiling below is a logistic regression on that logit's terms
with the latent vectors replaced by their best linear read-out from what a model can see, fitted on
the training rows and scored on the held-out rows. The read-outs are fitted on the hidden world
itself and the category vectors are the true ones, so a model that has to learn them from clicks is
not expected to reach these figures. They bound linear read-outs of the rows; they prove nothing about
every possible model:

- ``truth``: the true terms (the oracle, up to the fit of three coefficients);
- ``ratings for quality``: ``q`` replaced by the two rating columns that carry it;
- ``user read from its row``: also ``u`` -> a linear map of the user's signal columns;
- ``+ category vector + item row``: also ``v`` -> the true leaf-category vector + a linear map of the
  item's signal columns less that vector's projection (the brand and the item's own noise stay unknown);
- ``+ category vector only``: ``v`` -> the true leaf-category vector.

With a feature core, one more: ``category vector + item row + DLRM dense inputs`` adds the DLRM's
dense inputs (the history counts included: strictly earlier ones for the training rows, as in training)
as linear terms beside the fourth ceiling's, which is how much those inputs add on top of it.

``stacked`` asks the converse: what a trained model misses. On the held-out rows, it fits a logistic
regression on the model's logit plus one term, on half of them, and scores the other half; a term
that lifts that AUC above the logit's alone carries something the model does not. The terms dot the
user's read-out with, in turn: the true category vector; ``v`` as read from the item's own row;
``v`` as read from that row and the item's tag column (``TAG``, an id a model could learn a vector
for); the item's row's read-out plus the 4 dimensions of the category vector the item's row never shows (learnable only per
category, from clicks); that plus the same 4 dimensions of the brand vector (per brand); and the true
``v``. Two more swap the user's side: the true ``u`` dotted with ``v`` as read from the item's row
(what a perfect view of the user would add), and the user's own history vector. The last three are
history vectors a model could be given from the training split (visible columns and labels only):
the user's click-weighted mean item row (what the ``recent_items`` the feature stage serves could
carry), and the item's and its leaf category's click-weighted mean user row.

Used by ``python -m recpipe.training.diagnose --ceiling``; reads the generator's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from recpipe.training.metrics import auc

if TYPE_CHECKING:
    from recpipe.datagen.world import World

USER_SIGNALS = tuple(f"u_cont_{j:02d}" for j in range(8, 40))
ITEM_SIGNALS = tuple(f"i_cont_{j:02d}" for j in range(8, 20))
RATINGS = ("i_cont_02", "i_cont_07")
#: the item column that is the argmax of its latent vector over random directions (for 60% of items)
TAG = "i_cat_15"


def _columns(frame: pl.DataFrame, names: tuple[str, ...]) -> np.ndarray:
    """(n, len(names)) float64, nulls as the column's mean."""
    x = frame.select(list(names)).to_numpy().astype(np.float64)
    means = np.nanmean(np.where(np.isfinite(x), x, np.nan), axis=0)
    return np.where(np.isfinite(x), x, np.nan_to_num(means)[None, :])


def read_out(x: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least-squares linear map (with intercept) of ``x`` onto ``target``, applied to ``x``."""
    x1 = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    coef = np.linalg.lstsq(x1, target, rcond=None)[0]
    return np.asarray(x1 @ coef)


def logistic_auc(x_fit: np.ndarray, y_fit: np.ndarray, x_eval: np.ndarray, y_eval: np.ndarray) -> float:
    """Held-out AUC of a logistic regression (standardised inputs, L-BFGS) fitted on (x_fit, y_fit)."""
    import torch

    mean, std = x_fit.mean(0), x_fit.std(0) + 1e-9
    xf = torch.tensor((x_fit - mean) / std, dtype=torch.float64)
    yf = torch.tensor(y_fit, dtype=torch.float64)
    w = torch.zeros(xf.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xf @ w + b, yf)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        scores = ((x_eval - mean) / std) @ w.numpy() + float(b)
    return auc(y_eval, scores)


#: (frame, is the training split) -> the DLRM's dense inputs for the frame's rows
DenseRows = Callable[[pl.DataFrame, bool], np.ndarray]


class Latents:
    """The hidden vectors and their read-outs from the visible rows, for every user and item."""

    def __init__(self, world: World, users: pl.DataFrame, items: pl.DataFrame) -> None:
        p = world.params
        self.scale = world.model.affinity / np.sqrt(world.model.latent_dim)
        self.v = world.items.v(0, world.items.n).astype(np.float64)
        self.u = world.users.u.astype(np.float64)
        self.u_seen = read_out(_columns(users, USER_SIGNALS), self.u)
        self.v_cat = p.cat_vec[world.items.cat].astype(np.float64)
        signals = _columns(items, ITEM_SIGNALS)
        item_rest = signals - self.v_cat @ p.item_proj
        #: the part of v - v_cat the item's signal columns reveal
        self.v_row = read_out(item_rest, self.v - self.v_cat)
        #: v as read from the item's own signal columns alone (12 noisy projections of its 16 dimensions)
        self.v_obs = read_out(signals, self.v)
        #: ... and from its tag as well (``TAG``: for most items the nearest of a few random directions in
        #: the latent space, so it says a little about the brand and the item's own noise too)
        tag = items[TAG].to_numpy().astype(np.int64)
        self.v_tagged = read_out(np.concatenate([signals, np.eye(int(tag.max()) + 1)[tag]], axis=1), self.v)
        proj = p.item_proj.astype(np.float64)
        #: projects a vector onto the 4 dimensions the item's signal columns never show
        self.hidden = np.eye(proj.shape[0]) - proj @ np.linalg.pinv(proj)
        self.brand = world.model.brand_weight * p.brand_vec.astype(np.float64)[world.items.brand]


def ceilings(world: World, users: pl.DataFrame, items: pl.DataFrame, train: pl.DataFrame,
             holdout: pl.DataFrame, dense_rows: DenseRows | None = None,
             latents: Latents | None = None) -> dict[str, float]:
    """{ceiling name: held-out AUC}, in the order of the module docstring; the last only with
    ``dense_rows``. ``latents``: the world's ``Latents`` when the caller has them already."""
    w_users, w_items = world.users, world.items
    lat = latents or Latents(world, users, items)
    scale, u, v, u_seen, v_cat = lat.scale, lat.u, lat.v, lat.u_seen, lat.v_cat
    v_seen = v_cat + lat.v_row
    ratings = _columns(items, RATINGS)
    q = w_items.q.astype(np.float64)[:, None]

    def terms(frame: pl.DataFrame, uu: np.ndarray, vv: np.ndarray, quality: np.ndarray) -> np.ndarray:
        us, its = frame["user_id"].to_numpy(), frame["item_id"].to_numpy()
        dot = scale * np.einsum("nd,nd->n", uu[us], vv[its])
        match = (w_items.cat[its] == w_users.pref[us]).astype(np.float64)
        return np.column_stack([dot, quality[its], match])

    variants = {
        "truth": (u, v, q),
        "ratings for quality": (u, v, ratings),
        "user read from its row": (u_seen, v, ratings),
        "+ category vector + item row": (u_seen, v_seen, ratings),
        "+ category vector only": (u_seen, v_cat, ratings),
    }
    y_fit, y_eval = train["label"].to_numpy(), holdout["label"].to_numpy()
    out = {name: logistic_auc(terms(train, uu, vv, qq), y_fit, terms(holdout, uu, vv, qq), y_eval)
           for name, (uu, vv, qq) in variants.items()}
    if dense_rows is not None:
        fit = np.concatenate([terms(train, u_seen, v_seen, ratings), dense_rows(train, True)], axis=1)
        held = np.concatenate([terms(holdout, u_seen, v_seen, ratings), dense_rows(holdout, False)], axis=1)
        out["category vector + item row + DLRM dense inputs"] = logistic_auc(fit, y_fit, held, y_eval)
    return out


def _standardised(frame: pl.DataFrame, names: tuple[str, ...]) -> np.ndarray:
    x = _columns(frame, names)
    return np.asarray((x - x.mean(0)) / (x.std(0) + 1e-9))


def user_signals(users: pl.DataFrame) -> np.ndarray:
    """(num_users, 32) the users' signal columns, standardised."""
    return _standardised(users, USER_SIGNALS)


def item_signals(items: pl.DataFrame) -> np.ndarray:
    """(num_items, 12) the items' signal columns, standardised."""
    return _standardised(items, ITEM_SIGNALS)


def history_vectors(signals: np.ndarray, train: pl.DataFrame, keys: np.ndarray, size: int,
                    prior: float = 50.0, source: str = "user_id") -> np.ndarray:
    """(size, D): per key, the training rows' click residual times the other side's row of ``signals``
    (``user_signals`` indexed by the rows' ``source`` column, or ``item_signals`` with ``source``
    "item_id"), summed and shrunk by ``prior`` pseudo-rows; row k of the training split has key
    ``keys[k]``. The residual is taken against the key's own click rate, so the vector says who clicks
    (or what is clicked), not how often."""
    other, y = train[source].to_numpy(), train["label"].to_numpy().astype(np.float64)
    n = np.bincount(keys, minlength=size).astype(np.float64)
    rate = np.bincount(keys, weights=y, minlength=size) / np.maximum(n, 1.0)
    r = y - rate[keys]
    # one column at a time: the training rows' (n, D) gather would be ~1 GB at full scale
    sums = np.stack([np.bincount(keys, weights=r * signals[other, c], minlength=size)
                     for c in range(signals.shape[1])], axis=1)
    return np.asarray(sums / (n + prior)[:, None])


def stacked(world: World, users: pl.DataFrame, items: pl.DataFrame, train: pl.DataFrame,
            holdout: pl.DataFrame, logit: np.ndarray, seed: int = 1,
            latents: Latents | None = None) -> dict[str, float]:
    """{"the model": AUC, "+ term": AUC, ...}: the model's held-out ``logit`` alone and with each term,
    each fitted on a random half of the held-out rows and scored on the other half."""
    lat = latents or Latents(world, users, items)
    us, its = holdout["user_id"].to_numpy(), holdout["item_id"].to_numpy()
    y = holdout["label"].to_numpy()
    x = user_signals(users)
    whiten = np.linalg.inv(np.cov(x, rowvar=False))
    leaf = world.items.cat.astype(np.int64)
    t_items = train["item_id"].to_numpy()
    by_item = history_vectors(x, train, t_items, world.items.n)
    by_leaf = history_vectors(x, train, leaf[t_items], int(leaf.max()) + 1)

    def dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(np.einsum("nd,nd->n", a, b))

    xi = item_signals(items)
    by_user = history_vectors(xi, train, train["user_id"].to_numpy(), world.users.n, prior=5.0, source="item_id")
    i_white = xi[its] @ np.linalg.inv(np.cov(xi, rowvar=False))
    u_white, u_seen = x[us] @ whiten, lat.u_seen[us]
    v_obs = lat.v_obs[its]
    cat_hidden = lat.v_cat[its] @ lat.hidden
    brand_hidden = lat.brand[its] @ lat.hidden
    terms = {
        "+ u_seen . true category vector": dot(u_seen, lat.v_cat[its]),
        "+ u_seen . v read from the item's row": dot(u_seen, v_obs),
        "+ u_seen . v read from the item's row and tag": dot(u_seen, lat.v_tagged[its]),
        "+ u_seen . (that + category's hidden dims)": dot(u_seen, v_obs + cat_hidden),
        "+ u_seen . (that + brand's hidden dims)": dot(u_seen, v_obs + cat_hidden + brand_hidden),
        "+ u_seen . v": dot(u_seen, lat.v[its]),
        "+ true u . v read from the item's row": dot(lat.u[us], v_obs),
        "+ user's history vector . item row": dot(by_user[us], i_white),
        "+ user row . item's history vector": dot(u_white, by_item[its]),
        "+ user row . leaf's history vector": dot(u_white, by_leaf[leaf[its]]),
    }
    half = np.random.default_rng(seed).random(len(y)) < 0.5

    def fit(*cols: np.ndarray) -> float:
        z = np.column_stack([logit, *cols])
        return logistic_auc(z[half], y[half], z[~half], y[~half])

    return {"the model": fit(), **{name: fit(t) for name, t in terms.items()}}

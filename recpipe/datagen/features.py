"""Observable feature tables: noisy functions of the hidden world, one block of rows at a time.

The latent vectors reach the tables only through noisy linear projections (the "latent signal"
columns), category/cluster ids and a few semantically tied columns (rating ~ quality, review count ~
popularity, sessions ~ activity), so a model can learn them but never read them off.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from recpipe import schema
from recpipe.datagen.world import S_ITEM_FEATURES, S_USER_FEATURES, World, rng_for, uniform_noise


def _skewed(rng: np.random.Generator, n: int, card: int, power: float = 2.0) -> np.ndarray:
    """Values 0..card-1 with a power-law-like skew towards small values (a few common, a long tail)."""
    return np.minimum((card * rng.random(n) ** power).astype(np.int32), card - 1)


def _nullable(rng: np.random.Generator, values: np.ndarray, rate: float) -> pa.Array:
    arr = values.astype(np.float32, copy=False)
    if rate <= 0.0:
        return pa.array(arr)
    return pa.array(arr, mask=rng.random(arr.shape[0]) < rate)


def _finish(table: schema.Table, cols: dict[str, np.ndarray], rng: np.random.Generator) -> pa.Table:
    """Arrow table in schema order and dtypes, with nulls drawn at each column's null_rate."""
    arrays = []
    for c in table.columns:
        v = cols[c.name]
        if c.kind is schema.Kind.CONTINUOUS:
            arrays.append(_nullable(rng, v, c.null_rate))
        else:
            arrays.append(pa.array(v.astype(c.dtype, copy=False)))
    return pa.Table.from_arrays(arrays, names=table.column_names)


def item_block(world: World, block: int, lo: int, hi: int) -> pa.Table:
    p, it = world.params, world.items
    rng = rng_for(world.cfg.seed, S_ITEM_FEATURES, block)
    n = hi - lo
    cat, brand, shop = it.cat[lo:hi], it.brand[lo:hi], it.shop[lo:hi]
    v, q, w = it.v(lo, hi).astype(np.float64), it.q[lo:hi].astype(np.float64), it.w[lo:hi]
    top = p.cat_top[cat]
    card = {c.name: world.cfg.cardinality(schema.ITEMS, c.name) for c in schema.ITEMS.categorical}

    log_price = p.cat_log_price[cat] + 0.15 * q + rng.normal(0.0, 0.6, n)
    promoted = np.minimum((rng.random(n) ** 4 * 3).astype(np.int32), 2)
    ship_class = _skewed(rng, n, card["i_cat_12"], 1.5)
    signal = v @ p.item_proj + 0.25 * uniform_noise(rng, (n, 12))
    cols: dict[str, np.ndarray] = {
        "item_id": np.arange(lo, hi, dtype=np.int64),
        "i_cont_00": np.round(np.exp(log_price), 2),
        "i_cont_01": np.floor(np.exp(rng.normal(3.0, 1.5, n))),
        "i_cont_02": np.clip(np.round(4.0 + 0.45 * q + rng.normal(0.0, 0.2, n), 1), 1.0, 5.0),
        "i_cont_03": np.floor(3.0 * w * np.exp(rng.normal(0.0, 0.5, n))),
        "i_cont_04": np.clip(rng.beta(2.0, 8.0, n) + 0.1 * promoted, 0.0, 0.9),
        "i_cont_05": np.floor(np.exp(rng.normal(4.5, 1.2, n))),
        "i_cont_06": 1.0 + (ship_class % 5) + rng.poisson(1.0, n),
        "i_cont_07": np.clip(4.2 + 0.3 * q + rng.normal(0.0, 0.4, n), 0.0, 5.0),
    }
    for j in range(12):
        cols[f"i_cont_{8 + j:02d}"] = signal[:, j]
    # price bands at fixed log-price cut points, so a band means the same price range at every scale
    band = np.digitize(log_price, np.linspace(1.5, 5.0, card["i_cat_04"] - 1)).astype(np.int32)
    cols.update({
        "i_cat_00": cat,
        "i_cat_01": top,
        "i_cat_02": brand,
        "i_cat_03": shop,
        "i_cat_04": band,
        "i_cat_05": _skewed(rng, n, card["i_cat_05"], 1.5),
        "i_cat_06": (top * 3 + _skewed(rng, n, 4, 2.0)) % card["i_cat_06"],
        "i_cat_07": _skewed(rng, n, card["i_cat_07"], 4.0),
        "i_cat_08": _skewed(rng, n, card["i_cat_08"], 3.0),
        "i_cat_09": (top * 7 + _skewed(rng, n, 5, 2.0)) % card["i_cat_09"],
        "i_cat_10": rng.integers(0, card["i_cat_10"], n),
        "i_cat_11": rng.integers(0, card["i_cat_11"], n),
        "i_cat_12": ship_class,
        "i_cat_13": promoted,
        "i_cat_14": (shop % card["i_cat_14"]).astype(np.int32),
        # weakly informative: for 60% of items the nearest of 40 random directions in latent space
        "i_cat_15": np.where(rng.random(n) < 0.6, np.argmax(v @ p.tag_dirs, axis=1),
                             rng.integers(0, p.tag_dirs.shape[1], n)),
    })
    return _finish(schema.ITEMS, cols, rng)


def user_block(world: World, block: int, lo: int, hi: int) -> pa.Table:
    p, us = world.params, world.users
    rng = rng_for(world.cfg.seed, S_USER_FEATURES, block)
    n = hi - lo
    fine, pref = us.fine[lo:hi], us.pref[lo:hi]
    u, act = us.u[lo:hi].astype(np.float64), us.activity[lo:hi]
    card = {c.name: world.cfg.cardinality(schema.USERS, c.name) for c in schema.USERS.categorical}
    cluster = p.fine_parent[fine]

    age = np.clip(rng.normal(36.0, 11.0, n), 16.0, 85.0)
    log_spend = np.log(act) + rng.normal(4.0, 0.8, n)
    level = np.digitize(log_spend, [3.2, 4.0, 4.8]).astype(np.int32)
    orders = rng.poisson(3.0 * act)
    city = _skewed(rng, n, card["u_cat_04"], 2.5)
    discount = rng.beta(2.0, 5.0, n)
    signal = u @ p.user_proj + 0.25 * uniform_noise(rng, (n, 32))
    cols: dict[str, np.ndarray] = {
        "user_id": np.arange(lo, hi, dtype=np.int64),
        "u_cont_00": np.floor(age),
        "u_cont_01": np.floor(np.exp(rng.normal(6.0, 1.0, n))),
        "u_cont_02": np.round(np.exp(log_spend), 2),
        "u_cont_03": orders.astype(np.float64),
        "u_cont_04": act * np.exp(rng.normal(1.0, 0.4, n)),
        "u_cont_05": np.round(np.exp(log_spend) / (orders + 1.0), 2),
        "u_cont_06": discount,
        "u_cont_07": rng.beta(1.0, 12.0, n),
    }
    for j in range(32):
        cols[f"u_cont_{8 + j:02d}"] = signal[:, j]

    def noisy(base: np.ndarray, name: str, keep: float) -> np.ndarray:
        """``base`` for a share ``keep`` of users, uniform noise for the rest."""
        return np.where(rng.random(n) < keep, base % card[name], rng.integers(0, card[name], n))

    brand_lo, brand_hi = p.brand_lo[pref], p.brand_hi[pref]
    fav_brand = brand_lo + ((brand_hi - brand_lo) * rng.random(n) ** 2).astype(np.int64)
    shop_lo, shop_hi = p.shop_lo[fav_brand], p.shop_hi[fav_brand]
    cols.update({
        "u_cat_00": level,
        "u_cat_01": np.digitize(rng.random(n), [0.48, 0.96]),
        "u_cat_02": np.digitize(age, [18, 25, 30, 35, 40, 50, 60]),
        "u_cat_03": np.minimum(city // 80, card["u_cat_03"] - 1),
        "u_cat_04": city,
        "u_cat_05": p.city_province[city],
        "u_cat_06": _skewed(rng, n, card["u_cat_06"], 1.5),
        "u_cat_07": _skewed(rng, n, card["u_cat_07"], 1.5),
        "u_cat_08": _skewed(rng, n, card["u_cat_08"], 1.5),
        "u_cat_09": _skewed(rng, n, card["u_cat_09"], 2.0),
        "u_cat_10": p.cat_top[pref],
        "u_cat_11": pref,
        "u_cat_12": noisy(level + (act > 3.0), "u_cat_12", 0.7),
        "u_cat_13": np.searchsorted(np.cumsum(p.hour_weights), rng.random(n) * 0.999999, side="right"),
        "u_cat_14": rng.integers(0, card["u_cat_14"], n),
        "u_cat_15": _skewed(rng, n, card["u_cat_15"], 2.0),
        "u_cat_16": _skewed(rng, n, card["u_cat_16"], 3.0),
        "u_cat_17": np.zeros(n),  # filled below from the device model
        "u_cat_18": _skewed(rng, n, card["u_cat_18"], 2.0),
        "u_cat_19": _skewed(rng, n, card["u_cat_19"], 1.5),
        "u_cat_20": _skewed(rng, n, card["u_cat_20"], 2.0),
        "u_cat_21": noisy(2 * level + rng.integers(0, 2, n), "u_cat_21", 0.6),
        "u_cat_22": cluster,
        "u_cat_23": fine,
        "u_cat_24": noisy(cluster, "u_cat_24", 0.5),
        "u_cat_25": np.digitize(act, [0.6, 1.8]),
        "u_cat_26": _skewed(rng, n, card["u_cat_26"], 3.0),
        "u_cat_27": np.minimum((discount * card["u_cat_27"] * 1.6).astype(np.int64), card["u_cat_27"] - 1),
        "u_cat_28": _skewed(rng, n, card["u_cat_28"], 1.5),
        "u_cat_29": rng.integers(0, card["u_cat_29"], n),
        # the user vocabularies are smaller than the item ones: bucket neighbouring brand/shop ids (which
        # belong to the same category), so the link to the preferred category survives
        "u_cat_30": fav_brand * card["u_cat_30"] // p.n_brands,
        "u_cat_31": (shop_lo + ((shop_hi - shop_lo) * rng.random(n)).astype(np.int64)) * card["u_cat_31"]
        // p.n_shops,
        "u_cat_32": rng.integers(0, card["u_cat_32"], n),
        "u_cat_33": _skewed(rng, n, card["u_cat_33"], 0.7),
        "u_cat_34": _skewed(rng, n, card["u_cat_34"], 2.0),
        "u_cat_35": rng.integers(0, card["u_cat_35"], n),
        "u_cat_36": _skewed(rng, n, card["u_cat_36"], 1.5),
        "u_cat_37": _skewed(rng, n, card["u_cat_37"], 2.0),
        "u_cat_38": noisy(cluster, "u_cat_38", 0.4),
        "u_cat_39": (city + _skewed(rng, n, 3, 1.0)) % card["u_cat_39"],
        "u_cat_40": noisy(level * 2, "u_cat_40", 0.5),
        "u_cat_41": rng.integers(0, card["u_cat_41"], n),
        "u_cat_42": (np.exp(log_spend) > 400.0) & (rng.random(n) < 0.8),
        "u_cat_43": _skewed(rng, n, card["u_cat_43"], 3.0),
    })
    cols["u_cat_17"] = cols["u_cat_16"] % card["u_cat_17"]
    return _finish(schema.USERS, cols, rng)

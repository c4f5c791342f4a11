"""The hidden state of the synthetic world: category and cluster vectors, user and item latents.

Every random draw comes from a PCG64 stream keyed by (seed, stream, block): blocks are fixed-size row
ranges (``BLOCK_ROWS``) or days, so the bytes do not depend on threads or on how work is batched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recpipe import schema
from recpipe.datagen.click_model import ClickModel
from recpipe.datagen.config import DatagenConfig
from recpipe.datagen.sampling import PackedTable, table_from_weights, take_rows

BLOCK_ROWS = 1 << 16
#: Stream ids for ``rng_for``; never renumber (it would change every dataset).
S_PARAMS, S_ITEMS, S_USERS, S_ITEM_FEATURES, S_USER_FEATURES, S_DAYS, S_DAY_COUNTS, S_ORACLE = range(8)
def rng_for(seed: int, stream: int, block: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream, block))))


def blocks(n: int, size: int = BLOCK_ROWS) -> list[tuple[int, int]]:
    return [(s, min(n, s + size)) for s in range(0, n, size)]


#: Runs ``fn(b, lo, hi)`` for each block ``b`` = (lo, hi); blocks write disjoint slices, so any order works.
Each = Callable[[Callable[[int, int, int], None], list[tuple[int, int]]], None]


def serially(fn: Callable[[int, int, int], None], bl: list[tuple[int, int]]) -> None:
    for b, (lo, hi) in enumerate(bl):
        fn(b, lo, hi)


def uniform_noise(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 noise with mean 0 and variance 1: uniform, which is several times cheaper to draw than normal."""
    x = rng.random(shape, dtype=np.float32)
    x -= np.float32(0.5)
    x *= np.float32(np.sqrt(12.0))
    return x


def zipf_probs(n: int, exponent: float, offset: float, rng: np.random.Generator) -> np.ndarray:
    """Zipf-like probabilities over ``n`` values, assigned to values in random order."""
    p = 1.0 / (np.arange(n, dtype=np.float64) + offset) ** exponent
    p = p[rng.permutation(n)]
    return p / p.sum()


def _cover(n_parents: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """A parent for each of ``n`` children such that every parent has at least one child (n >= parents)."""
    parent = np.concatenate([np.arange(n_parents), rng.integers(0, n_parents, n - n_parents)])
    return rng.permutation(parent).astype(np.int32)


def _ranges(cum_share: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Split 0..n-1 into contiguous ranges by cumulative share; every range holds at least one value."""
    lo = np.minimum(np.floor(np.concatenate([[0.0], cum_share[:-1]]) * n).astype(np.int64), n - 1)
    hi = np.maximum(lo + 1, np.minimum(np.floor(cum_share * n).astype(np.int64), n))
    return lo, hi


@dataclass
class Params:
    """Global latent structure, drawn once from the params stream."""

    k: int
    n_cat: int
    n_top: int
    cat_top: np.ndarray  # (n_cat,) int32: leaf -> top-level category
    cat_probs: np.ndarray  # (n_cat,) share of items per leaf category
    cat_vec: np.ndarray  # (n_cat, k) float32
    cat_log_price: np.ndarray  # (n_cat,) mean log price
    n_clusters: int
    n_fine: int
    fine_parent: np.ndarray  # (n_fine,) int32
    fine_probs: np.ndarray  # (n_fine,)
    taste: np.ndarray  # (n_fine, k) float32: cluster + fine cluster vector
    n_brands: int
    n_shops: int
    brand_vec: np.ndarray  # (n_brands, k) float32
    brand_lo: np.ndarray  # (n_cat,) brands of leaf c are brand_lo[c]..brand_hi[c]-1
    brand_hi: np.ndarray
    shop_lo: np.ndarray  # (n_brands,) shops of brand b are shop_lo[b]..shop_hi[b]-1
    shop_hi: np.ndarray
    item_proj: np.ndarray  # (k, 12) latent -> item "latent signal" columns
    user_proj: np.ndarray  # (k, 32) latent -> user "latent signal" columns
    tag_dirs: np.ndarray  # (k, n_tags) item tag cluster = argmax of v · tag_dirs
    day_weights: np.ndarray  # (days,) share of interactions per day
    hour_weights: np.ndarray  # (24,) share of interactions per hour of day
    city_province: np.ndarray  # (n_city,) int32 province of each city


def make_params(cfg: DatagenConfig, model: ClickModel, days: int) -> Params:
    rng = rng_for(cfg.seed, S_PARAMS)
    k = model.latent_dim
    items, users = schema.ITEMS, schema.USERS
    n_cat = cfg.cardinality(items, "i_cat_00")
    n_top = cfg.cardinality(items, "i_cat_01")
    cat_top = _cover(n_top, n_cat, rng)
    cat_probs = zipf_probs(n_cat, 1.0, 5.0, rng)
    top_vec = rng.standard_normal((n_top, k))
    cat_vec = model.category_top_weight * top_vec[cat_top] + model.category_leaf_weight * rng.standard_normal((n_cat, k))
    # equal norms: otherwise the longest category vectors are near every taste (hubs) and the same few
    # categories top every user's list, which makes global popularity an unrealistically good recommender
    cat_vec *= np.sqrt(k) / np.linalg.norm(cat_vec, axis=1, keepdims=True)
    cat_vec = cat_vec.astype(np.float32)
    top_price = rng.normal(3.2, 0.8, n_top)
    cat_log_price = top_price[cat_top] + rng.normal(0.0, 0.5, n_cat)

    n_clusters = cfg.cardinality(users, "u_cat_22")
    n_fine = cfg.cardinality(users, "u_cat_23")
    fine_parent = _cover(n_clusters, n_fine, rng)
    fine_probs = zipf_probs(n_fine, 0.8, 3.0, rng)
    cluster_vec = rng.standard_normal((n_clusters, k))
    taste = (model.cluster_weight * cluster_vec[fine_parent]
             + model.fine_weight * rng.standard_normal((n_fine, k))).astype(np.float32)

    n_brands = cfg.cardinality(items, "i_cat_02")
    n_shops = cfg.cardinality(items, "i_cat_03")
    brand_vec = rng.standard_normal((n_brands, k), dtype=np.float32)
    brand_lo, brand_hi = _ranges(np.cumsum(cat_probs), n_brands)
    shop_lo, shop_hi = _ranges(np.arange(1, n_brands + 1) / n_brands, n_shops)

    item_proj = rng.standard_normal((k, 12)) / np.sqrt(k)
    user_proj = rng.standard_normal((k, 32)) / np.sqrt(k)
    tag_dirs = rng.standard_normal((k, items.column("i_cat_15").cardinality))

    day = np.arange(days)
    weekday = (day + 3) % 7  # day 0 is a Thursday (2024-01-04)
    day_w = (1.0 + 0.25 * (weekday >= 5)) * (1.0 + 0.3 * day / max(1, days - 1))
    hour = np.arange(24)
    hour_w = 0.25 + np.exp(-0.5 * ((hour - 20.5) / 3.0) ** 2) + 0.5 * np.exp(-0.5 * ((hour - 12.5) / 2.0) ** 2)
    city_province = _cover(cfg.cardinality(users, "u_cat_05"), cfg.cardinality(users, "u_cat_04"), rng)
    return Params(
        k=k, n_cat=n_cat, n_top=n_top, cat_top=cat_top, cat_probs=cat_probs, cat_vec=cat_vec,
        cat_log_price=cat_log_price, n_clusters=n_clusters, n_fine=n_fine, fine_parent=fine_parent,
        fine_probs=fine_probs, taste=taste, n_brands=n_brands, n_shops=n_shops, brand_vec=brand_vec,
        brand_lo=brand_lo, brand_hi=brand_hi, shop_lo=shop_lo, shop_hi=shop_hi, item_proj=item_proj,
        user_proj=user_proj, tag_dirs=tag_dirs, day_weights=day_w / day_w.sum(), hour_weights=hour_w / hour_w.sum(),
        city_province=city_province,
    )


@dataclass
class Items:
    """Latent item state, indexed by item id, and by *position*: items sorted by category, then by
    popularity descending (the layout that sampling and the oracle read)."""

    cat: np.ndarray  # (n,) int32 leaf category
    brand: np.ndarray  # (n,) int32
    shop: np.ndarray  # (n,) int32
    q: np.ndarray  # (n,) float32 quality
    w: np.ndarray  # (n,) float64 popularity weight
    order: np.ndarray  # (n,) int64 item id at each position
    rank: np.ndarray  # (n,) int64 position of each item id
    cat_start: np.ndarray  # (n_cat + 1,) int64: category c holds positions cat_start[c]:cat_start[c+1]
    cat_weight: np.ndarray  # (n_cat,) summed popularity W_c
    v_pos: np.ndarray  # (n, k) float32 latent vectors by position (the only copy: they are large)
    q_pos: np.ndarray  # (n,) float32 quality by position
    cat_pos: np.ndarray  # (n,) int32 category by position
    table: PackedTable  # popularity within each category, by position

    @property
    def n(self) -> int:
        return int(self.cat.shape[0])

    def v(self, lo: int, hi: int) -> np.ndarray:
        """Latent vectors of item ids lo..hi-1."""
        return take_rows(self.v_pos, self.rank[lo:hi])


def make_items(cfg: DatagenConfig, model: ClickModel, p: Params, each: Each = serially) -> Items:
    n = cfg.n_items
    cat = np.empty(n, np.int32)
    brand = np.empty(n, np.int32)
    shop = np.empty(n, np.int32)
    v = np.empty((n, p.k), np.float32)
    q = np.empty(n, np.float32)
    w = np.empty(n, np.float64)
    cum_cat = np.cumsum(p.cat_probs)

    def block(b: int, lo: int, hi: int) -> None:
        rng = rng_for(cfg.seed, S_ITEMS, b)
        m = hi - lo
        c = np.minimum(np.searchsorted(cum_cat, rng.random(m), side="right"), p.n_cat - 1)
        blo, bhi = p.brand_lo[c], p.brand_hi[c]
        br = blo + ((bhi - blo) * rng.random(m) ** 2).astype(np.int64)  # a few big brands per category
        slo, shi = p.shop_lo[br], p.shop_hi[br]
        sh = slo + ((shi - slo) * rng.random(m) ** 1.5).astype(np.int64)
        noise = uniform_noise(rng, (m, p.k))
        qq = rng.standard_normal(m, dtype=np.float32)
        pareto = (1.0 - rng.random(m)) ** (-1.0 / model.item_pareto_alpha)
        cat[lo:hi] = c
        brand[lo:hi] = br
        shop[lo:hi] = sh
        v[lo:hi] = take_rows(p.cat_vec, c) + model.brand_weight * take_rows(p.brand_vec, br) + model.item_noise * noise
        q[lo:hi] = qq
        w[lo:hi] = pareto * np.exp(model.quality_popularity * qq)

    each(block, blocks(n))
    # by category, then popularity descending: cat + 1/(1+w) orders both at once (w > 0), and a float
    # argsort is several times faster than lexsort
    order = np.argsort(cat + 1.0 / (1.0 + w), kind="stable").astype(np.int64)
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    v = take_rows(v, order)  # by position from here on; the id-ordered copy is freed
    counts = np.bincount(cat, minlength=p.n_cat)
    cat_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ws = w[order]
    cs = np.cumsum(ws)
    cat_weight = np.bincount(cat, weights=w, minlength=p.n_cat)
    cat_pos = cat[order]
    before = np.concatenate([[0.0], cs])[cat_start[:-1]]  # cumulative weight before each category
    share = (cs - before[cat_pos]) / cat_weight[cat_pos]
    share[cat_start[1:][counts > 0] - 1] = 1.0
    return Items(cat=cat, brand=brand, shop=shop, q=q, w=w, order=order, rank=rank, cat_start=cat_start,
                 cat_weight=cat_weight, v_pos=v, q_pos=q[order], cat_pos=cat_pos,
                 table=PackedTable(share, cat_pos, p.n_cat))


def exposure_table(model: ClickModel, p: Params, items: Items) -> np.ndarray:
    """p(c | fine cluster), shape (n_fine, n_cat); zero for categories without items."""
    k = p.k
    affinity = (p.taste.astype(np.float64) @ p.cat_vec.T.astype(np.float64)) / np.sqrt(k)
    logit = model.tau * affinity
    with np.errstate(divide="ignore"):
        logit = logit + model.pop_power * np.log(items.cat_weight)[None, :]
    logit -= logit.max(axis=1, keepdims=True)
    e = np.exp(logit)
    return e / e.sum(axis=1, keepdims=True)


@dataclass
class Users:
    fine: np.ndarray  # (n,) int32 fine interest cluster
    pref: np.ndarray  # (n,) int32 preferred leaf category
    u: np.ndarray  # (n, k) float32 latent vector
    activity: np.ndarray  # (n,) float64 relative interaction rate

    @property
    def n(self) -> int:
        return int(self.fine.shape[0])


def make_users(cfg: DatagenConfig, model: ClickModel, p: Params, cat_table: PackedTable,
               each: Each = serially) -> Users:
    n = cfg.n_users
    fine = np.empty(n, np.int32)
    pref = np.empty(n, np.int32)
    u = np.empty((n, p.k), np.float32)
    act = np.empty(n, np.float64)
    cum_fine = np.cumsum(p.fine_probs)

    def block(b: int, lo: int, hi: int) -> None:
        rng = rng_for(cfg.seed, S_USERS, b)
        m = hi - lo
        f = np.minimum(np.searchsorted(cum_fine, rng.random(m), side="right"), p.n_fine - 1)
        c = cat_table.sample(f, cat_table.uniforms(rng, m)) - f.astype(np.int64) * p.n_cat
        noise = uniform_noise(rng, (m, p.k))
        fine[lo:hi] = f
        pref[lo:hi] = c
        u[lo:hi] = take_rows(p.taste, f) + model.user_pref_weight * take_rows(p.cat_vec, c) + model.user_noise * noise
        act[lo:hi] = np.exp(model.activity_sigma * rng.standard_normal(m))

    each(block, blocks(n))
    return Users(fine=fine, pref=pref, u=u, activity=act)


@dataclass
class World:
    cfg: DatagenConfig
    model: ClickModel
    params: Params
    items: Items
    users: Users
    p_cat: np.ndarray  # (n_fine, n_cat) exposure distribution over categories per fine cluster
    cat_table: PackedTable  # p_cat, for sampling (flat index = fine * n_cat + category)


def make_world(cfg: DatagenConfig, model: ClickModel, days: int, each: Each = serially) -> World:
    """The hidden world; ``each`` may run the per-block work on several threads (same result)."""
    params = make_params(cfg, model, days)
    items = make_items(cfg, model, params, each)
    p_cat = exposure_table(model, params, items)
    cat_table = table_from_weights(p_cat)
    users = make_users(cfg, model, params, cat_table, each)
    return World(cfg=cfg, model=model, params=params, items=items, users=users, p_cat=p_cat, cat_table=cat_table)

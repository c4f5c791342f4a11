"""The hidden click model: who is shown what (exposure) and what gets clicked.

Nothing here is written to the dataset; models only see its effects through the observable features,
and the generator reports how well the model itself predicts (the oracle metrics).

Exposure: a user of fine interest cluster ``f`` with preferred leaf category ``pref`` picks a leaf
category ``c`` with probability ``pref_mix * [c == pref] + (1 - pref_mix) * p(c | f)``, where
``p(c | f) ∝ W_c ** pop_power * exp(tau * t_f · C_c / sqrt(K))`` (``W_c`` the summed popularity of the
category's items, ``t_f`` the cluster's taste vector, ``C_c`` the category vector), then an item of ``c``
with probability proportional to the item's (Pareto) popularity.

Click: ``logit = affinity * u·v / sqrt(K) + quality * q + match * [cat == pref] + bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ClickModel:
    latent_dim: int = 16
    # --- latent structure -------------------------------------------------------------------
    cluster_weight: float = 1.0  # user taste = cluster + fine cluster + preferred category + noise
    fine_weight: float = 0.6
    user_pref_weight: float = 0.5
    user_noise: float = 0.45
    category_top_weight: float = 0.7  # category vector = top-level part + leaf part
    category_leaf_weight: float = 0.7
    brand_weight: float = 0.25  # item vector = category + brand + noise
    item_noise: float = 0.25
    # --- exposure ---------------------------------------------------------------------------
    tau: float = 2.5
    pop_power: float = 0.8
    pref_mix: float = 0.35
    item_pareto_alpha: float = 1.6  # item popularity ~ Pareto(alpha): heavy head, long tail
    quality_popularity: float = 0.3  # better items are a little more popular
    activity_sigma: float = 1.0  # interactions per user ~ lognormal
    # --- click ------------------------------------------------------------------------------
    affinity: float = 0.8
    quality: float = 0.5
    match: float = 0.4
    bias: float = -6.0

    def logit(self, dot: np.ndarray, q: np.ndarray, match: np.ndarray) -> np.ndarray:
        """Click logit from u·v (unscaled), item quality and [item category == preferred category]."""
        scale = self.affinity / np.sqrt(self.latent_dim)
        return (scale * dot.astype(np.float64) + self.quality * q.astype(np.float64)
                + self.match * match.astype(np.float64) + self.bias)

    def click_probability32(self, dot: np.ndarray, q: np.ndarray, match: np.ndarray) -> np.ndarray:
        """``sigmoid(logit)`` in float32, for scoring many items at once (the oracle's top-k)."""
        z = dot.astype(np.float32) * np.float32(self.affinity / np.sqrt(self.latent_dim))
        z += np.float32(self.quality) * q.astype(np.float32)
        z += np.float32(self.match) * match.astype(np.float32)
        z += np.float32(self.bias)
        z *= np.float32(0.5)
        np.tanh(z, out=z)
        z *= np.float32(0.5)
        z += np.float32(0.5)
        return z


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


DEFAULT_MODEL = ClickModel()

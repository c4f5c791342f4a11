"""What the locust users send: the gRPC target and which user ids to ask for.

Pure Python + numpy (+ Polars to read the dataset), no locust and no gRPC, so it can be imported and
tested anywhere. Locust also loads this file as a locustfile (every ``.py`` under ``-f loadtest/``); it
defines no User or shape class, so that is harmless.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recpipe.config import normalize_target

#: Environment variable naming the gateway when locust's ``--host`` is not given.
TARGET_ENV = "RECPIPE_TARGET"
_SCHEMES_KEPT = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
USER_DISTRIBUTIONS = ("uniform", "zipf")


class WorkloadError(ValueError):
    """A load-test setting that cannot work; the message says which and why."""


def parse_target(host: str | None, env: dict[str, str] | None = None) -> str:
    """The gRPC target for ``--host`` (or ``$RECPIPE_TARGET`` when ``--host`` is empty).

    ``grpc://h:p`` and ``h:p`` both become ``h:p``, ``:p`` becomes ``127.0.0.1:p``; gRPC target URIs (``dns:///h:p``,
    ``ipv4:a:p,b:p``, ``unix:path``) pass through unchanged so a load test can spread over replicas.
    """
    env = os.environ if env is None else env
    raw = (host or "").strip() or env.get(TARGET_ENV, "").strip()
    if not raw:
        raise WorkloadError(f"no target: pass --host HOST:PORT (e.g. 127.0.0.1:50051) or set {TARGET_ENV}")
    if raw.startswith(_SCHEMES_KEPT):
        return raw
    if raw.startswith("grpc://"):
        raw = raw[len("grpc://"):]
    elif "://" in raw:
        raise WorkloadError(f"target {raw!r}: only grpc:// (or a bare HOST:PORT) is understood")
    raw = normalize_target(raw.rstrip("/"))  # ":PORT" is 127.0.0.1:PORT, as everywhere in recpipe
    host_part, sep, port = raw.rpartition(":")
    if not sep or not host_part or not port.isdigit() or not 0 < int(port) < 65536:
        raise WorkloadError(f"target {raw!r} is not HOST:PORT")
    return raw


@dataclass(frozen=True)
class UserSampler:
    """Draws user ids: uniformly, or in proportion to a per-user weight (activity).

    ``cdf`` is the cumulative weight over ``user_ids`` normalised to end at 1; sampling is a binary
    search per draw, so a 221k-user Zipf stays O(log n) instead of ``choice(p=...)``'s O(n).
    """

    user_ids: np.ndarray  # (n,) int64
    cdf: np.ndarray | None  # (n,) float64, None = uniform
    distribution: str

    def __post_init__(self) -> None:
        if self.user_ids.size == 0:
            raise WorkloadError("no users to draw from")
        if self.cdf is not None and self.cdf.shape != self.user_ids.shape:
            raise WorkloadError("cdf and user_ids differ in length")

    def draw(self, rng: np.random.Generator, size: int = 1) -> np.ndarray:
        """``size`` user ids as int64."""
        if self.cdf is None:
            return self.user_ids[rng.integers(0, self.user_ids.size, size=size)]
        pos = np.searchsorted(self.cdf, rng.random(size), side="right")
        return self.user_ids[np.minimum(pos, self.user_ids.size - 1)]

    @classmethod
    def from_weights(cls, user_ids: np.ndarray, weights: np.ndarray, distribution: str) -> UserSampler:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != user_ids.shape or w.size == 0 or (w < 0).any() or w.sum() <= 0:
            raise WorkloadError("user weights must be non-negative, not all zero, one per user")
        cdf = np.cumsum(w)
        cdf /= cdf[-1]
        return cls(np.asarray(user_ids, dtype=np.int64), cdf, distribution)


def sampler_from_data(data_dir: Path, distribution: str) -> UserSampler:
    """Users from ``data_dir/users.parquet``; ``zipf`` weights each by its interaction count.

    The generator makes activity heavy-tailed, so weighting by it gives the Zipf-like mix of a real
    service (a few users send most queries) without inventing an exponent. Users with no interactions
    keep a weight of 1 so every user can still be drawn.
    """
    import polars as pl

    _check_distribution(distribution)
    users_file = data_dir / "users.parquet"
    if not users_file.is_file():
        raise WorkloadError(f"{users_file} not found (is {data_dir} a `recpipe synth-data` directory?)")
    user_ids = pl.scan_parquet(users_file).select("user_id").collect().to_series().to_numpy()
    user_ids = np.sort(user_ids.astype(np.int64))
    if distribution == "uniform":
        return UserSampler(user_ids, None, distribution)
    inter_file = data_dir / "interactions.parquet"
    if not inter_file.is_file():
        raise WorkloadError(f"{inter_file} not found: --user-dist zipf weights users by their interactions")
    counts = pl.scan_parquet(inter_file).group_by("user_id").len().collect()
    counted_ids = counts["user_id"].to_numpy().astype(np.int64)
    pos = np.minimum(np.searchsorted(user_ids, counted_ids), user_ids.size - 1)
    known = user_ids[pos] == counted_ids
    weights = np.ones(user_ids.size, dtype=np.float64)
    weights[pos[known]] += counts["len"].to_numpy()[known]
    return UserSampler.from_weights(user_ids, weights, distribution)


def sampler_from_count(num_users: int, distribution: str, zipf_s: float = 1.0, seed: int = 0) -> UserSampler:
    """Users ``0..num_users-1`` when the dataset is not at hand.

    ``zipf`` here is a synthetic Zipf(s) over a seeded shuffle of the ids (rank r drawn ∝ 1/r^s), not
    the dataset's activity: pass the data directory for that.
    """
    _check_distribution(distribution)
    if num_users < 1:
        raise WorkloadError(f"--num-user-ids must be >= 1, got {num_users}")
    user_ids = np.arange(num_users, dtype=np.int64)
    if distribution == "uniform":
        return UserSampler(user_ids, None, distribution)
    if zipf_s <= 0:
        raise WorkloadError(f"--zipf-s must be > 0, got {zipf_s}")
    shuffled = np.random.default_rng(seed).permutation(user_ids)
    weights = 1.0 / np.arange(1, num_users + 1, dtype=np.float64) ** zipf_s
    return UserSampler.from_weights(shuffled, weights, distribution)


def _check_distribution(distribution: str) -> None:
    if distribution not in USER_DISTRIBUTIONS:
        raise WorkloadError(f"user distribution must be one of {USER_DISTRIBUTIONS}, got {distribution!r}")

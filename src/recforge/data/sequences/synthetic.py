"""A learnable synthetic dataset of user histories, in the prepared format.

Each user walks a sparse Markov chain over a power-law catalogue: the next item is one of the
current item's few successors (peaked weights), or with ``taste_prob`` an item of the user's own
taste cluster (by popularity inside it), or with ``restart_prob`` any item by global popularity.
So the last item predicts the next one far better than popularity does, and the user's earlier
items add a little more: a sequential model has something to learn, without any download.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recforge.data.prepared_dir import as_json, build_once, cache_key
from recforge.data.sequences.prepared import Histories, why_stale, write_prepared

__all__ = ["SyntheticHistoriesConfig", "generate_histories", "write_synthetic_histories"]

# Bump when the output changes for the same config, so stale caches are not reused.
_GENERATOR_VERSION = 1
_DATASET = "synthetic-histories"


@dataclass(frozen=True)
class SyntheticHistoriesConfig:
    """Parameters of the generator (every field keys the on-disk cache)."""

    n_users: int = 6000
    n_items: int = 3000
    min_length: int = 20
    max_length: int = 200  # lengths are log-uniform in [min_length, max_length]
    zipf_exponent: float = 1.1  # global popularity ~ rank ** -zipf_exponent
    n_successors: int = 6
    successor_concentration: float = 1.5  # successor k is weighted ~ k ** -concentration
    n_tastes: int = 30  # taste clusters of items; each user has one
    taste_prob: float = 0.2
    restart_prob: float = 0.1
    days: float = 1000.0  # users start uniformly over this period
    median_gap_seconds: float = 3600.0
    start_time: int = 956_703_932  # 2000-04-25, the MovieLens-1M era
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_users < 1:
            raise ValueError(f"n_users must be >= 1, got {self.n_users}")
        if self.n_items < 2:
            raise ValueError(f"n_items must be >= 2, got {self.n_items}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"need 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}"
            )
        if not 1 <= self.n_successors < self.n_items:
            raise ValueError(f"n_successors must be in [1, n_items), got {self.n_successors}")
        if not 1 <= self.n_tastes <= self.n_items:
            raise ValueError(f"n_tastes must be in [1, n_items], got {self.n_tastes}")
        if self.taste_prob < 0 or self.restart_prob < 0 or self.taste_prob + self.restart_prob > 1:
            raise ValueError("taste_prob and restart_prob must be >= 0 with a sum <= 1, got "
                             f"{self.taste_prob} and {self.restart_prob}")
        if self.days <= 0 or self.median_gap_seconds <= 0:
            raise ValueError("days and median_gap_seconds must be > 0")

    def params(self) -> dict:
        return {**dataclasses.asdict(self), "_generator_version": _GENERATOR_VERSION}

    def cache_key(self) -> str:
        """A short hash of every field: changing any field gives a different key."""
        return cache_key(self.params())


def _sample(rng: np.random.Generator, cdf: np.ndarray, size: int) -> np.ndarray:
    # The clip guards against cdf[-1] landing a hair below 1 after summation.
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), len(cdf) - 1)


def generate_histories(cfg: SyntheticHistoriesConfig | None = None) -> Histories:
    """Draw every user's history; users ``u0..``, items ``i0..`` (catalogue index j = ``i{j}``)."""
    cfg = cfg or SyntheticHistoriesConfig()
    rng = np.random.default_rng(cfg.seed)
    n, n_users = cfg.n_items, cfg.n_users

    # Popularity ranks are shuffled over ids so that id order carries no signal.
    popularity = (rng.permutation(n) + 1.0) ** -cfg.zipf_exponent
    popularity /= popularity.sum()
    pop_cdf = np.cumsum(popularity)

    # Successors are uniform over the catalogue, so following them is not just following
    # popularity; the peaked weights make the first one or two dominate.
    successors = rng.integers(0, n, size=(n, cfg.n_successors))
    weights = np.arange(1, cfg.n_successors + 1, dtype=np.float64) ** -cfg.successor_concentration
    succ_cdf = np.cumsum(weights / weights.sum())

    # Taste clusters: one CDF per cluster laid end to end, cluster c spanning (c, c + 1], so one
    # searchsorted draws each user's item from its own cluster.
    cluster = rng.integers(0, cfg.n_tastes, size=n)
    cluster[: cfg.n_tastes] = np.arange(cfg.n_tastes)  # no empty cluster
    by_cluster = np.argsort(cluster, kind="stable")
    sorted_cluster = cluster[by_cluster]
    within = popularity[by_cluster]
    sizes = np.bincount(sorted_cluster, minlength=cfg.n_tastes)
    seg_end = np.cumsum(sizes)
    seg_start = seg_end - sizes
    totals = np.bincount(sorted_cluster, weights=within, minlength=cfg.n_tastes)
    cum = np.cumsum(within / totals[sorted_cluster])
    within_cum = cum - np.repeat(np.r_[0.0, cum][seg_start], sizes)
    stacked_cdf = sorted_cluster + within_cum
    taste = cluster[_sample(rng, pop_cdf, n_users)]  # a user's taste: the cluster of a popular item

    def from_taste(users: np.ndarray) -> np.ndarray:
        c = taste[users]
        pos = np.searchsorted(stacked_cdf, c + rng.random(len(users)), side="right")
        return by_cluster[np.clip(pos, seg_start[c], seg_end[c] - 1)]

    log_lengths = rng.uniform(np.log(cfg.min_length), np.log(cfg.max_length + 1), size=n_users)
    lengths = np.clip(np.floor(np.exp(log_lengths)).astype(np.int64), cfg.min_length, cfg.max_length)
    offsets = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    items = np.empty(int(offsets[-1]), dtype=np.int64)

    # All users walk in lockstep, longest first, so the users still walking at step t are a
    # prefix of `by_length` and each step is one vectorised draw.
    by_length = np.argsort(-lengths, kind="stable")
    walking = np.bincount(lengths, minlength=cfg.max_length + 2)[::-1].cumsum()[::-1]
    current = _sample(rng, pop_cdf, n_users)[by_length]
    items[offsets[by_length]] = current
    for step in range(1, cfg.max_length):
        active = int(walking[step + 1])
        if active == 0:
            break
        users = by_length[:active]
        current = current[:active]
        following = successors[current, _sample(rng, succ_cdf, active)]
        u = rng.random(active)
        restart = u < cfg.restart_prob
        tasteful = ~restart & (u < cfg.restart_prob + cfg.taste_prob)
        if restart.any():
            following[restart] = _sample(rng, pop_cdf, int(restart.sum()))
        if tasteful.any():
            following[tasteful] = from_taste(users[tasteful])
        items[offsets[users] + step] = following
        current = following

    starts = cfg.start_time + rng.uniform(0, cfg.days * 86400.0, size=n_users).astype(np.int64)
    gaps = 1 + rng.lognormal(np.log(cfg.median_gap_seconds), 1.5, size=len(items)).astype(np.int64)
    gaps[offsets[:-1]] = 0
    elapsed = np.cumsum(gaps)
    elapsed -= np.repeat(elapsed[offsets[:-1]], lengths)
    timestamps = np.repeat(starts, lengths) + elapsed
    ratings = rng.integers(1, 6, size=len(items)).astype(np.float32)
    return Histories(
        users=np.array([f"u{k}" for k in range(n_users)], dtype=object),
        offsets=offsets,
        items=items.astype(np.int32),
        timestamps=timestamps.astype(np.int64),
        ratings=ratings,
        item_ids=np.array([f"i{j}" for j in range(n)], dtype=object),
        item_counts=np.bincount(items, minlength=n).astype(np.int64),
    )


def write_synthetic_histories(
    cfg: SyntheticHistoriesConfig | None, directory: str | Path
) -> Path:
    """Write (or reuse) the prepared directory ``directory / cfg.cache_key()``; returns it.

    Built once (:func:`recforge.data.prepared_dir.build_once`): an interrupted write is redone,
    and of concurrent callers (DDP ranks) one writes while the others wait for it.
    """
    cfg = cfg or SyntheticHistoriesConfig()
    params = as_json(cfg.params())

    def build(target: Path) -> None:
        write_prepared(target, generate_histories(cfg), dataset=_DATASET, inputs=[], params=params)

    return build_once(Path(directory) / cfg.cache_key(), build,
                      lambda target: why_stale(target, _DATASET, [], params))

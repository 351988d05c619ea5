"""Criteo-shaped synthetic click logs with a known click model, in the prepared format.

Rows look like Criteo's: 13 dense features, non-negative heavy-tailed integer counts (zero-inflated
log-normal, correlated through a shared latent factor) with per-feature missing rates, stored
transformed as the prepared format says (log(1 + x), missing = 0); and 26 categorical features
whose values follow Zipf-like popularity (rank ``k`` drawn with weight ``(k + 1) ** -zipf_exponent``,
ranks shuffled over the indices so that index order carries no signal), index 0 being "missing".

A click is a Bernoulli draw of ``sigmoid(logit)``, where the logit sums

- per-value effects of every categorical feature (each feature with its own importance),
- dense effects: linear plus a small quadratic term in each standardised transformed feature,
- ``n_interactions`` pairwise terms between categorical features, ``<v_f[c_f], v_g[c_g]>`` with
  rank-``interaction_rank`` vectors (what a dot-interaction model can find), and
  ``n_dense_interactions`` dense x categorical terms, ``z_j * a_g[c_g]``,

each component scaled to a target standard deviation and the intercept set so that the mean click
probability is ``base_ctr``, both on a fixed pilot sample (so the model does not depend on
``n_rows``). The logit is a function of the stored features only (the float32 dense values and
the indices), so the true probabilities are the best prediction any model of this data can
make: the metadata records their AUC and logloss (``oracle_auc``, ``oracle_logloss`` on the test
split, and per evaluation split under ``oracle``).

Randomness is drawn per fixed block of :data:`BLOCK_ROWS` rows (each block its own stream), and
split assignment from one sequential stream over blocks: the rows do not depend on ``chunk_rows``
(how many rows are generated and written per step), and neither do the files, whose row groups
are cut at fixed sizes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recforge.data.criteo.prepared import (
    N_DENSE,
    N_SPARSE,
    SPLITS,
    PreparedDataError,
    PreparedWriter,
    read_metadata,
)
from recforge.data.prepared_dir import build_once, cache_key

__all__ = [
    "BLOCK_ROWS",
    "DEFAULT_CARDINALITIES",
    "DEFAULT_DENSE_MISSING",
    "DEFAULT_SPARSE_MISSING",
    "DENSE_LATENT",
    "DENSE_MEDIAN",
    "DENSE_SIGMA",
    "DENSE_ZERO",
    "DEFAULT_SPLIT",
    "SyntheticCriteoConfig",
    "SyntheticClickModel",
    "check_split",
    "ensure_synthetic_criteo",
    "exact_auc",
    "intercept_for",
    "logloss",
    "synthetic_criteo_key",
    "write_synthetic_criteo",
]

log = logging.getLogger(__name__)

# Bump when the output changes for the same config, so stale caches are not reused.
_GENERATOR_VERSION = 1
BLOCK_ROWS = 16_384
_PILOT_ROWS = 65_536
DEFAULT_SPLIT = (0.7, 0.2, 0.1)  # train, valid, test: BARS Criteo_x1's random 7:2:1

# Criteo Kaggle's table sizes (spec §2) with the ten largest cut to 2e4..1e5, so the mix spans
# tiny (3..27) to large tables while the default data stays small; index 0 is "missing".
DEFAULT_CARDINALITIES = (
    1460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 20_000, 5683, 100_000, 3194,
    27, 14_992, 80_000, 10, 5652, 2173, 4, 90_000, 18, 15, 30_000, 105, 25_000,
)
# Roughly Criteo Kaggle's share of empty fields per column.
DEFAULT_SPARSE_MISSING = (
    0.0, 0.0, 0.034, 0.034, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.034, 0.0,
    0.0, 0.0, 0.034, 0.0, 0.0, 0.44, 0.44, 0.034, 0.76, 0.0, 0.034, 0.44, 0.44,
)
DEFAULT_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.026, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22)
# Shape of each dense count: median and log-scale spread of its log-normal part, and the chance
# of an exact zero (Criteo's I5 runs to the millions, I10 and I12 are mostly 0 or 1).
DENSE_MEDIAN = np.array([1, 3, 8, 5, 2500, 30, 4, 8, 50, 1, 2, 1, 5], dtype=np.float64)
DENSE_SIGMA = np.array([1.2, 1.8, 1.5, 1.0, 1.8, 1.7, 1.6, 1.0, 1.3, 0.6, 1.2, 1.5, 1.0])
DENSE_ZERO = np.array([0.3, 0.1, 0.05, 0.05, 0.02, 0.1, 0.15, 0.05, 0.02, 0.4, 0.2, 0.6, 0.05])
DENSE_LATENT = 0.5  # correlation of each dense feature with the shared latent factor

# Columns of a block's uniform draws: value ranks, missing flags (sparse then dense), exact zeros,
# the click.
_U_RANK = slice(0, N_SPARSE)
_U_SPARSE_MISSING = slice(N_SPARSE, 2 * N_SPARSE)
_U_DENSE_MISSING = slice(2 * N_SPARSE, 2 * N_SPARSE + N_DENSE)
_U_ZERO = slice(2 * N_SPARSE + N_DENSE, 2 * N_SPARSE + 2 * N_DENSE)
_U_CLICK = 2 * N_SPARSE + 2 * N_DENSE
_N_UNIFORM = _U_CLICK + 1


@dataclass(frozen=True)
class SyntheticCriteoConfig:
    """Parameters of the generator (every field keys the on-disk cache)."""

    n_rows: int = 300_000
    seed: int = 0
    cardinalities: tuple[int, ...] = DEFAULT_CARDINALITIES  # table sizes, index 0 = missing
    sparse_missing: tuple[float, ...] = DEFAULT_SPARSE_MISSING
    dense_missing: tuple[float, ...] = DEFAULT_DENSE_MISSING
    zipf_exponent: float = 1.05
    base_ctr: float = 0.25  # mean click probability (Criteo Kaggle's positive rate is 0.256)
    main_effect_std: float = 1.0  # std of the logit's per-value effects
    dense_effect_std: float = 0.5  # ... of its dense effects
    interaction_std: float = 0.8  # ... of its interaction terms
    n_interactions: int = 12  # categorical x categorical pairs
    n_dense_interactions: int = 3  # dense x categorical pairs
    interaction_rank: int = 4

    def __post_init__(self) -> None:
        # Hydra hands lists; tuples keep the config hashable and its JSON form unchanged.
        for name in ("cardinalities", "sparse_missing", "dense_missing"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.n_rows, bool) or not isinstance(self.n_rows, int) or self.n_rows < 1:
            raise ValueError(f"n_rows must be an integer >= 1, got {self.n_rows!r}")
        if len(self.cardinalities) != N_SPARSE or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 2 for c in self.cardinalities
        ):
            raise ValueError(
                f"cardinalities must be {N_SPARSE} integers >= 2 (index 0 is 'missing'), "
                f"got {list(self.cardinalities)}"
            )
        for name, n in (("sparse_missing", N_SPARSE), ("dense_missing", N_DENSE)):
            rates = getattr(self, name)
            if len(rates) != n or not all(0.0 <= r < 1.0 for r in rates):
                raise ValueError(f"{name} must be {n} rates in [0, 1), got {list(rates)}")
        if not 0.0 < self.base_ctr < 1.0:
            raise ValueError(f"base_ctr must be in (0, 1), got {self.base_ctr}")
        if self.zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")
        for name in ("main_effect_std", "dense_effect_std", "interaction_std"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        pairs = N_SPARSE * (N_SPARSE - 1) // 2
        if not 0 <= self.n_interactions <= pairs:
            raise ValueError(f"n_interactions must be in [0, {pairs}], got {self.n_interactions}")
        if not 0 <= self.n_dense_interactions <= N_DENSE * N_SPARSE:
            raise ValueError(
                f"n_dense_interactions must be in [0, {N_DENSE * N_SPARSE}], got {self.n_dense_interactions}"
            )
        if self.interaction_rank < 1:
            raise ValueError(f"interaction_rank must be >= 1, got {self.interaction_rank}")

    def params(self) -> dict[str, Any]:
        """Every field plus the generator version, JSON-ready."""
        return {**json.loads(json.dumps(dataclasses.asdict(self))), "_generator_version": _GENERATOR_VERSION}


def check_split(split: Sequence[float]) -> tuple[float, float, float]:
    """``split`` as (train, valid, test) fractions; ValueError unless they are valid."""
    split = tuple(float(f) for f in split)
    if len(split) != 3 or min(split) < 0 or split[0] <= 0 or abs(sum(split) - 1.0) > 1e-6:
        raise ValueError(
            f"split must be 3 fractions (train, valid, test) >= 0 with train > 0 and a sum of 1, got {list(split)}"
        )
    return split


def synthetic_criteo_key(config: SyntheticCriteoConfig, split: Sequence[float] = DEFAULT_SPLIT) -> str:
    """A short hash of the generator's parameters and the split: a different value, another key."""
    return cache_key({"generator": config.params(), "split": list(check_split(split))})


def _stream(seed: int, *path: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *path]))


class SyntheticClickModel:
    """The generator's tables and click model; :meth:`rows` draws rows ``[start, stop)``.

    Built from ``config.seed`` alone; component scales and the intercept come from a pilot sample
    of its own stream, so every ``n_rows`` shares one model.
    """

    def __init__(self, config: SyntheticCriteoConfig) -> None:
        self.config = config
        rng = _stream(config.seed, 0)
        self.cardinalities = np.array(config.cardinalities, dtype=np.int64)
        self._rank_cdf: list[np.ndarray] = []
        self._index_of_rank: list[np.ndarray] = []
        for card in config.cardinalities:
            weights = np.arange(1, card, dtype=np.float64) ** -config.zipf_exponent
            self._rank_cdf.append(np.cumsum(weights / weights.sum()))
            self._index_of_rank.append(1 + rng.permutation(card - 1).astype(np.int32))
        self._sparse_missing = np.array(config.sparse_missing)
        self._dense_missing = np.array(config.dense_missing)

        importance = rng.uniform(0.2, 1.0, size=N_SPARSE)
        self._effects = [importance[f] * rng.standard_normal(card) for f, card in enumerate(config.cardinalities)]
        self._beta = rng.standard_normal(N_DENSE)
        self._gamma = 0.3 * rng.standard_normal(N_DENSE)
        all_pairs = [(f, g) for f in range(N_SPARSE) for g in range(f + 1, N_SPARSE)]
        chosen = rng.choice(len(all_pairs), size=config.n_interactions, replace=False)
        self.pairs = [all_pairs[k] for k in sorted(chosen)]
        rank = config.interaction_rank
        self._vectors = {
            f: rng.standard_normal((config.cardinalities[f], rank)) / np.sqrt(rank)
            for f in sorted({f for pair in self.pairs for f in pair})
        }
        chosen = rng.choice(N_DENSE * N_SPARSE, size=config.n_dense_interactions, replace=False)
        self.dense_pairs = [(int(k) // N_SPARSE, int(k) % N_SPARSE) for k in sorted(chosen)]
        self._slopes = {g: rng.standard_normal(config.cardinalities[g]) for _, g in self.dense_pairs}

        # Standardise dense features and scale each component to its target std on the pilot.
        pilot = self._draw(_stream(config.seed, 2), _PILOT_ROWS)
        dense, sparse = self._features(pilot)
        self._center = dense.mean(axis=0, dtype=np.float64)
        spread = dense.std(axis=0, dtype=np.float64)
        self._scale = np.where(spread > 0, spread, 1.0)
        parts = self._components(dense, sparse)
        targets = (config.main_effect_std, config.dense_effect_std, config.interaction_std)
        self._weights = np.array([t / s if s > 0 else 0.0 for t, s in zip(targets, (p.std() for p in parts))])
        self.intercept = intercept_for(sum(w * p for w, p in zip(self._weights, parts)), config.base_ctr)

    @staticmethod
    def _draw(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        # Feature-major, so that each feature's draws are contiguous.
        return {"u": rng.random((_N_UNIFORM, n)), "z": rng.standard_normal((1 + N_DENSE, n))}

    def _block_draws(self, block: int) -> dict[str, np.ndarray]:
        return self._draw(_stream(self.config.seed, 1, block), BLOCK_ROWS)

    def _features(self, draws: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Stored features of drawn rows: dense ``[n, 13]`` float32 (transformed), sparse ``[n, 26]`` int32."""
        u, z = draws["u"], draws["z"]
        sparse = np.empty((N_SPARSE, u.shape[1]), dtype=np.int32)
        for f in range(N_SPARSE):
            cdf = self._rank_cdf[f]
            # The clip guards against a cdf whose last entry lands a hair below 1.
            ranks = np.minimum(np.searchsorted(cdf, u[_U_RANK][f], side="right"), len(cdf) - 1)
            sparse[f] = self._index_of_rank[f][ranks]
        sparse[u[_U_SPARSE_MISSING] < self._sparse_missing[:, None]] = 0
        latent = DENSE_LATENT * z[:1] + np.sqrt(1 - DENSE_LATENT**2) * z[1:]
        counts = np.floor(np.exp(np.log(DENSE_MEDIAN)[:, None] + DENSE_SIGMA[:, None] * latent))
        counts[u[_U_ZERO] < DENSE_ZERO[:, None]] = 0.0
        dense = np.log1p(counts).astype(np.float32)
        dense[u[_U_DENSE_MISSING] < self._dense_missing[:, None]] = 0.0  # the prepared format's "missing"
        dense, sparse = np.ascontiguousarray(dense.T), np.ascontiguousarray(sparse.T)
        return dense, sparse

    def _components(self, dense: np.ndarray, sparse: np.ndarray) -> list[np.ndarray]:
        """Unscaled main, dense and interaction parts of the logit, each ``[n]`` float64."""
        main = np.zeros(len(sparse))
        for f in range(N_SPARSE):
            main += self._effects[f][sparse[:, f]]
        z = (dense.astype(np.float64) - self._center) / self._scale
        dense_part = z @ self._beta + (z * z - 1.0) @ self._gamma
        inter = np.zeros(len(sparse))
        for f, g in self.pairs:
            inter += np.einsum("nr,nr->n", self._vectors[f][sparse[:, f]], self._vectors[g][sparse[:, g]])
        for j, g in self.dense_pairs:
            inter += z[:, j] * self._slopes[g][sparse[:, g]]
        return [main, dense_part, inter]

    def probabilities(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """``[n]`` float64 click probabilities of stored rows (dense ``[n, 13]``, sparse ``[n, 26]``)."""
        logit = self.intercept + sum(w * p for w, p in zip(self._weights, self._components(dense, sparse)))
        return 1.0 / (1.0 + np.exp(-logit))

    def rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[start, stop)`` of the stream: labels ``[n]`` int8, dense ``[n, 13]`` float32,
        sparse ``[n, 26]`` int32, true probabilities ``[n]`` float64. ``start`` must be a multiple
        of :data:`BLOCK_ROWS`."""
        if start % BLOCK_ROWS:
            raise ValueError(f"start must be a multiple of {BLOCK_ROWS}, got {start}")
        blocks = range(start // BLOCK_ROWS, -(-stop // BLOCK_ROWS))
        parts = [self._block_draws(b) for b in blocks]
        draws = {k: np.concatenate([p[k] for p in parts], axis=1)[:, : stop - start] for k in ("u", "z")}
        dense, sparse = self._features(draws)
        prob = self.probabilities(dense, sparse)
        labels = (draws["u"][_U_CLICK] < prob).astype(np.int8)
        return labels, dense, sparse, prob


def intercept_for(logits: np.ndarray, rate: float) -> float:
    """The shift ``b`` with ``mean(sigmoid(logits + b)) = rate`` (bisection: the mean is monotone in b)."""
    low, high = -40.0, 40.0
    for _ in range(100):
        mid = 0.5 * (low + high)
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < rate:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula with mid-ranks for ties (a tied positive/negative pair
    counts one half); NaN without both classes."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    # Ranks 1..n; each run of equal scores gets the mean of its ranks.
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(ordered)]
    mid_ranks = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    rank_sum = mid_ranks[labels[order]].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities against 0/1 labels (natural log)."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), 1e-15, 1 - 1e-15)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _split_counts(n_rows: int, split: tuple[float, float, float]) -> np.ndarray:
    train = round(split[0] * n_rows)
    valid = min(round(split[1] * n_rows), n_rows - train)
    return np.array([train, valid, n_rows - train - valid], dtype=np.int64)


def write_synthetic_criteo(
    config: SyntheticCriteoConfig | None,
    out_dir: str | os.PathLike[str],
    split: Sequence[float] = DEFAULT_SPLIT,
    chunk_rows: int = 262_144,
    row_group_size: int = 16_384,
) -> Path:
    """Generate ``config.n_rows`` rows into the prepared directory ``out_dir`` (atomically); its path.

    ``split``: fractions of rows for train, valid and test, assigned uniformly at random with
    exact counts (rounded); a split with no rows is left out. Rows are generated ``chunk_rows`` at
    a time (rounded up to whole blocks), which bounds memory (about 1.2 KB per chunk row, plus
    9 bytes per evaluation row kept for the oracle metrics); the output does not depend on it.
    ``row_group_size`` sets the files' row groups, the loader's shuffling unit.
    """
    config = config or SyntheticCriteoConfig()
    split = check_split(split)
    model = SyntheticClickModel(config)
    n = config.n_rows
    chunk = max(1, -(-int(chunk_rows) // BLOCK_ROWS)) * BLOCK_ROWS
    remaining = _split_counts(n, split)
    assigner = _stream(config.seed, 3)
    kept: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"valid": [], "test": []}
    pending: dict[str, list[tuple[np.ndarray, ...]]] = {s: [] for s in SPLITS}
    pending_rows = dict.fromkeys(SPLITS, 0)
    with PreparedWriter(out_dir, row_group_size=row_group_size) as writer:

        def flush(name: str, final: bool) -> None:
            # Write whole row groups only, so the files are the same whatever the chunk size.
            if not pending[name]:
                return
            labels, dense, sparse = (np.concatenate(c) for c in zip(*pending[name]))
            cut = len(labels) if final else len(labels) // row_group_size * row_group_size
            if cut:
                writer.write(name, labels[:cut], dense[:cut], sparse[:cut])
            pending[name] = [(labels[cut:], dense[cut:], sparse[cut:])] if cut < len(labels) else []
            pending_rows[name] = len(labels) - cut

        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            labels, dense, sparse, prob = model.rows(start, stop)
            # Exact split sizes, uniformly at random: each block takes a multivariate
            # hypergeometric share of the rows still to assign, in block order.
            which = np.empty(stop - start, dtype=np.int8)
            for lo in range(start, stop, BLOCK_ROWS):
                size = min(BLOCK_ROWS, stop - lo)
                take = assigner.multivariate_hypergeometric(remaining, size)
                remaining -= take
                which[lo - start: lo - start + size] = assigner.permutation(np.repeat(np.arange(3), take))
            for k, name in enumerate(SPLITS):
                rows = which == k
                if not rows.any():
                    continue
                pending[name].append((labels[rows], dense[rows], sparse[rows]))
                pending_rows[name] += int(rows.sum())
                if name in kept:
                    kept[name].append((prob[rows], labels[rows]))
                if pending_rows[name] >= row_group_size:
                    flush(name, final=False)
        for name in SPLITS:
            flush(name, final=True)

        oracle = {}
        for name, parts in kept.items():
            if parts:
                prob, labels = (np.concatenate(c) for c in zip(*parts))
                oracle[name] = {"auc": exact_auc(prob, labels), "logloss": logloss(prob, labels),
                                "rows": len(labels), "mean_probability": float(prob.mean())}
        extra = {}
        if "test" in oracle:
            extra = {"oracle_auc": oracle["test"]["auc"], "oracle_logloss": oracle["test"]["logloss"]}
        return writer.finish(
            config.cardinalities,
            generator=config.params(),
            oracle=oracle,
            **extra,
            categorical={"mode": "synthetic", "missing_index": 0,
                         "note": "index 0 is 'missing'; values are indices in [1, cardinality)"},
            split={"mode": "random", "fractions": list(split), "seed": config.seed},
            source={"generator": "recforge.data.criteo.synthetic", "rows": n},
            malformed={"rows": 0},
        )


def ensure_synthetic_criteo(
    config: SyntheticCriteoConfig | None,
    cache_dir: str | os.PathLike[str],
    split: Sequence[float] = DEFAULT_SPLIT,
) -> Path:
    """The prepared directory ``cache_dir/<key>`` for this config and split, generated on first use.

    Concurrent callers (DDP ranks) wait for the first, which generates it
    (:func:`recforge.data.prepared_dir.build_once`).
    """
    config = config or SyntheticCriteoConfig()

    def why_stale(target: Path) -> str | None:
        try:
            generator = read_metadata(target).get("generator")
        except PreparedDataError as error:
            return str(error)
        return None if generator == config.params() else "its metadata.json records another generator"

    def build(target: Path) -> Path:
        log.info("generating %d synthetic Criteo rows into %s", config.n_rows, target)
        return write_synthetic_criteo(config, target, split)

    return build_once(Path(cache_dir) / synthetic_criteo_key(config, split), build, why_stale)

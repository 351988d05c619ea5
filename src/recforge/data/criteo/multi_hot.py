"""Synthetic multi-hot bags from one-hot Criteo rows, as MLPerf's DLRM-DCNv2 benchmark makes them.

Criteo has one value per categorical feature. MLPerf Training's DLRM-v2 (DCNv2) trains on
multi-hot bags synthesised from it (spec §2, TorchRec section): feature f's id ``v`` becomes a
bag of ``sizes[f]`` ids whose first is ``v`` itself and whose others are drawn once per (f, v)
(torchrec_dlrm's ``Multihot``: ``uniform`` over the table, or ``pareto``, Lomax-distributed with
shape 0.25, modulo the table size). The bag of a value is the same every time it occurs, so the
bags carry the value's signal; the labels are the one-hot data's.

torchrec_dlrm stores the drawn ids in a ``[rows, size]`` table per feature (16 GB for a 40M-row
table with bags of 100); here each extra id is a hash of (seed, f, v, j) instead: the same kind
of draw, kept in no memory, and the same in every DataLoader worker and DDP rank.

MLPerf's sizes: :data:`MLPERF_BAG_SIZES`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from recforge.data.batches import SparseBags
from recforge.errors import UserInputError

__all__ = ["MLPERF_BAG_SIZES", "MultiHot"]

# MLPerf Training DLRM-v2's bag size per Criteo categorical feature C1..C26
MLPERF_BAG_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
DISTRIBUTIONS = ("uniform", "pareto")
PARETO_SHAPE = 0.25

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a bijection that scrambles bits."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class MultiHot:
    """Expands one-hot rows into :class:`SparseBags` (see the module docstring).

    Args:
        sizes: bag size per feature (>= 1; 1 keeps the feature one-hot).
        cardinalities: rows of each feature's table (the data's metadata).
        distribution: how the extra ids are drawn: ``uniform`` or ``pareto``.
        seed: the draw.
    """

    sizes: tuple[int, ...]
    cardinalities: tuple[int, ...]
    distribution: Literal["uniform", "pareto"] = "uniform"
    seed: int = 0

    @classmethod
    def from_config(cls, config: dict, cardinalities: Sequence[int]) -> MultiHot:
        """From ``data.multi_hot`` (keys sizes, distribution, seed), with one-line errors naming it."""
        unknown = sorted(set(config) - {"sizes", "distribution", "seed"})
        if unknown:
            raise UserInputError(f"data.multi_hot: unknown key(s) {', '.join(unknown)}: expected sizes, "
                                 "distribution, seed")
        sizes = config.get("sizes")
        shown = list(sizes) if isinstance(sizes, Sequence) and not isinstance(sizes, str) else sizes
        ok = isinstance(shown, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                             for s in shown)
        if not ok or len(shown) != len(cardinalities):
            raise UserInputError(
                f"data.multi_hot.sizes: expected {len(cardinalities)} integers >= 1 (a bag size per categorical "
                f"feature), got {shown!r}"
            )
        distribution = config.get("distribution", "uniform")
        if distribution not in DISTRIBUTIONS:
            raise UserInputError(f"data.multi_hot.distribution: expected one of {', '.join(DISTRIBUTIONS)}, "
                                 f"got {distribution!r}")
        seed = config.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise UserInputError(f"data.multi_hot.seed: expected an integer >= 0, got {seed!r}")
        return cls(tuple(shown), tuple(int(c) for c in cardinalities), distribution, seed)

    def bag(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """``[n, sizes[feature]]`` int64: the bags of feature ``feature``'s values ``ids [n]``."""
        size, rows = self.sizes[feature], self.cardinalities[feature]
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((ids.shape[0], size), dtype=np.int64)
        out[:, 0] = ids
        if size == 1:
            return out
        with np.errstate(over="ignore"):
            key = _mix(np.uint64(self.seed) * _GOLDEN + np.uint64(feature + 1))
            base = _mix(ids.astype(np.uint64) ^ key)[:, None]
            draws = _mix(base + np.arange(1, size, dtype=np.uint64)[None, :] * _GOLDEN)
        if self.distribution == "uniform":
            out[:, 1:] = (draws % np.uint64(rows)).astype(np.int64)
        else:
            # Lomax(a): (1 - u)^(-1/a) - 1 for u uniform in [0, 1); capped far above any table size
            u = (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53
            x = np.minimum(np.power(1.0 - u, -1.0 / PARETO_SHAPE) - 1.0, 2.0**62)
            out[:, 1:] = x.astype(np.int64) % rows
        return out

    def expand(self, sparse: np.ndarray) -> SparseBags:
        """One-hot ``sparse [B, F]`` -> bags (feature f's bags of size ``sizes[f]``, f-major)."""
        b, f = sparse.shape
        if f != len(self.sizes):
            raise ValueError(f"multi-hot: {f} features in the rows, {len(self.sizes)} bag sizes")
        values = np.concatenate([self.bag(j, sparse[:, j]).reshape(-1) for j in range(f)])
        lengths = np.repeat(np.asarray(self.sizes, dtype=np.int64), b)
        offsets = np.zeros(b * f + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return SparseBags(torch.from_numpy(values), torch.from_numpy(offsets), b)

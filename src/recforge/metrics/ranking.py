"""Full-catalogue ranking metrics from per-row target ranks.

Ranks come from ``(n_greater, n_equal)`` counts (see
:func:`recforge.kernels.target_rank_counts`) and an explicit tie policy. The
metric keeps only float64 sums and an event count, so distributed reduction is
a plain sum and the result is a micro-average over target events (GRU4Rec
protocol), never a store of ``users x catalogue`` scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["METRIC_NAMES", "TIE_POLICIES", "RankingMetrics", "canonical_tie_policy", "ranks_from_counts"]

# Aliases map onto the policy that is actually computed; the canonical name is what
# gets logged, so "pessimistic" and "conservative" runs compare as the same protocol.
_TIE_CANONICAL: dict[str, str] = {
    "conservative": "conservative",
    "pessimistic": "conservative",
    "standard": "standard",
    "optimistic": "standard",
    "median": "median",
}

#: Accepted tie-policy names (aliases included).
TIE_POLICIES: tuple[str, ...] = tuple(_TIE_CANONICAL)

#: Accepted metric names for :class:`RankingMetrics`.
METRIC_NAMES: tuple[str, ...] = ("recall", "hr", "mrr", "ndcg")


def canonical_tie_policy(ties: str) -> str:
    """Map a tie-policy name or alias to its canonical name; ValueError if unknown."""
    try:
        return _TIE_CANONICAL[ties]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown tie policy {ties!r}; allowed values: {', '.join(TIE_POLICIES)}"
        ) from None


def ranks_from_counts(n_greater: Tensor, n_equal: Tensor, ties: str = "conservative") -> Tensor:
    """Turn rank counts into 1-based float64 ranks under a tie policy.

    Args:
        n_greater: ``[B]`` items scoring strictly above the target.
        n_equal: ``[B]`` items tying with the target, the target included (``>= 1``).
        ties: ``conservative``/``pessimistic`` (worst position among ties, GRU4Rec's
            reference), ``standard``/``optimistic`` (best position), or ``median``.

    Returns:
        ``[B]`` float64 ranks (``median`` can give half-integers).
    """
    policy = canonical_tie_policy(ties)
    if n_greater.shape != n_equal.shape:
        raise ValueError(
            f"n_greater and n_equal must have the same shape, got "
            f"{tuple(n_greater.shape)} and {tuple(n_equal.shape)}"
        )
    n_greater = n_greater.to(torch.float64)
    n_equal = n_equal.to(torch.float64)
    if policy == "conservative":
        return n_greater + n_equal
    if policy == "standard":
        return 1.0 + n_greater
    return 1.0 + n_greater + (n_equal - 1.0) / 2.0


class RankingMetrics(Metric):
    """Recall / HR / MRR / NDCG at several cutoffs for one target per row.

    ``compute()`` returns a dict ``"{name}@{k}" -> scalar float64 tensor`` (e.g.
    ``"recall@20"``, ``"mrr@5"``, ``"ndcg@10"``), plus ``"mrr"`` (uncut) when
    ``full_mrr``. Definitions, with ``r`` the rank of the target:

    - ``recall@k`` = ``hr@k`` = mean ``[r <= k]`` (identical with one target per row);
    - ``mrr@k`` = mean ``[r <= k] / r``;
    - ``ndcg@k`` = mean ``[r <= k] / log2(r + 1)``.

    Averages are over events (micro). With zero events every value is 0 rather
    than NaN, so an empty validation shard cannot poison a logged curve.

    Args:
        ks: positive cutoffs.
        metrics: names from :data:`METRIC_NAMES`.
        ties: tie policy used by :meth:`update_from_counts`; stored (canonical name)
            in ``self.ties`` so tasks can log it.
        full_mrr: also report the uncut ``"mrr"``.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(
        self,
        ks: Sequence[int] = (1, 5, 10, 20),
        metrics: Sequence[str] = ("recall", "mrr"),
        ties: str = "conservative",
        full_mrr: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(metrics, str):
            metrics = (metrics,)
        metrics = tuple(metrics)
        bad = [m for m in metrics if m not in METRIC_NAMES]
        if bad or not metrics:
            raise ValueError(
                f"unknown metric name(s) {bad!r}; allowed values: {', '.join(METRIC_NAMES)}"
            )
        ks = tuple(ks)
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
            raise ValueError(f"ks must be a non-empty sequence of positive ints, got {ks!r}")
        self.ks: tuple[int, ...] = tuple(sorted(set(ks)))
        self.metric_names: tuple[str, ...] = tuple(dict.fromkeys(metrics))
        self.ties: str = canonical_tie_policy(ties)
        self.full_mrr = bool(full_mrr)

        # float64 sums: float32 would lose integer precision past ~16M events.
        for name in self.metric_names:
            for k in self.ks:
                self.add_state(
                    self._state_name(name, k),
                    default=torch.zeros((), dtype=torch.float64),
                    dist_reduce_fx="sum",
                )
        if self.full_mrr:
            self.add_state("mrr_full_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n_events", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    @staticmethod
    def _state_name(name: str, k: int) -> str:
        return f"{name}_at_{k}_sum"

    def update(self, ranks: Tensor) -> None:  # type: ignore[override]
        """Add a batch of 1-based ranks ``[B]`` (from :func:`ranks_from_counts`)."""
        if ranks.dim() != 1:
            raise ValueError(f"ranks must be 1-D [B], got shape {tuple(ranks.shape)}")
        r = ranks.detach().to(dtype=torch.float64, device=self.n_events.device)
        zero = torch.zeros((), dtype=torch.float64, device=r.device)
        # Per-row terms are computed once and masked per cutoff.
        inv_rank = 1.0 / r
        inv_log = 1.0 / torch.log2(r + 1.0)
        for k in self.ks:
            hit = r <= k
            for name in self.metric_names:
                if name in ("recall", "hr"):
                    val = hit.sum(dtype=torch.float64)
                elif name == "mrr":
                    val = torch.where(hit, inv_rank, zero).sum()
                else:  # ndcg
                    val = torch.where(hit, inv_log, zero).sum()
                state = self._state_name(name, k)
                setattr(self, state, getattr(self, state) + val)
        if self.full_mrr:
            self.mrr_full_sum = self.mrr_full_sum + inv_rank.sum()
        self.n_events = self.n_events + r.numel()

    def update_from_counts(self, n_greater: Tensor, n_equal: Tensor) -> None:
        """Convert counts ``[B]`` to ranks with this metric's tie policy, then update."""
        self.update(ranks_from_counts(n_greater, n_equal, self.ties))

    def keys(self) -> list[str]:
        """The names :meth:`compute` returns, in its order."""
        names = [f"{name}@{k}" for name in self.metric_names for k in self.ks]
        return names + (["mrr"] if self.full_mrr else [])

    def count(self) -> Tensor:
        """Rows ranked so far, summed over DDP ranks (int64 scalar)."""
        with self.sync_context(should_sync=self.sync_on_compute):
            return self.n_events.clone()

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        """Return ``{"name@k": scalar}`` (plus ``"mrr"`` if ``full_mrr``); zeros when empty."""
        # clamp keeps the zero-event case at 0/1 = 0 without a host-side branch.
        denom = self.n_events.to(torch.float64).clamp_min(1.0)
        out: dict[str, Tensor] = {}
        for name in self.metric_names:
            for k in self.ks:
                out[f"{name}@{k}"] = getattr(self, self._state_name(name, k)) / denom
        if self.full_mrr:
            out["mrr"] = self.mrr_full_sum / denom
        return out


"""Full-catalogue ranking of one target per query, the evaluation of every retrieval task."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from torch import Tensor

from recforge.config_values import Range
from recforge.evaluation.base import SplitEvaluation
from recforge.kernels import target_rank_counts
from recforge.kernels.twin import KernelImpl
from recforge.metrics import RankingMetrics
from recforge.metrics.ranking import ranks_from_counts


class FullRanking(SplitEvaluation):
    """Ranks every query's target against the whole catalogue and keeps the metric sums.

    The catalogue is scored in tiles of ``chunk_size`` items (memory ``batch × chunk_size``,
    never ``batch × n_items``) by :func:`recforge.kernels.target_rank_counts` (``kernel``: its
    PyTorch reference or Triton twin). Ties between the target and other items follow ``ties``.
    ``max_rank``: ranks beyond it count as ``max_rank + 1`` (the sequential reference code
    ranks a top-2500 list only); None keeps exact ranks. ``monitor`` names the metric that
    checkpointing, early stopping and sweeps follow (``optimized_metric``); it must be one
    this evaluation logs.

    One :class:`RankingMetrics` per split (``val``, ``test``); their sums are reduced across DDP
    ranks when computed.
    """

    kind = "full_ranking"

    def __init__(
        self,
        ks: Sequence[Annotated[int, Range(ge=1)]] = (1, 5, 10, 20),
        metrics: Sequence[str] = ("recall", "mrr"),
        ties: str = "conservative",
        chunk_size: Annotated[int, Range(ge=1)] = 8192,
        kernel: KernelImpl = "pytorch",
        max_rank: Annotated[int, Range(ge=1)] | None = None,
        full_mrr: bool = False,
        monitor: str | None = None,
    ) -> None:
        super().__init__(lambda: RankingMetrics(ks=ks, metrics=metrics, ties=ties, full_mrr=full_mrr), monitor)
        self.chunk_size = chunk_size
        self.kernel = kernel
        self.max_rank = max_rank

    @torch.no_grad()
    def update(
        self,
        split: str,
        queries: Tensor,
        item_weights: Tensor,
        item_bias: Tensor | None,
        targets: Tensor,
        exclude_items: Tensor | None = None,
        exclude_offsets: Tensor | None = None,
    ) -> None:
        """Rank ``targets [B]`` for ``queries [B, d]`` against ``item_weights [N, d]`` (+ bias
        ``[N]``), never counting row b's ``exclude_items[exclude_offsets[b]:exclude_offsets[b+1]]``."""
        extra = {}
        if exclude_items is not None:
            extra = {"exclude_items": exclude_items, "exclude_offsets": exclude_offsets}
        n_greater, n_equal = target_rank_counts(
            queries, item_weights, item_bias, targets, chunk_size=self.chunk_size, kernel=self.kernel, **extra
        )
        metrics = self.splits[split]
        if self.max_rank is None:
            metrics.update_from_counts(n_greater, n_equal)
            return
        ranks = ranks_from_counts(n_greater, n_equal, metrics.ties)
        metrics.update(ranks.clamp_max(self.max_rank + 1))

"""Full-catalogue ranking of one target per query, the evaluation of every retrieval task."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from torch import Tensor

from recforge.config_values import Range
from recforge.errors import UserInputError
from recforge.evaluation.base import SplitEvaluation
from recforge.evaluation.user_sample import SAMPLE_PREFIX, ValidationSample
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

    ``max_users``: validate on a fixed sample of that many users (drawn once from
    ``sample_seed``, the run's seed in the config) on every epoch but every
    ``full_every_n_epochs``-th (epochs 0, n, 2n, ..., the reference's
    schedule), which ranks every user; the test split is always whole
    (:class:`recforge.evaluation.user_sample.ValidationSample`). The sample's figures are logged
    as ``val_sample/...`` on every epoch, the whole split's as ``val/...`` on full epochs only, and
    ``<prefix>/users``, ``val_sample/of_users`` and ``val/epoch`` say what each covers. A
    ``val/...`` monitor is followed on full epochs only (the callbacks act on a pass that logged
    it, :mod:`recforge.callbacks.fresh_monitor`); monitoring ``val_sample/...`` is the opt-in to
    choose on the sample. ``max_users=None``: every user, every epoch (``full_every_n_epochs``
    unused).

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
        max_users: Annotated[int, Range(ge=1)] | None = None,
        full_every_n_epochs: Annotated[int, Range(ge=1)] | None = None,
        sample_seed: int | None = 0,
    ) -> None:
        if max_rank is not None and max(ks) > max_rank:
            # a rank beyond max_rank is kept as max_rank + 1, which a cut-off above max_rank would
            # count as a hit (Recall@20 of 1.0 with max_rank=5)
            raise UserInputError(
                f"evaluation.max_rank={max_rank} is below the largest cut-off in evaluation.ks "
                f"({max(ks)}): ranks past max_rank are not known, so set max_rank >= {max(ks)} or null"
            )
        sample = None if max_users is None else ValidationSample(max_users, full_every_n_epochs, sample_seed or 0)
        if sample is not None and full_every_n_epochs is None and monitor is not None \
                and not monitor.startswith(f"{SAMPLE_PREFIX}/"):
            raise UserInputError(
                f"evaluation.monitor={monitor} is a figure over every validation user, and with "
                f"evaluation.max_users={max_users} and evaluation.full_every_n_epochs=null no epoch "
                f"ranks them all: set full_every_n_epochs, or monitor "
                f"{SAMPLE_PREFIX}/{monitor.split('/', 1)[-1]} (the sample's figure)"
            )
        super().__init__(
            lambda: RankingMetrics(ks=ks, metrics=metrics, ties=ties, full_mrr=full_mrr), monitor, sample
        )
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
        for metrics, rows in self.targets(split, len(targets)):
            if self.max_rank is None:
                metrics.update_from_counts(n_greater[rows], n_equal[rows])
            else:
                ranks = ranks_from_counts(n_greater[rows], n_equal[rows], metrics.ties)
                metrics.update(ranks.clamp_max(self.max_rank + 1))

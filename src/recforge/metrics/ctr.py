"""Click-through-rate metrics over every prediction of a split: AUC, logloss, accuracy, calibration.

AUC needs the whole split at once, so each rank keeps its scores (float32 logits, one byte per
label) in states that DDP concatenates, and the split is sorted once when computed. Everything
else is a float64 or int64 sum that DDP adds up. Scores are kept as logits, not probabilities: in
float32 ``sigmoid`` rounds every logit above ~17 to exactly 1 (and maps ever wider runs of
neighbouring logits to one value on the way there), which would turn distinct predictions into ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

__all__ = ["CTR_METRIC_NAMES", "CTR_METRIC_MODES", "CTRMetrics", "binary_auc"]

#: Accepted metric names for :class:`CTRMetrics`.
CTR_METRIC_NAMES: tuple[str, ...] = ("auc", "logloss", "accuracy", "calibration", "positive_rate", "count")

#: Which way each metric improves. ``calibration`` is best at 1 (neither largest nor smallest),
#: ``positive_rate`` and ``count`` describe the data: neither can drive checkpointing.
CTR_METRIC_MODES: dict[str, str | None] = {
    "auc": "max",
    "logloss": "min",
    "accuracy": "max",
    "calibration": None,
    "positive_rate": None,
    "count": None,
}


def binary_auc(scores: Tensor, labels: Tensor) -> Tensor:
    """Exact ROC AUC (Mann-Whitney U with average ranks: a tie counts one half).

    Args:
        scores: ``[N]`` real scores (logits); higher means more likely a click.
        labels: ``[N]`` 0/1 labels (any integer or bool dtype).

    Returns:
        A float64 scalar: P(score of a random positive > score of a random negative) + ½ P(tie);
        NaN when the labels hold a single class (or none), where AUC is undefined.
    """
    if scores.shape != labels.shape or scores.dim() != 1:
        raise ValueError(
            f"scores and labels must be 1-D of one length, got {tuple(scores.shape)} and {tuple(labels.shape)}"
        )
    sorted_scores, order = torch.sort(scores)
    sorted_labels = labels[order].to(torch.int64)
    # One group per distinct score; each positive wins against the negatives of lower groups and
    # half-wins against those of its own. Doubling keeps every count an exact int64.
    _, group_sizes = torch.unique_consecutive(sorted_scores, return_counts=True)
    group_ends = group_sizes.cumsum(0)
    positives_through = sorted_labels.cumsum(0)[group_ends - 1]
    group_pos = torch.diff(positives_through, prepend=positives_through.new_zeros(1))
    group_neg = group_sizes - group_pos
    neg_below = group_neg.cumsum(0) - group_neg
    twice_wins = (group_pos * (2 * neg_below + group_neg)).sum()
    n_pos = group_pos.sum()
    n_neg = labels.numel() - n_pos
    # 0 / 0 gives the NaN of a one-class split without a host-side check.
    return twice_wins.to(torch.float64) / (2.0 * n_pos.to(torch.float64) * n_neg.to(torch.float64))


class CTRMetrics(Metric):
    """AUC, logloss, accuracy and calibration of click predictions over a whole split.

    ``update(logits [B], labels [B])``: ``logits`` are the model's raw scores (before the sigmoid;
    passing probabilities would be the wrong input, not a different convention); ``labels`` are
    0/1 (float, int or bool; values above 0.5 count as clicks). ``compute()`` returns the requested
    names, each a float64 scalar, with ``p = sigmoid(logit)``:

    - ``auc``: exact ROC AUC over every row (:func:`binary_auc`, ties count one half);
      **NaN when the split holds one class only** (AUC is undefined there);
    - ``logloss``: mean binary cross-entropy, computed from the logits (no overflow, no log(0));
    - ``accuracy``: mean of ``[p >= threshold] == label``;
    - ``calibration``: mean ``p`` / mean label (1 is perfect; NaN without a positive);
    - ``positive_rate``: mean label; ``count``: number of rows.

    Every value is NaN for a split with no rows. States: the sums are float64/int64 and add up
    across DDP ranks; ``auc`` alone keeps per-row states (float32 logits, uint8 labels,
    concatenated across ranks, 5 bytes a row), so they exist only when ``auc`` is requested.

    Args:
        metrics: names from :data:`CTR_METRIC_NAMES`.
        threshold: probability at or above which a row is predicted a click (accuracy).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None  # mixed: see CTR_METRIC_MODES

    def __init__(
        self,
        metrics: Sequence[str] = ("auc", "logloss", "accuracy", "calibration"),
        threshold: float = 0.5,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(metrics, str):
            metrics = (metrics,)
        metrics = tuple(metrics)
        bad = [m for m in metrics if m not in CTR_METRIC_NAMES]
        if bad or not metrics:
            raise ValueError(
                f"unknown metric name(s) {bad!r}; allowed values: {', '.join(CTR_METRIC_NAMES)}"
            )
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.metric_names: tuple[str, ...] = tuple(dict.fromkeys(metrics))
        self.threshold = float(threshold)
        self.keeps_rows = "auc" in self.metric_names

        if self.keeps_rows:
            self.add_state("logits", default=[], dist_reduce_fx="cat")
            self.add_state("labels", default=[], dist_reduce_fx="cat")
        # float64: float32 sums stop resolving single rows past ~16M of them.
        self.add_state("logloss_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("prob_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n_correct", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("n_positive", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("n_rows", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, logits: Tensor, labels: Tensor) -> None:  # type: ignore[override]
        """Add a batch: ``logits [B]`` (any float dtype) and 0/1 ``labels [B]``."""
        if logits.dim() != 1 or labels.shape != logits.shape:
            raise ValueError(
                f"logits and labels must be 1-D [B] of one length, got {tuple(logits.shape)} and "
                f"{tuple(labels.shape)}"
            )
        logits = logits.detach()
        clicks = labels.detach() > 0.5
        x = logits.to(torch.float64)
        y = clicks.to(torch.float64)
        p = torch.sigmoid(x)
        self.logloss_sum = self.logloss_sum + F.binary_cross_entropy_with_logits(x, y, reduction="sum")
        self.prob_sum = self.prob_sum + p.sum()
        self.n_correct = self.n_correct + ((p >= self.threshold) == clicks).sum()
        self.n_positive = self.n_positive + clicks.sum()
        self.n_rows = self.n_rows + logits.numel()
        if self.keeps_rows:
            self.logits.append(logits.to(torch.float32))
            self.labels.append(clicks.to(torch.uint8))

    def _sync_dist(self, *args, **kwargs) -> None:
        # A rank that saw no rows would send torchmetrics' stand-in for an empty list, a tensor of
        # the metric's dtype (float32), against the other ranks' uint8 labels: the gather fails.
        # Typed empty tensors instead; sync() saved the states before, and unsync() restores them.
        if self.keeps_rows:
            for name, dtype in (("logits", torch.float32), ("labels", torch.uint8)):
                if isinstance(getattr(self, name), list) and not getattr(self, name):
                    setattr(self, name, [torch.empty(0, dtype=dtype, device=self.n_rows.device)])
        super()._sync_dist(*args, **kwargs)

    def keys(self) -> list[str]:
        """The names :meth:`compute` returns, in its order."""
        return list(self.metric_names)

    def _auc(self) -> Tensor:
        logits, labels = self.logits, self.labels
        if isinstance(logits, list) and not logits:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.n_rows.device)
        return binary_auc(dim_zero_cat(logits), dim_zero_cat(labels))

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        """Return ``{name: float64 scalar}`` for the requested names (NaN where undefined)."""
        n = self.n_rows.to(torch.float64)
        n_pos = self.n_positive.to(torch.float64)
        nan = torch.full((), float("nan"), dtype=torch.float64, device=n.device)

        # where() rather than a Python branch: no device-to-host sync on the way.
        def ratio(total: Tensor, denom: Tensor) -> Tensor:
            return torch.where(denom > 0, total / denom.clamp_min(1.0), nan)

        out: dict[str, Tensor] = {}
        for name in self.metric_names:
            if name == "auc":
                out[name] = self._auc()
            elif name == "logloss":
                out[name] = ratio(self.logloss_sum, n)
            elif name == "accuracy":
                out[name] = ratio(self.n_correct.to(torch.float64), n)
            elif name == "calibration":
                out[name] = ratio(self.prob_sum, n_pos)
            elif name == "positive_rate":
                out[name] = ratio(n_pos, n)
            else:  # count
                out[name] = n
        return out

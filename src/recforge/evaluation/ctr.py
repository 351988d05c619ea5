"""Click-through-rate evaluation over every row of a split, the evaluation of the CTR task (DLRM)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from torch import Tensor

from recforge.config_values import Range
from recforge.errors import UserInputError
from recforge.evaluation.base import SplitEvaluation
from recforge.metrics.ctr import CTR_METRIC_MODES, CTRMetrics


class CTREvaluation(SplitEvaluation):
    """AUC, logloss, accuracy and calibration of the click logits of every row of a split.

    ``metrics``: names from :data:`recforge.metrics.ctr.CTR_METRIC_NAMES` (``auc``, ``logloss``,
    ``accuracy``, ``calibration``, ``positive_rate``, ``count``); see :class:`CTRMetrics` for their
    definitions (AUC is exact, NaN for a one-class split). ``threshold``: the probability at or
    above which a row counts as a predicted click (accuracy). ``monitor`` names the metric that
    checkpointing, early stopping and sweeps follow (``optimized_metric``): one this evaluation
    logs, and one with a direction (``auc``, ``accuracy``: higher is better; ``logloss``: lower);
    ``calibration`` is best at 1, so neither ``max`` nor ``min`` can follow it, and
    ``positive_rate``/``count`` describe the data. The callbacks take the direction from the
    ``recforge_metric_mode`` resolver (``utils/resolvers.py``).

    One :class:`CTRMetrics` per split (``val``, ``test``); their states are reduced across DDP
    ranks when computed.
    """

    kind = "ctr"

    def __init__(
        self,
        metrics: Sequence[str] = ("auc", "logloss", "accuracy", "calibration"),
        threshold: Annotated[float, Range(gt=0, lt=1)] = 0.5,
        monitor: str | None = "val/auc",
    ) -> None:
        super().__init__(lambda: CTRMetrics(metrics=metrics, threshold=threshold), monitor)
        self.threshold = threshold

    def check_monitor(self, monitor: str) -> None:
        """A monitored CTR metric needs a better direction (``calibration`` is best at 1)."""
        if CTR_METRIC_MODES[monitor.split("/", 1)[1]] is None:
            followable = [n for n in self.logged_names() if CTR_METRIC_MODES[n.split("/", 1)[1]] is not None]
            raise UserInputError(
                f"evaluation.monitor={monitor}: it has no better direction (calibration is best "
                f"at 1); monitor one of {', '.join(followable) or 'auc, logloss, accuracy'}"
            )

    @torch.no_grad()
    def update(self, split: str, logits: Tensor, labels: Tensor) -> None:
        """Add a batch of click ``logits [B]`` (before the sigmoid) and 0/1 ``labels [B]``."""
        self.splits[split].update(logits, labels)

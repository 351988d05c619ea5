"""Click-through-rate evaluation over every row of a split, the evaluation of the CTR task (DLRM)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from torch import Tensor, nn

from recforge.config_values import Range
from recforge.errors import UserInputError
from recforge.metrics.ctr import CTR_METRIC_MODES, CTRMetrics

SPLITS = ("val", "test")


class CTREvaluation(nn.Module):
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
        super().__init__()
        try:
            self.splits = nn.ModuleDict({s: CTRMetrics(metrics=metrics, threshold=threshold) for s in SPLITS})
        except ValueError as error:  # unknown metric names, threshold out of range
            raise UserInputError(f"evaluation: {error}") from error
        self.threshold = threshold
        if monitor is not None:
            if monitor not in self.logged_names():
                raise UserInputError(
                    f"evaluation.monitor={monitor}: not a metric this evaluation logs; it logs "
                    f"{', '.join(self.logged_names())}"
                )
            if self._direction(monitor) is None:
                followable = [n for n in self.logged_names() if self._direction(n) is not None]
                raise UserInputError(
                    f"evaluation.monitor={monitor}: it has no better direction (calibration is best "
                    f"at 1); monitor one of {', '.join(followable) or 'auc, logloss, accuracy'}"
                )
        self.monitor = monitor

    @staticmethod
    def _direction(name: str) -> str | None:
        return CTR_METRIC_MODES[name.split("/", 1)[1]]


    def logged_names(self) -> list[str]:
        """Every metric name this evaluation logs (``val/auc``, ``test/logloss``, ...)."""
        names = self.splits["val"].keys()
        return [f"{split}/{name}" for split in SPLITS for name in names]

    @torch.no_grad()
    def update(self, split: str, logits: Tensor, labels: Tensor) -> None:
        """Add a batch of click ``logits [B]`` (before the sigmoid) and 0/1 ``labels [B]``."""
        self.splits[split].update(logits, labels)

    def compute_and_reset(self, split: str) -> dict[str, Tensor]:
        """``{"<split>/<name>": value}`` over every row of the split (a DDP reduction), then cleared."""
        metrics = self.splits[split]
        values = metrics.compute()
        metrics.reset()
        return {f"{split}/{name}": value.float() for name, value in values.items()}

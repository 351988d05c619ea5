"""What every evaluation shares: one metric state per split, the names it logs, the monitored
metric, and compute-then-reset at the end of a split."""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torchmetrics import Metric

from recforge.errors import UserInputError

SPLITS = ("val", "test")
"""The splits an evaluation keeps metrics for (training logs its loss only)."""


class SplitEvaluation(nn.Module):
    """One metric state per split in :data:`SPLITS`, built by ``make_metrics``.

    ``make_metrics()`` returns a fresh torchmetrics ``Metric`` whose ``keys()`` are the metric names
    and whose ``compute()`` returns ``{name: value}``; it may raise ``ValueError`` for a bad
    setting, which becomes one ``evaluation: ...`` line. ``monitor`` is the logged name that
    checkpointing, early stopping and sweeps follow (``optimized_metric``); it must be one this
    evaluation logs, and :meth:`check_monitor` may refuse more (a metric without a direction).
    Subclasses add ``update(split, ...)`` with their own inputs and set ``kind`` (the edge a task's
    ``evaluation_kind`` is matched against, :mod:`recforge.contracts`).
    """

    kind: str = ""

    def __init__(self, make_metrics: Callable[[], Metric], monitor: str | None) -> None:
        super().__init__()
        try:
            self.splits = nn.ModuleDict({split: make_metrics() for split in SPLITS})
        except ValueError as error:  # unknown metric names, an out-of-range setting
            raise UserInputError(f"evaluation: {error}") from error
        if monitor is not None:
            if monitor not in self.logged_names():
                raise UserInputError(
                    f"evaluation.monitor={monitor}: not a metric this evaluation logs; it logs "
                    f"{', '.join(self.logged_names())}"
                )
            self.check_monitor(monitor)
        self.monitor = monitor

    def check_monitor(self, monitor: str) -> None:
        """Refuse a logged metric that cannot be followed (none refused here)."""

    def logged_names(self) -> list[str]:
        """Every metric name this evaluation logs (``val/recall@20``, ``test/auc``, ...)."""
        names = self.splits[SPLITS[0]].keys()
        return [f"{split}/{name}" for split in SPLITS for name in names]

    def compute_and_reset(self, split: str) -> dict[str, Tensor]:
        """``{"<split>/<name>": value}`` over the whole split (a DDP reduction), then cleared."""
        metrics = self.splits[split]
        values = metrics.compute()
        metrics.reset()
        return {f"{split}/{name}": value.float() for name, value in values.items()}

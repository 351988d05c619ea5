"""What every evaluation shares: one metric state per split, the names it logs, the monitored
metric, and compute-then-reset at the end of a split; with a :class:`ValidationSample`, the
validation sample's own state and the routing of each batch's rows to it and to the whole split."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from recforge.errors import UserInputError
from recforge.evaluation.user_sample import SAMPLE_PREFIX, ValidationSample

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

    def __init__(
        self, make_metrics: Callable[[], Metric], monitor: str | None,
        validation_sample: ValidationSample | None = None,
    ) -> None:
        super().__init__()
        self.validation_sample = validation_sample
        states = SPLITS + ((SAMPLE_PREFIX,) if validation_sample is not None else ())
        try:
            self.splits = nn.ModuleDict({state: make_metrics() for state in states})
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

    def reduce_over(self, group: Any) -> None:
        """Reduce the metric states across ``group`` (a process group) instead of every rank:
        where several ranks see the same rows (a table-sharding group), over the data-parallel
        ranks only, so that each row counts once."""
        for metrics in self.splits.values():
            metrics.process_group = group

    def logged_names(self) -> list[str]:
        """Every metric name this evaluation logs (``val/recall@20``, ``test/auc``, ...); with a
        validation sample also ``val_sample/...`` and the counts that say what each figure covers
        (``<state>/users``, ``val_sample/of_users``, ``val/epoch``)."""
        names = self.splits[SPLITS[0]].keys()
        logged = [f"{state}/{name}" for state in self.splits for name in names]
        if self.validation_sample is not None:
            logged += [f"{state}/users" for state in self.splits]
            logged += [f"{SAMPLE_PREFIX}/of_users", "val/epoch"]
        return logged

    def targets(self, split: str, batch_rows: int) -> list[tuple[Metric, slice]]:
        """The metric states a batch of ``split`` updates, each with the rows it takes: the split's
        own state, or, during a sampled validation pass, the sample's state for the leading
        sampled rows and the whole split's state on a full pass."""
        if split != "val" or self.validation_sample is None:
            return [(self.splits[split], slice(None))]
        sampled, full = self.validation_sample.route(batch_rows)
        routes = [(self.splits[SAMPLE_PREFIX], slice(0, sampled))] if sampled else []
        return routes + ([(self.splits["val"], slice(None))] if full else [])

    def _compute_state(self, state: str) -> dict[str, Tensor]:
        metrics = self.splits[state]
        values = {f"{state}/{name}": value.float() for name, value in metrics.compute().items()}
        if self.validation_sample is not None:
            # the rows ranked on every rank: what the figure covers, in metrics.json
            values[f"{state}/users"] = metrics.count().float()
        metrics.reset()
        return values

    def compute_and_reset(self, split: str) -> dict[str, Tensor]:
        """``{"<split>/<name>": value}`` over the whole split (a DDP reduction), then cleared.

        With a validation sample, ``val`` gives the sample's figures (``val_sample/...``, every
        pass) and the whole split's (``val/...``) only after a full pass, so that a figure's name
        says which users it covers; nothing when no pass started."""
        if split != "val" or self.validation_sample is None:
            return self._compute_state(split)
        plan = self.validation_sample.finish_pass()
        if plan is None:
            return {}
        values = self._compute_state(SAMPLE_PREFIX)
        values[f"{SAMPLE_PREFIX}/of_users"] = torch.tensor(float(plan.split_rows))
        if plan.full:
            values |= self._compute_state("val")
            if plan.epoch is not None:
                values["val/epoch"] = torch.tensor(float(plan.epoch))
        return values

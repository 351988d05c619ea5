"""Checkpointing and early stopping that act only on a validation pass that logged their monitor.

Lightning's ``trainer.callback_metrics`` keeps a metric's last value until it is logged again, so a
callback following ``val/ndcg@10`` on an epoch that did not log it (a partial validation, which
logs ``val_sample/...`` only: :class:`recforge.evaluation.FullRanking`'s ``max_users``) would
compare a stale figure, count a non-improvement towards the patience, or refuse to run when a
resumed fit starts on such an epoch. These two act on a pass only if the task's last validation
logged their monitor (``RecTask.last_validation_logged``); with every user validated every epoch
that is every pass, and they are Lightning's own.
"""
from __future__ import annotations

import lightning as L
from lightning.pytorch import callbacks


def logged_by_last_validation(monitor: str | None, pl_module: L.LightningModule) -> bool:
    """Whether the last validation pass gave ``monitor`` a fresh value (True when the module does
    not say which names it logged, or when nothing is monitored)."""
    logged = getattr(pl_module, "last_validation_logged", None)
    return monitor is None or logged is None or monitor in logged


class ModelCheckpoint(callbacks.ModelCheckpoint):
    """:class:`lightning.pytorch.callbacks.ModelCheckpoint` that never picks a checkpoint on a pass
    that did not log its monitor."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if logged_by_last_validation(self.monitor, pl_module):
            super().on_validation_end(trainer, pl_module)


class EarlyStopping(callbacks.EarlyStopping):
    """:class:`lightning.pytorch.callbacks.EarlyStopping` whose patience counts only the passes that
    logged its monitor."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if logged_by_last_validation(self.monitor, pl_module):
            super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if logged_by_last_validation(self.monitor, pl_module):
            super().on_train_epoch_end(trainer, pl_module)

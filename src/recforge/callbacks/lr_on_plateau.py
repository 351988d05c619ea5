"""Learning-rate decay when the validation metric stops improving, as FuxiCTR (BARS) does it."""
from __future__ import annotations

import math
from typing import Annotated, Literal

import lightning as L

from recforge.config_values import Range

__all__ = ["LRDecayOnPlateau"]


class LRDecayOnPlateau(L.Callback):
    """After each validation, if ``monitor`` did not beat the best value so far by ``min_delta``,
    every parameter group's learning rate becomes ``max(lr * factor, min_lr)``; otherwise the value
    is the new best. No patience: FuxiCTR's ``reduce_lr_on_plateau`` (``BaseModel.lr_decay``, the
    BARS runs' trainer) decays at the first validation that does not improve, and its early
    stopping, with its own patience, stops later. The best value travels with checkpoints.

    Works with manual optimisation (the tasks step their own optimizers): it edits the trainer's
    optimizers' groups directly.
    """

    def __init__(
        self,
        monitor: str,
        mode: Literal["max", "min"] = "max",
        factor: Annotated[float, Range(gt=0, lt=1)] = 0.1,
        min_lr: Annotated[float, Range(ge=0)] = 1e-6,
        min_delta: Annotated[float, Range(ge=0)] = 1e-6,
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.monitor, self.mode = monitor, mode
        self.factor, self.min_lr, self.min_delta = float(factor), float(min_lr), float(min_delta)
        self.best = -math.inf if mode == "max" else math.inf

    def improved(self, value: float) -> bool:
        if self.mode == "max":
            return value >= self.best + self.min_delta
        return value <= self.best - self.min_delta

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.monitor])
        if self.improved(value):
            self.best = value
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = max(group["lr"] * self.factor, self.min_lr)

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best = float(state_dict["best"])

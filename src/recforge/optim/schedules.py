"""DLRM's learning-rate policy: linear warm-up, hold, quadratic decay to a floor, per update.

facebookresearch/dlrm's ``LRPolicyScheduler`` (``dlrm_s_pytorch.py``; the same class is kept in
``torchrec_dlrm/lr_scheduler.py``) scales each group's base rate by a function of ``s``, the
scheduler's own step counter, which is already 1 when the first update runs (``_LRScheduler``
steps once on construction) — so update ``k`` (0-based) gets ``s = k + 1``. With ``W`` warm-up
steps, decay from step ``S`` over ``D`` steps:

- ``s < W``: ``lr = base · s / W`` (the first update gets ``base / W``, never 0);
- ``D > 0`` and ``S <= s < S + D``: ``lr = max(1e-7, base · ((S + D − s) / D)²)`` (at ``s = S``
  the full base rate; the last decayed update gets ``base / D²``, not the floor);
- otherwise, with ``D > 0``: the rate of the last warm-up or decay update, frozen. Between the
  warm-up and the decay that is ``base · (W − 1) / W``, not ``base``; after the decay,
  ``max(1e-7, base / D²)``;
- otherwise (``D = 0``): ``base``.

Two departures, both where the reference cannot run: it exits when ``S < W`` even without a decay
(here only when ``D > 0``), and it fails (no rate yet to freeze) when a hold comes before any
warm-up or decay update (``W <= 1``, ``s < S``): here that hold is at ``base``.
"""
from __future__ import annotations

from typing import Annotated

import torch
from torch.optim.lr_scheduler import LambdaLR

from recforge.config_values import Range
from recforge.errors import UserInputError

__all__ = ["DLRMLRPolicy", "dlrm_lr_scale"]


def _active_scale(s: int, warmup: int, start: int, decay: int, floor: float) -> float | None:
    """The scale the reference computes at its step ``s``, or None where it freezes the last one."""
    if s < warmup:
        return s / warmup
    if decay > 0 and start <= s < start + decay:
        return max(floor, ((start + decay - s) / decay) ** 2)
    return None


def dlrm_lr_scale(
    step: int, warmup_steps: int, decay_start_step: int, decay_steps: int, floor: float = 0.0
) -> float:
    """The factor on the base rate for update ``step`` (0-based: updates already taken).

    ``floor`` is the smallest decayed factor (the reference's 1e-7 divided by the base rate).
    """
    s = step + 1
    scale = _active_scale(s, warmup_steps, decay_start_step, decay_steps, floor)
    if scale is not None:
        return scale
    if decay_steps == 0:
        return 1.0
    # The last step at which the reference computed a rate: the last decay step once the decay is
    # over, else the last warm-up step; before either has happened (s >= 1 always) there is none.
    last = decay_start_step + decay_steps - 1 if s >= decay_start_step + decay_steps else warmup_steps - 1
    if last < 1:
        return 1.0
    return _active_scale(last, warmup_steps, decay_start_step, decay_steps, floor)


class _Scale:
    """One group's factor (an object, not a closure: LambdaLR saves its attributes with the state)."""

    def __init__(self, warmup_steps: int, decay_start_step: int, decay_steps: int, floor: float) -> None:
        self.warmup_steps = warmup_steps
        self.decay_start_step = decay_start_step
        self.decay_steps = decay_steps
        self.floor = floor

    def __call__(self, step: int) -> float:
        return dlrm_lr_scale(step, self.warmup_steps, self.decay_start_step, self.decay_steps, self.floor)


class DLRMLRPolicy(LambdaLR):
    """facebookresearch/dlrm's LR policy (module docstring), to be stepped once per update.

    Args:
        optimizer: every group is scaled from its own base rate (``initial_lr``).
        warmup_steps: W, updates of linear warm-up (0: none).
        decay_start_step: S, the reference's step at which the decay starts (>= W when D > 0).
        decay_steps: D, updates of quadratic decay (0: no decay, the rate stays at the base).
        min_lr: the floor of the decayed rate (an absolute rate, as the reference's 1e-7).
        last_epoch: LambdaLR's resume argument (updates already taken − 1).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: Annotated[int, Range(ge=0)] = 0,
        decay_start_step: Annotated[int, Range(ge=0)] = 0,
        decay_steps: Annotated[int, Range(ge=0)] = 0,
        min_lr: Annotated[float, Range(ge=0)] = 1e-7,
        last_epoch: int = -1,
    ) -> None:
        for name, value in (("warmup_steps", warmup_steps), ("decay_start_step", decay_start_step),
                            ("decay_steps", decay_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserInputError(f"scheduler.{name}={value}: expected an integer >= 0")
        if min_lr < 0:
            raise UserInputError(f"scheduler.min_lr={min_lr}: expected a number >= 0")
        if decay_steps > 0 and decay_start_step < warmup_steps:
            raise UserInputError(
                f"scheduler.decay_start_step={decay_start_step}: the decay must start after the "
                f"warm-up (warmup_steps={warmup_steps})"
            )
        self.warmup_steps = warmup_steps
        self.decay_start_step = decay_start_step
        self.decay_steps = decay_steps
        self.min_lr = min_lr
        scales = []
        for group in optimizer.param_groups:
            base = group.get("initial_lr", group["lr"])  # what LRScheduler takes as the base
            scales.append(_Scale(warmup_steps, decay_start_step, decay_steps, min_lr / base if base > 0 else 0.0))
        super().__init__(optimizer, scales, last_epoch)

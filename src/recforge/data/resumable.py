"""Training loaders that resume inside an epoch.

A checkpoint saved inside an epoch (``every_n_train_steps``, a SLURM requeue) holds the model,
the optimizer and Lightning's count of the batches trained in that epoch, but a plain DataLoader
starts the epoch over. A loader with ``state_dict`` / ``load_state_dict`` has its state kept in
the checkpoint by Lightning: :class:`ResumesInsideEpoch` records (epoch, batches trained) there,
and the resumed run's first pass skips that many batches of the same epoch's order. This is exact
when the order is a function of (seed, epoch), which the data modules that use it guarantee.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ResumesInsideEpoch", "fit_progress"]

Progress = Callable[[], "tuple[int, int] | None"]


def fit_progress(trainer: Any) -> tuple[int, int] | None:
    """``(epoch, batches whose training step ran in it)`` of ``trainer``'s fit, or None without one."""
    loop = getattr(trainer, "fit_loop", None)
    if loop is None:
        return None
    return int(loop.epoch_progress.current.processed), int(loop.epoch_loop.batch_progress.current.processed)


class ResumesInsideEpoch:
    """Mixin for a training DataLoader: ``state_dict`` is ``progress()`` at save time;
    :meth:`skip_trained` drops the batches a loaded state says were trained, once, in the epoch it
    names."""

    _progress: Progress | None = None
    _resume_at: tuple[int, int] | None = None

    def state_dict(self) -> dict:
        progress = self._progress() if self._progress is not None else None
        return {} if progress is None else {"epoch": progress[0], "batches": progress[1]}

    def load_state_dict(self, state_dict: dict) -> None:
        if "epoch" in state_dict:
            self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches"]))

    def skip_trained(self, batches: Iterator, epoch: int | None, n_batches: int) -> Iterator:
        """``batches`` of ``epoch`` (``n_batches`` of them) without those a loaded state trained."""
        resume, self._resume_at = self._resume_at, None
        if resume is None or epoch is None or resume[0] != epoch or not 0 < resume[1] < n_batches:
            return batches
        # reading the skipped batches costs far less than training on them
        return itertools.islice(batches, resume[1], None)

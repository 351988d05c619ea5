"""The training loader of every data module: it resumes inside an epoch.

A checkpoint saved inside an epoch (``every_n_train_steps``, a SLURM requeue) holds the model,
the optimizer and Lightning's count of the batches trained in that epoch, but a plain loader
starts the epoch over. A loader with ``state_dict`` / ``load_state_dict`` has its state kept in
the checkpoint by Lightning: :class:`ResumesInsideEpoch` records (epoch, batches trained) there,
and the resumed run's first pass skips that many batches of the same epoch's order. This is exact
when the order is a function of (seed, epoch), which the data modules that use it guarantee.

A batch of several updates (GRU4Rec's ``data.steps_per_batch``) may have trained only its first
ones, when ``trainer.max_steps`` ended the run inside it: the state then says so, and the resumed
pass starts with that batch's remaining updates joined to the next batch's (``after(k, then)`` of
the batch type).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["Batches", "EpochOrdered", "ResumesInsideEpoch"]

# (epoch, batches trained whole in it, updates trained of the next batch), or None outside a fit
Progress = Callable[[], "tuple[int, int, int] | None"]


class EpochOrdered(Protocol):
    """What orders the batches of a pass by epoch: a sampler, a stream."""

    def set_epoch(self, epoch: int) -> None: ...


class Batches(Protocol):
    """One epoch of training batches, counted (a DataLoader, a sized iterable dataset)."""

    def __iter__(self) -> Iterator: ...

    def __len__(self) -> int: ...


class ResumesInsideEpoch:
    """The training loader over ``batches``, resumable inside an epoch.

    When a pass starts, ``progress()`` gives the fit's (epoch, batches trained in it), or None
    outside a fit; ``sampler`` (what orders the batches, if the epoch does) is told that epoch, and
    :meth:`skip_trained` drops, once, the batches a loaded state says were trained in it.
    ``state_dict`` is ``progress()`` at save time. Lightning finds ``sampler`` as it finds a
    DataLoader's, and sets the same epoch on it before each epoch.
    """

    _resume_at: tuple[int, int] | None = None

    def __init__(self, batches: Batches, progress: Progress, sampler: EpochOrdered | None = None) -> None:
        self.batches = batches
        self.sampler = sampler
        self._progress = progress

    def __iter__(self) -> Iterator:
        # A generator: Lightning calls iter() once to see that the loader iterates, which must
        # neither start workers nor use up the resume state; the pass starts at the first batch.
        progress = self._progress()
        epoch = None if progress is None else progress[0]
        if epoch is not None and self.sampler is not None:
            self.sampler.set_epoch(epoch)  # before the pass starts its workers, which copy the dataset
        yield from self.skip_trained(iter(self.batches), epoch, len(self.batches))

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        progress = self._progress() if self._progress is not None else None
        if progress is None:
            return {}
        return {"epoch": progress[0], "batches": progress[1], "updates": progress[2]}

    def load_state_dict(self, state_dict: dict) -> None:
        if "epoch" in state_dict:
            self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches"]), int(state_dict.get("updates", 0)))

    def skip_trained(self, batches: Iterator, epoch: int | None, n_batches: int) -> Iterator:
        """``batches`` of ``epoch`` (``n_batches`` of them) without what a loaded state trained."""
        resume, self._resume_at = self._resume_at, None
        if resume is None or epoch is None or resume[0] != epoch:
            return batches
        _, whole, updates = resume
        if not 0 < whole + (updates > 0) or whole >= n_batches:
            return batches
        # reading the skipped batches costs far less than training on them
        rest = itertools.islice(batches, whole, None)
        return _after_first(rest, updates) if updates else rest


def _after_first(batches: Iterator, updates: int) -> Iterator:
    """``batches``, the first without its first ``updates`` updates and joined to the second:
    Lightning counts the cut batch as trained, so the pass must hand it one batch fewer."""
    first = next(batches, None)
    if first is not None:
        yield first.after(updates, then=next(batches, None))
    yield from batches

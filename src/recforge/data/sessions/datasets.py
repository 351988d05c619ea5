"""Iterable datasets that turn session arrays into :class:`SessionStep` batches."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from recforge.data.batches import SessionStep, SessionSteps
from recforge.data.sessions.parallel import count_steps, session_parallel_positions
from recforge.data.sessions.store import SessionArrays


class SessionParallelSteps(IterableDataset):
    """One epoch of session-parallel steps over ``order`` (already the rank's share of sessions).

    ``pad_to`` appends empty steps until that many were yielded: under DDP every rank must run the
    same number of optimizer steps, or the gradient all-reduce waits forever.
    """

    def __init__(
        self,
        arrays: SessionArrays,
        order: np.ndarray,
        batch_size: int,
        min_rows: int = 1,
        pad_to: int | None = None,
    ) -> None:
        super().__init__()
        self.arrays = arrays
        self.order = order
        self.batch_size = batch_size
        self.min_rows = min_rows
        self.pad_to = pad_to
        self._n_steps: int | None = None

    def __iter__(self) -> Iterator[SessionStep]:
        items = torch.from_numpy(self.arrays.items)
        n = 0
        for pos in session_parallel_positions(
            self.arrays.offsets, self.order, self.batch_size, self.min_rows
        ):
            yield SessionStep(
                inputs=items[torch.from_numpy(pos.inputs)],
                targets=items[torch.from_numpy(pos.targets)],
                reset=torch.from_numpy(pos.reset),
                keep=None if pos.keep is None else torch.from_numpy(pos.keep),
            )
            n += 1
        while self.pad_to is not None and n < self.pad_to:
            empty = torch.zeros(0, dtype=torch.long)
            yield SessionStep(empty, empty, torch.zeros(0, dtype=torch.bool), empty)
            n += 1

    def __len__(self) -> int:
        if self.pad_to is not None:
            return self.pad_to
        if self._n_steps is None:
            self._n_steps = count_steps(
                self.arrays.offsets, self.order, self.batch_size, self.min_rows
            )
        return self._n_steps


class GroupedSteps(IterableDataset):
    """``steps`` in order, grouped ``per_batch`` at a time into :class:`SessionSteps`.

    The last group may be shorter. Under DDP every rank's ``steps`` are padded to the same count
    first, so every rank also yields the same number of groups.
    """

    def __init__(self, steps: SessionParallelSteps, per_batch: int) -> None:
        super().__init__()
        if per_batch < 1:
            raise ValueError(f"per_batch must be >= 1, got {per_batch}")
        self.steps = steps
        self.per_batch = per_batch

    def __iter__(self) -> Iterator[SessionSteps]:
        steps = iter(self.steps)
        while group := list(itertools.islice(steps, self.per_batch)):
            yield SessionSteps(group)

    def __len__(self) -> int:
        return math.ceil(len(self.steps) / self.per_batch)

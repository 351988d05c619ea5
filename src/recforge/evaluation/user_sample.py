"""Partial validation, as the HSTU reference evaluates Amazon Books: a fixed, seeded sample of users on
most epochs and every user every n-th epoch (spec hstu.md §1.7); the test split is always whole.

:class:`ValidationSample` is shared by the two sides of one validation pass in one process: the
data module's validation sampler decides, when the pass starts, which rows this rank ranks and in
which order (:meth:`ValidationSample.start_pass`), and the evaluation reads that plan back to route
each batch's ranks to the sample's metrics, the whole split's, or both (:meth:`route`). A full pass
ranks the sampled rows first, so the sample's figure is there on every epoch, always over the same
users, and the whole split's figure on full epochs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_PREFIX = "val_sample"
"""Logged names of the sample's figures: ``val_sample/ndcg@10`` (the whole split's are ``val/...``)."""


@dataclass(frozen=True)
class ValidationPass:
    """What one validation pass ranks: ``full`` (every row of the split, or only the sample),
    ``split_rows`` (rows of the whole split), ``sample_rows`` (rows of the sample, all ranks) and
    ``rank_sample_rows`` (how many of this rank's rows, which come first, are sampled ones)."""

    epoch: int | None
    full: bool
    split_rows: int
    sample_rows: int
    rank_sample_rows: int


class ValidationSample:
    """``max_users`` validation rows drawn once from ``seed`` (the same rows every epoch, whatever
    the number of DDP ranks), ranked alone on every epoch but those where ``epoch %
    full_every_n_epochs == 0`` (the reference's schedule: epoch 0, n, 2n, ... rank every user);
    ``full_every_n_epochs=None``: never the whole split while training. Outside a fit (``epoch``
    None: ``trainer.validate``) a pass is full. A sample as large as the split is the split: every
    pass is full.
    """

    def __init__(self, max_users: int, full_every_n_epochs: int | None, seed: int) -> None:
        self.max_users = int(max_users)
        self.full_every_n_epochs = full_every_n_epochs
        self.seed = int(seed)
        self.current: ValidationPass | None = None
        self._routed = 0
        self._drawn: tuple[int, np.ndarray] | None = None

    def rows(self, split_rows: int) -> np.ndarray:
        """The sampled row indices of a split of ``split_rows`` rows, ascending (drawn once)."""
        if self._drawn is None or self._drawn[0] != split_rows:
            if self.max_users >= split_rows:
                drawn = np.arange(split_rows, dtype=np.int64)
            else:
                rng = np.random.default_rng(self.seed)
                drawn = np.sort(rng.choice(split_rows, size=self.max_users, replace=False)).astype(np.int64)
            self._drawn = (split_rows, drawn)
        return self._drawn[1]

    def is_full(self, epoch: int | None, split_rows: int) -> bool:
        """Whether the pass of ``epoch`` (None: outside a fit) ranks every row."""
        if epoch is None or self.max_users >= split_rows:
            return True
        n = self.full_every_n_epochs
        return n is not None and epoch % n == 0

    def plan(self, epoch: int | None, split_rows: int, rank: int, world: int) -> tuple[np.ndarray, ValidationPass]:
        """This rank's rows for the pass of ``epoch``, in ranking order (its share of the sample,
        then on a full pass its share of the other rows), and the pass. Ranks take every
        ``world``-th row of each part: disjoint shares, together the sample (or the split)."""
        sample = self.rows(split_rows)
        mine = sample[rank::world]
        full = self.is_full(epoch, split_rows)
        plan = ValidationPass(epoch, full, split_rows, len(sample), len(mine))
        if full:
            others = np.ones(split_rows, dtype=bool)
            others[sample] = False
            mine = np.concatenate([mine, np.flatnonzero(others)[rank::world]])
        return mine, plan

    def start_pass(self, epoch: int | None, split_rows: int, rank: int, world: int) -> np.ndarray:
        """:meth:`plan`'s rows, the pass recorded for :meth:`route` and :meth:`finish_pass`."""
        rows, self.current = self.plan(epoch, split_rows, rank, world)
        self._routed = 0
        return rows

    def route(self, batch_rows: int) -> tuple[int, bool]:
        """For the next ``batch_rows`` rows of the pass: how many leading ones are sampled rows,
        and whether all of them count for the whole split (a full pass)."""
        plan = self.current
        assert plan is not None, "a validation batch before its pass started"
        sampled = max(0, min(batch_rows, plan.rank_sample_rows - self._routed))
        self._routed += batch_rows
        return sampled, plan.full

    def finish_pass(self) -> ValidationPass | None:
        """The pass just ranked (None if none started), forgotten."""
        plan, self.current = self.current, None
        return plan

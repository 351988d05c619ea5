"""What every data module shares; a family's data module subclasses :class:`RecDataModule`.

Once, here: the rank and world size it reads for (from the attached trainer), the fit's progress
that its training loader resumes from (:class:`~recforge.data.resumable.ResumesInsideEpoch`), the
validation guard, and the checkpoint identity: what a checkpoint records about the data it was
trained on, compared with the data a resumed or evaluated run reads. :class:`GeneratedData` is the
same for the synthetic modules: generate once under a cache directory, then read it as the family
reads its prepared data.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning as L

from recforge.data.resumable import Batches, EpochOrdered, ResumesInsideEpoch
from recforge.errors import UserInputError

__all__ = ["GeneratedData", "RecDataModule", "item_map_identity", "item_map_mismatch"]

EvalSplit = Literal["val", "test"]


class RecDataModule(L.LightningDataModule):
    """Base of every data module (the :class:`recforge.contracts.DataModule` contract).

    A subclass declares ``batch_type`` (the batch its loaders yield) and ``has_validation``, and
    defines ``task_inputs()`` (its return type, a TypedDict of :mod:`recforge.contracts`, names the
    task arguments it provides), ``train_dataloader()`` (wrapping its batches in :meth:`resumable`),
    :meth:`eval_dataloader` and the checkpoint identity (:meth:`identity`,
    :meth:`identity_mismatch`).
    """

    batch_type: ClassVar[type]
    has_validation: bool  # a property of each family

    def __init__(self) -> None:
        super().__init__()
        self._checkpoint_identity: dict | None = None  # restored, not yet compared

    # ---------------------------------------------------------------- the trainer's view
    def rank_and_world(self) -> tuple[int, int]:
        """This process's data-parallel rank and the number of data-parallel ranks (0 of 1
        without a trainer): which share of the data it reads.

        Under DDP every process is a data-parallel rank. Under ``hardware=model_parallel*`` the
        processes of one table-sharding group read the same batches (they split the tables, not
        the data), so the share is the one Lightning's strategy gives samplers."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        if isinstance(trainer, L.Trainer) and trainer.distributed_sampler_kwargs is not None:
            share = trainer.distributed_sampler_kwargs
            return int(share["rank"]), int(share["num_replicas"])
        return trainer.global_rank, trainer.world_size

    def fit_progress(self) -> tuple[int, int, int] | None:
        """``(epoch, batches trained whole in it, updates trained of the next one)`` of the fit, or
        None outside one. A batch counts as trained once its training step ran, unless the task
        says it cut the batch short (``batch_cut_after``: a step limit inside a batch of several
        updates); then it is the next one, with that many updates trained."""
        trainer = self.trainer
        if not isinstance(trainer, L.Trainer):
            return None  # loaders iterated by hand (a benchmark, a test's stand-in trainer)
        loop = trainer.fit_loop
        epoch, batches = int(loop.epoch_progress.current.processed), int(loop.epoch_loop.batch_progress.current.processed)
        cut = getattr(trainer.lightning_module, "batch_cut_after", None)
        if cut and batches > 0:
            return epoch, batches - 1, int(cut)
        return epoch, batches, 0

    def resumable(self, batches: Batches, sampler: EpochOrdered | None = None) -> ResumesInsideEpoch:
        """The training loader over ``batches``, whose order must be a function of (seed, epoch):
        ``sampler`` (if the order changes with the epoch) is told the fit's epoch before each pass."""
        return ResumesInsideEpoch(batches, self.fit_progress, sampler)

    # ---------------------------------------------------------------- evaluation loaders
    def eval_dataloader(self, split: EvalSplit) -> Iterable:
        """Rank's batches of the validation (``val``) or test split."""
        raise NotImplementedError

    def val_dataloader(self) -> Iterable:
        # Lightning asks even when there is nothing to validate on: no batches then
        return self.eval_dataloader("val") if self.has_validation else []

    def test_dataloader(self) -> Iterable:
        return self.eval_dataloader("test")

    # ---------------------------------------------------------------- checkpoint identity
    def identity(self) -> dict:
        """What a checkpoint records about the data (plain values, saved as the module's state)."""
        raise NotImplementedError

    def identity_mismatch(self, theirs: dict, mine: dict) -> str | None:
        """Why a checkpoint's identity does not fit this data, ending the sentence "the checkpoint
        was trained on ..." (naming the key to change), or None when it fits."""
        raise NotImplementedError

    def identity_known(self) -> bool:
        """Whether :meth:`identity` is at hand without reading data now. A module whose data is read
        later anyway says False until then, and calls :meth:`check_identity` once it has read it."""
        return True

    def check_trainable(self, min_batch_rows: int) -> None:
        """Refuse, in one line before the run starts, training data that has no mini-batch of the
        ``min_batch_rows`` rows the task's loss needs (the pipeline calls it after reading the
        inputs). A data module whose every mini-batch qualifies has nothing to check."""

    def state_dict(self) -> dict:
        return self.identity()

    def load_state_dict(self, state_dict: dict) -> None:
        self._checkpoint_identity = dict(state_dict)
        if self.identity_known():
            self.check_identity()

    def check_identity(self) -> None:
        """Refuse data other than a restored checkpoint's, in one line (no-op without one)."""
        # taken first: computing the identity may read the data, which calls this again
        theirs, self._checkpoint_identity = self._checkpoint_identity, None
        if theirs is None:
            return
        problem = self.identity_mismatch(theirs, self.identity())
        if problem is not None:
            raise UserInputError(f"the checkpoint was trained on {problem}")


def item_map_identity(item_ids: Sequence) -> dict:
    """The identity of a catalogue: its size and the sha256 of its ids in index order."""
    digest = hashlib.sha256("\n".join(map(str, item_ids)).encode()).hexdigest()
    return {"n_items": len(item_ids), "item_map_sha256": digest}


def item_map_mismatch(theirs: dict, mine: dict, what: str, source: str, fix: str) -> str | None:
    """:meth:`RecDataModule.identity_mismatch` of two :func:`item_map_identity` s: ``what`` the
    catalogue is called, ``source`` the key and value it comes from, ``fix`` what to do."""
    if theirs == mine:
        return None
    return (
        f"another {what} ({theirs['n_items']} items, sha256 {theirs['item_map_sha256'][:12]}) than "
        f"{source} ({mine['n_items']} items, sha256 {mine['item_map_sha256'][:12]}): {fix}"
    )


class GeneratedData:
    """Mixin before a family's data module: its data is drawn by a generator once, into a directory
    of ``cache_dir`` keyed by the generator's configuration, then read as the module reads its
    prepared data.

    ``generator`` holds the fields of ``generator_config`` (a dataclass that checks its values);
    :meth:`generate` writes (or finds) the data and says where, and with which arguments of the
    family's module it is read.
    """

    generator_config: ClassVar[type]
    describes: ClassVar[str]  # what is generated, for the log line

    def __init__(self, cache_dir: str, generator: dict | None = None, **kwargs) -> None:
        try:
            self.generator = self.generator_config(**(generator or {}))
        except (TypeError, ValueError) as error:
            raise UserInputError(f"data.generator: {error}") from None
        where, kwargs = self.generate(Path(cache_dir), kwargs)
        super().__init__(**kwargs)
        # logged as the family's module, where a user filtering its log looks for it
        logging.getLogger(type(self).__module__).info(
            "synthetic %s %s in %s", self.describes, asdict(self.generator), where
        )

    def generate(self, cache_dir: Path, kwargs: dict[str, Any]) -> tuple[Path, Mapping[str, Any]]:
        """Write the data under ``cache_dir`` unless it is there: (its directory, the module's
        arguments ``kwargs`` completed with where to read it)."""
        raise NotImplementedError

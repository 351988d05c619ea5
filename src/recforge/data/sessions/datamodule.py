"""LightningDataModule for session data in the GRU4Rec text format."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Literal

import lightning as L
from torch.utils.data import IterableDataset

from recforge.config_values import Range
from recforge.data.batches import SessionStep
from recforge.data.resumable import ResumesInsideEpoch, fit_progress
from recforge.data.sessions.datasets import GroupedSteps, SessionParallelSteps
from recforge.data.sessions.io import SessionFileError, read_session_file, sort_sessions
from recforge.data.sessions.parallel import count_steps
from recforge.data.sessions.store import ItemCatalog, SessionArrays
from recforge.data.synthetic import SyntheticSessionsConfig, write_synthetic_dataset
from recforge.errors import UserInputError

log = logging.getLogger(__name__)


class _TrainSteps(ResumesInsideEpoch, IterableDataset):
    """The training steps (one or grouped per batch), resumable inside an epoch: every epoch takes
    the sessions in the same order, so a resumed run skips the steps already trained
    (:class:`~recforge.data.resumable.ResumesInsideEpoch`); the task restores the hidden state of
    the sessions in flight."""

    def __init__(self, steps: SessionParallelSteps | GroupedSteps, progress) -> None:
        super().__init__()
        self.steps = steps
        self._progress = progress

    def __iter__(self):
        progress = self._progress()
        return self.skip_trained(iter(self.steps), None if progress is None else progress[0], len(self.steps))

    def __len__(self) -> int:
        return len(self.steps)


class SessionDataModule(L.LightningDataModule):
    """Session-parallel mini-batches from prepared GRU4Rec files (``SessionId ItemId Time``).

    The item map and popularity come from the training file; validation and test events whose item
    is unknown to it are deleted (sessions spliced), as the reference protocol does. Under DDP each
    rank takes every world_size-th session and training steps are padded to the same count.

    ``steps_per_batch`` > 1 hands ``steps_per_batch`` consecutive training steps to the task as one
    Lightning batch (:class:`SessionSteps`); the task still updates once per step. The Trainer's
    batch counts (``limit_train_batches``, ``val_check_interval``, ``log_every_n_steps``) then
    count these groups, while ``trainer.global_step`` counts optimizer steps.

    Given ``raw_path`` (and ``dataset``), the raw public files are preprocessed once into
    ``prepared_dir`` (spec §1.9; reused while inputs and parameters are unchanged) and the paths
    not given explicitly follow ``protocol``: ``final`` trains on train_full and tests on test;
    ``tuning`` trains on train_tr, validates on train_valid and tests on test.
    """

    batch_type = SessionStep

    def __init__(
        self,
        train_path: str | None,
        test_path: str | None,
        valid_path: str | None = None,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        eval_batch_size: Annotated[int, Range(ge=1)] = 512,
        steps_per_batch: Annotated[int, Range(ge=1)] = 1,
        session_key: str = "SessionId",
        item_key: str = "ItemId",
        time_key: str = "Time",
        dataset: str | None = None,
        raw_path: str | list[str] | None = None,
        prepared_dir: str | None = None,
        protocol: Literal["final", "tuning"] = "final",
        preprocess: dict | None = None,
    ) -> None:
        super().__init__()
        if protocol not in ("final", "tuning"):
            raise UserInputError(f"data.protocol must be 'final' or 'tuning', got {protocol!r}")
        if raw_path is not None:
            train_path, valid_path, test_path = self._prepare_raw(
                dataset, raw_path, prepared_dir, protocol, preprocess or {},
                train_path, valid_path, test_path,
            )
        self.train_path = train_path
        self.test_path = test_path
        self.valid_path = valid_path
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        if isinstance(steps_per_batch, bool) or not isinstance(steps_per_batch, int) or steps_per_batch < 1:
            raise UserInputError(
                f"data.steps_per_batch must be an integer >= 1, got {steps_per_batch!r}"
            )
        self.steps_per_batch = steps_per_batch
        self.keys = dict(session_key=session_key, item_key=item_key, time_key=time_key)
        self._catalog: ItemCatalog | None = None
        self._splits: dict[str, SessionArrays] = {}
        self._checkpoint_state: dict | None = None  # item-map summary of a restored checkpoint

    # ---------------------------------------------------------------- data
    @staticmethod
    def _prepare_raw(dataset, raw_path, prepared_dir, protocol, overrides, train, valid, test):
        from recforge.data.sessions.preprocess import prepare

        if dataset is None or prepared_dir is None:
            raise UserInputError("data.raw_path needs data.dataset and data.prepared_dir")
        paths = prepare(dataset, raw_path, prepared_dir, **overrides)
        if protocol == "tuning":
            return (train or str(paths["train_tr"]), valid or str(paths["train_valid"]),
                    test or str(paths["test"]))
        return train or str(paths["train_full"]), valid, test or str(paths["test"])

    @property
    def has_validation(self) -> bool:
        return self.valid_path is not None

    def _read(self, path: str | None, what: str, sort: bool = True):
        if path is None:
            raise UserInputError(
                f"data.{what}_path is not set: point it at a prepared GRU4Rec file "
                f"(tab-separated SessionId ItemId Time with a header), or set data.raw_path to "
                f"the raw dataset to preprocess it"
            )
        try:
            return read_session_file(path, **self.keys, sort=sort)
        except SessionFileError as error:
            raise SessionFileError(f"data.{what}_path: {error}") from error

    @property
    def catalog(self) -> ItemCatalog:
        """Items and their popularity, from the training file (read once)."""
        if self._catalog is None:
            # Items are indexed in order of first appearance in the file, as the reference does.
            frame = self._read(self.train_path, "train", sort=False)
            self._catalog = ItemCatalog.from_events(frame["ItemId"])
            train = SessionArrays.from_frame(sort_sessions(frame), self._catalog)
            if train.n_targets == 0:
                raise UserInputError(
                    f"data.train_path={self.train_path}: nothing to train on: {train.n_sessions} "
                    f"session(s) with {train.n_events} event(s) were read and no session has two "
                    "events (a next-item model learns from consecutive events of a session)"
                )
            self._splits["train"] = train
            self._check_item_map()
        return self._catalog

    def task_inputs(self) -> dict:
        """Keyword arguments the training task takes from the data: the item catalogue."""
        return {"n_items": self.catalog.n_items, "item_popularity": self.catalog.popularity}

    def split(self, name: str) -> SessionArrays:
        if name not in self._splits:
            catalog = self.catalog
            if name != "train":
                what = "valid" if name == "val" else name
                frame = self._read({"val": self.valid_path, "test": self.test_path}[name], what)
                self._splits[name] = self._known_items(frame, catalog, what)
        return self._splits[name]

    def _known_items(self, frame, catalog: ItemCatalog, what: str) -> SessionArrays:
        """An evaluation split without the events of items the training file lacks (the
        reference protocol); says how many went, warns when most did, refuses when none is left."""
        arrays = SessionArrays.from_frame(frame, catalog)
        key = f"data.{what}_path={getattr(self, f'{what}_path')}"
        read, dropped = len(frame), len(frame) - arrays.n_events
        share = dropped / read
        if arrays.n_targets == 0:
            raise UserInputError(
                f"{key}: nothing to evaluate: {dropped} of its {read} events ({share:.0%}) were dropped "
                f"as items the training file ({self.train_path}) does not have, and no session of "
                "the rest has two events"
            )
        log.info(
            "%s: %d events read, %d (%.1f%%) of items unknown to the training file dropped; "
            "%d sessions, %d targets left", what, read, dropped, 100 * share, arrays.n_sessions,
            arrays.n_targets,
        )
        if share > 0.5:
            log.warning(
                "%s: %.0f%% of its events (%d of %d) are of items unknown to the training file and were "
                "dropped; the metrics cover the rest only", key, 100 * share, dropped, read,
            )
        return arrays

    def setup(self, stage: str | None = None) -> None:
        self.catalog  # noqa: B018 - reads train and builds the item map
        if stage in ("fit", None):
            self.split("train")
            if self.has_validation:
                self.split("val")
        if stage in ("test", None):
            self.split("test")
        if stage == "validate" and self.has_validation:
            self.split("val")

    # ---------------------------------------------------------------- loaders
    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _min_train_rows(self) -> int:
        # A task declares the smallest batch its loss can learn from (2 when the mini-batch's own
        # targets are the only negatives); the data layer honours it without knowing the loss.
        module = self.trainer.lightning_module if self.trainer is not None else None
        return int(getattr(module, "min_batch_rows", 1))

    def train_dataloader(self):
        arrays = self.split("train")
        rank, world = self._rank()
        min_rows = self._min_train_rows()
        pad_to = None
        if world > 1:
            pad_to = max(
                count_steps(arrays.offsets, arrays.partition(r, world), self.batch_size, min_rows)
                for r in range(world)
            )
        steps = SessionParallelSteps(
            arrays, arrays.partition(rank, world), self.batch_size, min_rows, pad_to
        )
        if world == 1 and len(steps) == 0:
            raise UserInputError(
                f"data.train_path={self.train_path}: nothing to train on: no mini-batch has the "
                f"{min_rows} sessions of two or more events that the loss needs (the mini-batch's "
                "own targets are its only negatives without task.n_sample)"
            )
        steps = steps if self.steps_per_batch == 1 else GroupedSteps(steps, self.steps_per_batch)
        return _TrainSteps(steps, self._fit_progress)

    def _fit_progress(self) -> tuple[int, int] | None:
        return fit_progress(self.trainer)

    def _eval_loader(self, name: str):
        arrays = self.split(name)
        rank, world = self._rank()
        return SessionParallelSteps(arrays, arrays.partition(rank, world), self.eval_batch_size)

    def val_dataloader(self):
        if not self.has_validation:
            return []
        return self._eval_loader("val")

    def test_dataloader(self):
        return self._eval_loader("test")

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The item map travels with the checkpoint so evaluation can check it scores the same items."""
        catalog = self.catalog
        digest = hashlib.sha256("\n".join(map(str, catalog.item_ids)).encode()).hexdigest()
        return {"n_items": catalog.n_items, "item_map_sha256": digest}

    def load_state_dict(self, state_dict: dict) -> None:
        self._checkpoint_state = dict(state_dict)
        if self._catalog is None:
            self.catalog  # noqa: B018 - reading the train file runs the check
        else:
            self._check_item_map()

    def _check_item_map(self) -> None:
        state = self._checkpoint_state
        if state is None or self._catalog is None:
            return
        mine = self.state_dict()
        if mine != state:
            raise UserInputError(
                f"the checkpoint was trained on another item map ({state['n_items']} items, "
                f"sha256 {state['item_map_sha256'][:12]}) than data.train_path={self.train_path} "
                f"gives ({mine['n_items']} items, sha256 {mine['item_map_sha256'][:12]}): "
                "point data.train_path at the training file of that run"
            )


class SyntheticSessionDataModule(SessionDataModule):
    """Session data drawn from a learnable synthetic Markov chain, written once under ``cache_dir``."""

    def __init__(self, cache_dir: str, generator: dict | None = None, **kwargs) -> None:
        self.generator = SyntheticSessionsConfig(**(generator or {}))
        self.cache_dir = Path(cache_dir)
        paths = write_synthetic_dataset(self.generator, self.cache_dir)
        # Tune on train_tr -> train_valid, report on test: the reference protocol, without leakage.
        kwargs.setdefault("train_path", str(paths["train_tr"]))
        kwargs.setdefault("valid_path", str(paths["train_valid"]))
        kwargs.setdefault("test_path", str(paths["test"]))
        super().__init__(**kwargs)
        log.info("synthetic sessions %s in %s", asdict(self.generator), paths["train_full"].parent)

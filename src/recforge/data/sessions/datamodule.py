"""LightningDataModule for session data in the GRU4Rec text format."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal

from recforge.config_values import Range, checks_ranges
from recforge.contracts import CatalogueInputs
from recforge.data.base import (
    GeneratedData,
    RecDataModule,
    item_map_identity,
    item_map_mismatch,
)
from recforge.data.batches import SessionStep
from recforge.data.sessions.datasets import GroupedSteps, SessionParallelSteps
from recforge.data.sessions.io import SessionFileError, read_session_file, sort_sessions
from recforge.data.sessions.parallel import count_steps
from recforge.data.sessions.store import ItemCatalog, SessionArrays
from recforge.data.sessions.synthetic import (
    SyntheticSessionsConfig,
    write_synthetic_dataset,
)
from recforge.errors import UserInputError

log = logging.getLogger(__name__)


class SessionDataModule(RecDataModule):
    """Session-parallel mini-batches from prepared GRU4Rec files (``SessionId ItemId Time``).

    The item map and popularity come from the training file; validation and test events whose item
    is unknown to it are deleted (sessions spliced), as the reference protocol does. Under DDP each
    rank takes every world_size-th session and training steps are padded to the same count.

    ``steps_per_batch`` > 1 hands ``steps_per_batch`` consecutive training steps to the task as one
    Lightning batch (:class:`SessionSteps`); the task still updates once per step. The Trainer's
    batch counts (``limit_train_batches``, ``val_check_interval``, ``log_every_n_steps``) then
    count these groups, while ``trainer.global_step`` counts optimizer steps.

    Every epoch takes the sessions in the same order, so a run resumed inside an epoch skips the
    steps already trained; the task restores the hidden state of the sessions in flight.

    Given ``raw_path`` (and ``dataset``), the raw public files are preprocessed once into
    ``prepared_dir`` (spec §1.9; reused while inputs and parameters are unchanged) and the paths
    not given explicitly follow ``protocol``: ``final`` trains on train_full and tests on test;
    ``tuning`` trains on train_tr, validates on train_valid and tests on test.
    """

    batch_type = SessionStep

    @checks_ranges("data")
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
        self.steps_per_batch = steps_per_batch
        self.keys = dict(session_key=session_key, item_key=item_key, time_key=time_key)
        self._catalog: ItemCatalog | None = None
        self._splits: dict[str, SessionArrays] = {}

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
            self.check_identity()
        return self._catalog

    def task_inputs(self) -> CatalogueInputs:
        """Keyword arguments the training task takes from the data: the item catalogue."""
        return {"n_items": self.catalog.n_items, "item_popularity": self.catalog.popularity}

    def split(self, name: str) -> SessionArrays:
        if name not in self._splits:
            catalog = self.catalog
            if name != "train":
                what = "valid" if name == "val" else name
                path = {"val": self.valid_path, "test": self.test_path}[name]
                self._splits[name] = self._known_items(self._read(path, what), catalog, what, path)
        return self._splits[name]

    def _known_items(self, frame, catalog: ItemCatalog, what: str, path: str) -> SessionArrays:
        """An evaluation split without the events of items the training file lacks (the
        reference protocol); says how many went, warns when most did, refuses when none is left."""
        arrays = SessionArrays.from_frame(frame, catalog)
        key = f"data.{what}_path={path}"
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
    def _min_train_rows(self) -> int:
        # The task declares the smallest batch its loss can learn from (2 when the mini-batch's own
        # targets are the only negatives); the data layer honours it without knowing the loss.
        module = self.trainer.lightning_module if self.trainer is not None else None
        return 1 if module is None else int(module.min_batch_rows)

    def train_dataloader(self):
        arrays = self.split("train")
        rank, world = self.rank_and_world()
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
            raise self._nothing_to_train(min_rows)
        return self.resumable(steps if self.steps_per_batch == 1 else GroupedSteps(steps, self.steps_per_batch))

    def check_trainable(self, min_batch_rows: int) -> None:
        # the whole training split, before a rank takes its share: none of them could train
        arrays = self.split("train")
        if count_steps(arrays.offsets, arrays.partition(0, 1), self.batch_size, min_batch_rows) == 0:
            raise self._nothing_to_train(min_batch_rows)

    def _nothing_to_train(self, min_rows: int) -> UserInputError:
        return UserInputError(
            f"data.train_path={self.train_path}: nothing to train on: no mini-batch has the "
            f"{min_rows} sessions of two or more events that the loss needs (the mini-batch's "
            "own targets are its only negatives without task.n_sample)"
        )

    def eval_dataloader(self, split: str) -> SessionParallelSteps:
        arrays = self.split(split)
        rank, world = self.rank_and_world()
        return SessionParallelSteps(arrays, arrays.partition(rank, world), self.eval_batch_size)

    # ---------------------------------------------------------------- checkpoint
    def identity(self) -> dict:
        """The item map, so that evaluation can check it scores the same items."""
        return item_map_identity(self.catalog.item_ids)

    def identity_mismatch(self, theirs: dict, mine: dict) -> str | None:
        return item_map_mismatch(theirs, mine, "item map", f"data.train_path={self.train_path} gives",
                                 "point data.train_path at the training file of that run")


class SyntheticSessionDataModule(GeneratedData, SessionDataModule):
    """Session data drawn from a learnable synthetic Markov chain, written once under ``cache_dir``.

    Tuned on train_tr -> train_valid and reported on test: the reference protocol, without leakage.
    """

    generator_config = SyntheticSessionsConfig
    describes = "sessions"

    def generate(self, cache_dir: Path, kwargs: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        paths = write_synthetic_dataset(self.generator, cache_dir)
        files = {"train_path": paths["train_tr"], "valid_path": paths["train_valid"], "test_path": paths["test"]}
        return paths["train_full"].parent, {**{key: str(path) for key, path in files.items()}, **kwargs}

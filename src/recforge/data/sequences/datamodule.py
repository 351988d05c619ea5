"""LightningDataModule for user histories: jagged :class:`HistoryBatch` es for SASRec / HSTU."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler

from recforge.config_values import Range, checks_ranges
from recforge.contracts import HistoryInputs
from recforge.data.base import GeneratedData, RecDataModule, item_map_identity, item_map_mismatch
from recforge.data.batches import HistoryBatch
from recforge.data.sequences.prepared import Histories, PreparedDataError, load_prepared, read_marker
from recforge.data.sequences.splits import (
    EXCLUDE_POLICIES,
    MIN_EVENTS,
    PROTOCOLS,
    HistoryRows,
    RowDataset,
    concat_ranges,
    protocol_splits,
)
from recforge.data.sequences.synthetic import SyntheticHistoriesConfig, write_synthetic_histories
from recforge.errors import UserInputError
from recforge.evaluation.user_sample import ValidationSample

__all__ = ["HistoryDataModule", "SyntheticHistoryDataModule"]

log = logging.getLogger(__name__)


class _EvalShard(DistributedSampler):
    """Every ``world``-th row from ``rank``, without the padding DistributedSampler adds (a padded
    row would be counted twice in the metrics). Being a DistributedSampler, Lightning keeps it
    instead of injecting its own.

    A share is ranked longest history first: the encoders pad a batch to its longest row, so
    batches of like lengths skip most of that padding (the metrics are sums: order-free), and the
    largest batch comes first. With the task's ``sample``
    (:class:`recforge.evaluation.user_sample.ValidationSample`), each pass ranks the rows the
    sample plans for the epoch Lightning sets while fitting: its share of the sampled users, then
    on a full epoch of the others (outside a fit every row)."""

    def __init__(self, dataset: RowDataset, num_replicas: int, rank: int,
                 sample: ValidationSample | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        rows = dataset.rows
        self._lengths = np.minimum(rows.targets - rows.starts, dataset.max_seq_len)
        self._sample = sample
        self._epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def _longest_first(self, rows: np.ndarray) -> np.ndarray:
        return rows[np.argsort(-self._lengths[rows], kind="stable")]

    def __iter__(self):
        if self._sample is None:
            return iter(self._longest_first(np.arange(self.rank, len(self.dataset), self.num_replicas)).tolist())
        rows = self._sample.start_pass(self._epoch, len(self.dataset), self.rank, self.num_replicas)
        sampled = self._sample.current.rank_sample_rows  # routed by position: keep them first
        return iter(np.concatenate([self._longest_first(rows[:sampled]),
                                    self._longest_first(rows[sampled:])]).tolist())

    def __len__(self) -> int:
        # a full pass's length: Lightning counts the batches once and stops a pass there, so a
        # shorter (sampled) pass simply ends sooner
        if self._sample is None:
            return len(range(self.rank, len(self.dataset), self.num_replicas))
        return len(self._sample.plan(None, len(self.dataset), self.rank, self.num_replicas)[0])


class HistoryDataModule(RecDataModule):
    """User histories from a prepared directory (:mod:`recforge.data.sequences.prepared`).

    Given ``ratings_path`` (and ``dataset``), the raw ratings (plus ``items_path``, the movies
    file whose ids complete the catalogue) are preprocessed once into ``prepared_dir`` and reused
    while inputs and parameters (``preprocess``) are unchanged; given ``prepared_dir`` alone, it
    must already be prepared.

    ``protocol`` cuts users into splits (:mod:`recforge.data.sequences.splits`): ``loo`` has
    train, validation and test; ``reference`` train and test only. Users with too few events for
    it are dropped (the log says how many). Histories keep their ``max_seq_len`` most recent
    items (the log counts the histories cut). Evaluation batches carry the items never ranked for each row, per ``exclude``:
    ``history`` (the truncated history the model sees, the reference's choice), ``all_seen``
    (every item before the target) or ``none``.

    Training shuffles users each epoch in an order fixed by Lightning's seed (``PL_GLOBAL_SEED``)
    and the epoch, so a resumed run trains like an uninterrupted one; under DDP each rank trains on
    its own share of users. Evaluation rows are split between
    ranks without repeats. ``item_popularity`` counts the training split's events only.
    """

    batch_type = HistoryBatch
    # its validation loader ranks the task's sample of users (evaluation.max_users)
    samples_validation_users = True

    @checks_ranges("data")
    def __init__(
        self,
        prepared_dir: str | None = None,
        ratings_path: str | None = None,
        items_path: str | None = None,
        dataset: Literal["ml-1m", "ml-20m", "amzn-books"] | None = None,
        preprocess: dict | None = None,
        protocol: Literal["loo", "reference"] = "loo",
        max_seq_len: Annotated[int, Range(ge=1)] = 200,
        batch_size: Annotated[int, Range(ge=1)] = 128,
        eval_batch_size: Annotated[int, Range(ge=1)] = 512,
        num_workers: Annotated[int, Range(ge=0)] = 0,
        exclude: Literal["history", "all_seen", "none"] = "history",
    ) -> None:
        super().__init__()
        if protocol not in PROTOCOLS:
            raise UserInputError(f"data.protocol={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if exclude not in EXCLUDE_POLICIES:
            raise UserInputError(
                f"data.exclude={exclude!r}: expected one of {', '.join(EXCLUDE_POLICIES)}"
            )
        if prepared_dir is None:
            raise UserInputError(
                "data.prepared_dir is not set: point it at a prepared directory, or set it with "
                "data.ratings_path (and data.dataset) to prepare the raw ratings there"
            )
        if ratings_path is not None:
            self._prepare(dataset, ratings_path, items_path, prepared_dir, preprocess or {})
        elif items_path is not None:
            raise UserInputError("data.items_path needs data.ratings_path (the ratings file)")
        self.prepared_dir = str(prepared_dir)
        self.protocol = protocol
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.exclude = exclude
        self._histories: Histories | None = None
        self._splits: dict[str, HistoryRows] | None = None
        self._popularity: np.ndarray | None = None

    @staticmethod
    def _prepare(dataset, ratings_path, items_path, prepared_dir, overrides) -> None:
        from recforge.data.sequences.preprocess import RatingsDataError, prepare

        if dataset is None:
            raise UserInputError("data.ratings_path needs data.dataset (ml-1m, ml-20m, amzn-books)")
        raw = [ratings_path] + ([items_path] if items_path is not None else [])
        try:
            prepare(dataset, raw, prepared_dir, **overrides)
        except RatingsDataError as error:
            key = "items_path" if items_path is not None and error.path == Path(items_path) \
                else "ratings_path"
            raise RatingsDataError(f"data.{key}: {error}", path=error.path, line=error.line,
                                   field=error.field, detail=error.detail) from error
        except UserInputError as error:
            raise UserInputError(f"data.preprocess: {error}") from error

    # ---------------------------------------------------------------- data
    @property
    def histories(self) -> Histories:
        if self._histories is None:
            try:
                self._histories = load_prepared(self.prepared_dir, "data.prepared_dir")
            except PreparedDataError as error:
                if read_marker(self.prepared_dir) is not None:
                    raise
                # nothing prepared yet: say how to get there from the raw files, in one step
                raise PreparedDataError(
                    f"{error}, or set data.ratings_path=<the raw ratings file> to prepare it on first use"
                ) from error
            self.check_identity()
        return self._histories

    @property
    def n_items(self) -> int:
        return self.histories.n_items

    @property
    def has_validation(self) -> bool:
        return self.protocol == "loo"

    @property
    def splits(self) -> dict[str, HistoryRows]:
        if self._splits is None:
            histories = self.histories
            splits, dropped = protocol_splits(histories, self.protocol)
            need = MIN_EVENTS[self.protocol]
            if len(splits["test"]) == 0:
                longest = int(histories.lengths.max()) if histories.n_users else 0
                raise UserInputError(
                    f"data.prepared_dir={self.prepared_dir}: no user has the {need} events "
                    f"data.protocol={self.protocol} needs ({histories.n_users} users, the longest "
                    f"history has {longest})"
                )
            if dropped:
                log.info("protocol %s: %d of %d users dropped (fewer than %d events)",
                         self.protocol, dropped, histories.n_users, need)
            log.info("protocol %s: %s rows", self.protocol,
                     ", ".join(f"{name} {len(rows)}" for name, rows in splits.items()))
            # truncation is the models' contract (the reference keeps the most recent items), but
            # how much of the data it drops is worth a line
            cut = {name: int(np.count_nonzero(rows.targets - rows.starts > self.max_seq_len))
                   for name, rows in splits.items()}
            if any(cut.values()):
                log.info("data.max_seq_len=%d: histories cut to their most recent %d items: %s",
                         self.max_seq_len, self.max_seq_len,
                         ", ".join(f"{name} {n} of {len(splits[name])}" for name, n in cut.items()))
            self._splits = splits
        return self._splits

    @property
    def item_popularity(self) -> np.ndarray:
        """Events per item in the training split (history and target), never the held-out ones."""
        if self._popularity is None:
            rows = self.splits["train"]
            seen = self.histories.items[concat_ranges(rows.starts, rows.targets + 1 - rows.starts)]
            self._popularity = np.bincount(seen, minlength=self.n_items).astype(np.int64)
        return self._popularity

    def task_inputs(self) -> HistoryInputs:
        """What a task takes from the data: catalogue size, popularity, history length."""
        return {
            "n_items": self.n_items,
            "item_popularity": self.item_popularity,
            "max_seq_len": self.max_seq_len,
        }

    def dataset(self, split: str) -> RowDataset:
        """The rows of ``split`` (train, val, test) as a dataset."""
        if split not in self.splits:
            raise UserInputError(f"data.protocol={self.protocol} has no {split!r} split")
        exclude = None if split == "train" else self.exclude
        return RowDataset(self.histories, self.splits[split], self.max_seq_len, exclude)

    def setup(self, stage: str | None = None) -> None:
        self.splits  # noqa: B018 - reads the prepared data and cuts the splits now

    # ---------------------------------------------------------------- loaders
    def _loader(self, dataset: RowDataset, **kwargs) -> DataLoader:
        workers = self.num_workers
        return DataLoader(
            dataset,
            collate_fn=dataset.collate,
            num_workers=workers,
            persistent_workers=workers > 0,
            **kwargs,
        )

    def train_dataloader(self):
        # The order is a function of (seed, epoch), the epoch set before every pass: a resumed run
        # sees the users in the order an uninterrupted one would, and each DDP rank its share
        # (the sampler's own, which Lightning leaves alone); a run resumed inside an epoch skips
        # the batches of it already trained.
        dataset = self.dataset("train")
        rank, world = self.rank_and_world()
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        )
        return self.resumable(self._loader(dataset, batch_size=self.batch_size, sampler=sampler), sampler)

    def eval_dataloader(self, split: str) -> DataLoader:
        dataset = self.dataset(split)
        rank, world = self.rank_and_world()
        # the task's sample of validation users (evaluation.max_users), read as min_batch_rows is
        module = getattr(self.trainer, "lightning_module", None) if split == "val" else None
        sample = getattr(module, "validation_sample", None)
        return self._loader(
            dataset, batch_size=self.eval_batch_size, sampler=_EvalShard(dataset, world, rank, sample)
        )

    # ---------------------------------------------------------------- checkpoint
    def identity(self) -> dict:
        """The catalogue, so that evaluation can check it ranks the same items."""
        return item_map_identity(self.histories.item_ids)

    def identity_mismatch(self, theirs: dict, mine: dict) -> str | None:
        return item_map_mismatch(theirs, mine, "catalogue", f"data.prepared_dir={self.prepared_dir} holds",
                                 "point data.prepared_dir at that run's data")


class SyntheticHistoryDataModule(GeneratedData, HistoryDataModule):
    """Histories drawn from a learnable synthetic generator, written once under ``cache_dir``
    (one directory per generator configuration)."""

    generator_config = SyntheticHistoriesConfig
    describes = "histories"

    def generate(self, cache_dir: Path, kwargs: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        path = write_synthetic_histories(self.generator, cache_dir)
        return path, {"prepared_dir": str(path), **kwargs}

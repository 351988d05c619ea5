"""LightningDataModule for prepared Criteo parquet: :class:`CTRBatch` es streamed from row groups.

Rows are never fetched one at a time: a worker decodes whole parquet row groups into numpy
arrays and cuts batches from them (the per-row ``__getitem__`` of a map-style dataset costs more
than a DLRM step on CPU).

**Shares.** A split is a stream of rows: its row groups ("chunks") in file order, or, when
training shuffles, in an order drawn from (seed, epoch). Each DDP rank takes a contiguous share
of the stream, and each DataLoader worker a share of the rank's batches, so the readers never
overlap.

- Training gives every rank ``N // world_size`` rows (the remainder, fewer rows than ranks, is
  left out of that epoch and logged): the ranks then count the same batches, which the gradient
  all-reduce needs (a rank with one batch more waits forever for the others).
- Evaluation gives every row to exactly one rank (the first ``N % world_size`` ranks take one row
  more) and never pads or repeats a row, since the metrics sum and concatenate across ranks. Rank
  ``r``'s rows come before rank ``r + 1``'s and each rank yields its rows in file order, so a
  gather by rank is the split in file order.

**Shuffling** is approximate, as streaming must be: each epoch the order of the chunks is
permuted (the same permutation on every rank, so the shares stay disjoint), then each worker
pours its rows through a buffer of ``shuffle_buffer`` rows, shuffles the buffer and empties it in
batches (rows that do not fill a batch stay for the next fill). A row is thus mixed with the rows
of the buffer it lands in, never with rows farther away in the stream; a buffer at least as large
as the split shuffles fully. The buffer costs about 160 bytes a row, twice over while it is
shuffled, per worker and per rank (the default, 2**19 rows: ~170 MB). Order is a function of
Lightning's seed (``PL_GLOBAL_SEED``), the epoch, the number of ranks and of workers, so a run
resumed from a checkpoint trains like an uninterrupted one: from an end-of-epoch checkpoint, and
from one saved inside an epoch (``every_n_train_steps``, a SLURM requeue), whose count of trained
batches the training loader keeps in the checkpoint and skips on resume.
"""
from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from recforge.config_values import Range, checks_ranges
from recforge.contracts import CTRInputs
from recforge.data.base import GeneratedData, RecDataModule
from recforge.data.batches import CTRBatch
from recforge.data.criteo.multi_hot import MLPERF_BAG_SIZES, MultiHot
from recforge.data.criteo.prepared import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    N_DENSE,
    N_SPARSE,
    SPARSE_COLUMNS,
    SPLITS,
    PreparedDataError,
    read_metadata,
    split_files,
)
from recforge.data.criteo.synthetic import SyntheticCriteoConfig, check_split, ensure_synthetic_criteo
from recforge.errors import UserInputError

__all__ = ["Chunk", "CriteoDataModule", "CriteoStream", "SyntheticCriteoDataModule", "scan_split"]

log = logging.getLogger(__name__)

COLUMNS = (LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS)
DEFAULT_SHUFFLE_BUFFER = 2**19
ITEM_ROWS = 2**16  # rows a DataLoader worker hands over at a time (see CriteoStream's group)


class Chunk(NamedTuple):
    """One parquet row group: the unit that is read, and that the epoch's shuffle reorders."""

    path: str
    row_group: int
    rows: int


def scan_split(
    prepared_dir: str | os.PathLike[str], split: str, meta: dict[str, Any] | None = None
) -> list[Chunk]:
    """The row groups of ``split`` in file order, after checking the files against the metadata.

    From the parquet footers alone (no data is read): the columns are there, the row counts
    match the metadata, and where the writer kept statistics, no value is null, labels are 0 or
    1 and every index lies inside its table, so a bad file is refused here in one line rather
    than by an embedding lookup mid-epoch.
    """
    meta = meta or read_metadata(prepared_dir)
    cards = meta["cardinalities"]
    chunks: list[Chunk] = []
    for path in split_files(prepared_dir, split, meta):
        try:
            footer = pq.ParquetFile(path).metadata
        except Exception as error:  # pyarrow raises several types for a file that is not parquet
            raise PreparedDataError(f"{path}: not a readable parquet file ({error})") from None
        names = [footer.schema.column(i).name for i in range(footer.num_columns)]
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            raise PreparedDataError(f"{path}: columns {', '.join(missing)} are missing")
        position = {name: i for i, name in enumerate(names)}
        for g in range(footer.num_row_groups):
            group = footer.row_group(g)
            for name in COLUMNS:
                stats = group.column(position[name]).statistics
                if stats is None:
                    continue
                if stats.null_count:
                    raise PreparedDataError(f"{path}: row group {g}: column {name} has {stats.null_count} nulls")
                if not stats.has_min_max or name in DENSE_COLUMNS:
                    continue
                high = 2 if name == LABEL_COLUMN else cards[SPARSE_COLUMNS.index(name)]
                if stats.min < 0 or stats.max >= high:
                    what = "labels must be 0 or 1" if name == LABEL_COLUMN else \
                        f"indices must lie in [0, {high}) (its cardinality)"
                    raise PreparedDataError(
                        f"{path}: row group {g}: column {name} holds values in [{stats.min}, {stats.max}]; {what}"
                    )
            if group.num_rows:
                chunks.append(Chunk(str(path), g, group.num_rows))
    rows = sum(c.rows for c in chunks)
    expected = meta["splits"].get(split, {}).get("rows", 0)
    if rows != expected:
        raise PreparedDataError(
            f"{prepared_dir}: split {split!r} has {rows} rows in its files, its metadata says {expected}"
        )
    return chunks


def _share(n: int, rank: int, world: int, equal: bool) -> tuple[int, int]:
    """Rank ``rank``'s contiguous ``[start, stop)`` of ``n`` rows."""
    per, extra = divmod(n, world)
    if equal:
        return rank * per, (rank + 1) * per
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


class _Reader:
    """Rows of a stream of chunks by stream position, decoding each chunk at most once in a pass
    that moves forward (the last chunk read is kept)."""

    def __init__(self, chunks: Sequence[Chunk], order: np.ndarray) -> None:
        self.chunks = [chunks[i] for i in order]
        sizes = np.array([c.rows for c in self.chunks], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        self._files: dict[str, pq.ParquetFile] = {}
        self._cached: tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    def _load(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._cached is not None and self._cached[0] == k:
            return self._cached[1]
        chunk = self.chunks[k]
        file = self._files.get(chunk.path)
        if file is None:
            file = self._files[chunk.path] = pq.ParquetFile(chunk.path)
        # Workers are the parallelism: arrow's own threads would only compete with them.
        table = file.read_row_group(chunk.row_group, columns=list(COLUMNS), use_threads=False)
        n = table.num_rows
        labels = table.column(LABEL_COLUMN).to_numpy().astype(np.float32)
        dense = np.empty((n, N_DENSE), dtype=np.float32)
        for j, name in enumerate(DENSE_COLUMNS):
            dense[:, j] = table.column(name).to_numpy()
        sparse = np.empty((n, N_SPARSE), dtype=np.int32)
        for j, name in enumerate(SPARSE_COLUMNS):
            sparse[:, j] = table.column(name).to_numpy()
        self._cached = (k, (labels, dense, sparse))
        return labels, dense, sparse

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Rows ``[lo, hi)`` as (labels ``[n]`` float32, dense ``[n, 13]`` float32, sparse
        ``[n, 26]`` int32) views, one per chunk they span, in order."""
        k = int(np.searchsorted(self.ends, lo, side="right"))
        while lo < hi:
            first = lo - int(self.starts[k])
            last = min(hi, int(self.ends[k])) - int(self.starts[k])
            labels, dense, sparse = self._load(k)
            yield labels[first:last], dense[first:last], sparse[first:last]
            lo = int(self.starts[k]) + last
            k += 1


def _batch(
    labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray, multi_hot: MultiHot | None = None
) -> CTRBatch:
    return CTRBatch(
        dense=torch.from_numpy(dense),
        sparse=torch.from_numpy(sparse).to(torch.int64) if multi_hot is None else multi_hot.expand(sparse),
        labels=torch.from_numpy(labels),
    )


def _concat(pieces: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    if len(pieces) == 1:
        return pieces[0]
    return tuple(np.concatenate(column) for column in zip(*pieces))


class CriteoStream(IterableDataset):
    """One rank's batches of one split, as :class:`CTRBatch` es (see the module docstring).

    ``equal_shares``: every rank gets ``N // world_size`` rows (training); otherwise every row
    goes to one rank (evaluation). ``shuffle``: chunk order from (seed, epoch), then the shuffle
    buffer; otherwise file order. ``drop_last`` drops the rank's last batch when it is partial.
    ``len()`` is the rank's batch count, whatever the workers.

    ``group`` > 1 yields ``group`` consecutive batches as one item (a CTRBatch of up to ``group *
    batch_size`` rows, cut back into batches by the loader): a worker process hands its batches
    over through shared memory, which costs about a millisecond an item whatever its size, far
    more than a small batch takes to make. Without shuffling, worker ``w`` of ``W`` takes items
    ``w, w + W, ...``, which a DataLoader, taking one item from each worker in turn, yields in
    file order; when shuffling, each worker takes a contiguous span of whole batches.

    Batches: dense ``[B, 13]`` float32, sparse ``[B, 26]`` int64 (or, with ``multi_hot``, its
    :class:`~recforge.data.batches.SparseBags`), labels ``[B]`` float32, with ``B = batch_size``
    except for the rank's last batch.
    """

    def __init__(
        self,
        chunks: Sequence[Chunk],
        batch_size: int,
        *,
        shuffle: bool = False,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        equal_shares: bool = False,
        drop_last: bool = False,
        group: int = 1,
        multi_hot: MultiHot | None = None,
    ) -> None:
        super().__init__()
        self.multi_hot = multi_hot
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if drop_last and not equal_shares:
            raise ValueError("drop_last is for training (equal_shares): evaluation reads every row")
        self.chunks = list(chunks)
        self.batch_size = int(batch_size)
        self.group = max(1, int(group))
        self.shuffle = shuffle
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.equal_shares = equal_shares
        self.drop_last = drop_last
        self.epoch = 0
        self.n_rows = sum(c.rows for c in self.chunks)
        self.start, self.stop = _share(self.n_rows, rank, world_size, equal_shares)
        rows = self.stop - self.start
        self.n_batches = rows // self.batch_size if drop_last else -(-rows // self.batch_size)

    @property
    def left_out(self) -> int:
        """Rows of the split that no rank reads in an epoch (equal shares, ``drop_last``)."""
        if not self.equal_shares:
            return 0
        return self.n_rows - self.world_size * min(self.n_batches * self.batch_size, self.stop - self.start)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration follows (shuffling only)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n_batches

    def chunk_order(self) -> np.ndarray:
        """This epoch's order of the chunks; the same on every rank and worker."""
        if not self.shuffle:
            return np.arange(len(self.chunks))
        return np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch])).permutation(len(self.chunks))

    def item_ranges(self, worker: int = 0, workers: int = 1) -> list[tuple[int, int]]:
        """Stream positions ``[lo, hi)`` that ``worker`` of ``workers`` reads, in order: one per
        item (every ``workers``-th) in file order, or, when shuffling, one contiguous span of
        whole batches."""
        b, n = self.batch_size, self.n_batches

        def rows(first: int, last: int) -> tuple[int, int]:
            return self.start + first * b, min(self.start + last * b, self.stop)

        if not self.shuffle:
            g = self.group
            return [rows(i * g, min((i + 1) * g, n)) for i in range(worker, -(-n // g), workers)]
        first, last = worker * n // workers, (worker + 1) * n // workers
        return [rows(first, last)] if last > first else []

    def __iter__(self) -> Iterator[CTRBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = _Reader(self.chunks, self.chunk_order())
        ranges = self.item_ranges(worker, workers)
        if not self.shuffle:
            for lo, hi in ranges:
                yield _batch(*_concat(list(reader.pieces(lo, hi))), self.multi_hot)
            return
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch, self.rank, worker]))
        for lo, hi in ranges:
            yield from self._shuffled(reader.pieces(lo, hi), rng)

    def _shuffled(self, pieces: Iterator[tuple[np.ndarray, ...]], rng: np.random.Generator) -> Iterator[CTRBatch]:
        b = self.batch_size
        item = b * self.group
        fill = max(self.shuffle_buffer, b)
        pool: list[tuple[np.ndarray, ...]] = []
        pooled = 0
        pieces = iter(pieces)
        while True:
            piece = next(pieces, None)
            if piece is not None:
                pool.append(piece)
                pooled += len(piece[0])
                if pooled < fill:
                    continue
            if not pooled:
                return
            final = piece is None
            rows = _concat(pool)
            order = rng.permutation(pooled)
            mixed = tuple(np.take(column, order, axis=0) for column in rows)
            del rows, pool
            keep = pooled if final else pooled // b * b
            for s in range(0, keep, item):
                yield _batch(*(column[s: min(s + item, keep)] for column in mixed), self.multi_hot)
            # Rows short of a batch wait for the next fill (copied: the batches hold ``mixed``).
            pool = [tuple(column[keep:].copy() for column in mixed)] if keep < pooled else []
            del mixed
            pooled -= keep
            if final:
                return


class _StreamLoader(DataLoader):
    """A DataLoader of a :class:`CriteoStream` that cuts the stream's items back into batches.

    Its workers copy the stream when a pass starts (they are not persistent for this reason), so
    the epoch is set on the stream before that: the training loader has the stream as its
    sampler (:meth:`~recforge.data.base.RecDataModule.resumable`).
    """

    def __init__(self, stream: CriteoStream, num_workers: int) -> None:
        super().__init__(stream, batch_size=None, num_workers=num_workers)

    def __iter__(self) -> Iterator[CTRBatch]:
        items = super().__iter__()
        return items if self.dataset.group == 1 else self._batches(items)

    def _batches(self, items: Iterator[CTRBatch]) -> Iterator[CTRBatch]:
        b = self.dataset.batch_size
        for item in items:
            for s in range(0, item.size, b):
                yield item.rows(s, s + b)


class CriteoDataModule(RecDataModule):
    """Criteo rows from a prepared directory (:mod:`recforge.data.criteo.prepared`), streamed.

    Given ``prepared_dir``, it must be complete (its ``metadata.json`` written). Given
    ``raw_path`` (one file or a list) instead, the raw files are converted once into a directory
    under ``cache_dir`` by :func:`recforge.data.criteo.prepare.ensure_prepared` with the
    parameters in ``prepare``, and reused afterwards (``prepare`` and ``cache_dir`` are ignored
    without ``raw_path``).

    ``batch_size`` rows per training batch, ``eval_batch_size`` per validation and test batch;
    ``num_workers`` DataLoader processes, each decoding its own share of the row groups;
    ``shuffle`` (training only; evaluation is always in file order) and ``shuffle_buffer`` (rows
    mixed at a time, per worker) as the module docstring says; ``drop_last`` drops each rank's
    last training batch when it is partial. A split without rows in the metadata is absent: no
    ``valid`` means no validation (``has_validation``), and testing needs ``test``.

    ``multi_hot`` (``{sizes, distribution, seed}``, see :mod:`recforge.data.criteo.multi_hot`;
    ``mlperf`` is MLPerf's sizes, uniform, seed 0) turns every row's ids into bags as it is read
    (MLPerf DLRM-DCNv2's synthetic multi-hot Criteo): batches then carry
    :class:`~recforge.data.batches.SparseBags`. Null (the default) keeps one id per feature.
    """

    batch_type = CTRBatch

    @checks_ranges("data")
    def __init__(
        self,
        prepared_dir: str | None = None,
        raw_path: str | list[str] | None = None,
        cache_dir: str | None = None,
        prepare: dict | None = None,
        batch_size: Annotated[int, Range(ge=1)] = 128,
        eval_batch_size: Annotated[int, Range(ge=1)] = 16384,
        num_workers: Annotated[int, Range(ge=0)] = 0,
        shuffle: bool = True,
        shuffle_buffer: Annotated[int, Range(ge=0)] = DEFAULT_SHUFFLE_BUFFER,
        drop_last: bool = False,
        multi_hot: Literal["mlperf"] | dict | None = None,
    ) -> None:
        super().__init__()
        if multi_hot == "mlperf":
            multi_hot = {"sizes": list(MLPERF_BAG_SIZES), "distribution": "uniform", "seed": 0}
        if multi_hot is not None and not isinstance(multi_hot, Mapping):
            raise UserInputError(f"data.multi_hot: expected null, mlperf, or a mapping with keys sizes, "
                                 f"distribution, seed, got {multi_hot!r}")
        self.multi_hot_config = None if multi_hot is None else dict(multi_hot)
        self._multi_hot: MultiHot | None = None
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.shuffle_buffer = shuffle_buffer
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if raw_path is not None:
            if prepared_dir is not None:
                raise UserInputError(
                    "data.prepared_dir and data.raw_path are both set: give the prepared directory, or the "
                    "raw files (converted once under data.cache_dir), not both"
                )
            if cache_dir is None:
                raise UserInputError("data.raw_path needs data.cache_dir: where the prepared data is kept")
            prepared_dir = str(self._prepare(raw_path, cache_dir, prepare or {}))
        # Without raw_path, ``prepare`` and ``cache_dir`` are unused: a config keeps its conversion
        # settings while pointing at an already prepared directory.
        if prepared_dir is None:
            raise UserInputError(
                "data.prepared_dir is not set: point it at a prepared Criteo directory, or set "
                "data.raw_path (and data.cache_dir) to convert the raw files there once"
            )
        self.prepared_dir = str(prepared_dir)
        self._meta: dict[str, Any] | None = None
        self._chunks: dict[str, list[Chunk]] = {}

    @staticmethod
    def _prepare(raw_path: str | list[str], cache_dir: str, params: dict) -> Path:
        # Imported here: the conversion (and its dependencies) is needed only for raw inputs.
        from recforge.data.criteo.prepare import ensure_prepared

        # a list from the command line arrives as an OmegaConf ListConfig, not a list
        raw = str(raw_path) if isinstance(raw_path, (str, os.PathLike)) else [str(p) for p in raw_path]
        try:
            inspect.signature(ensure_prepared).bind(raw, cache_dir, **params)
        except TypeError as error:
            raise UserInputError(f"data.prepare: {error}") from None
        return Path(ensure_prepared(raw, cache_dir, **params))

    # ---------------------------------------------------------------- data
    @property
    def metadata(self) -> dict[str, Any]:
        if self._meta is None:
            try:
                self._meta = read_metadata(self.prepared_dir)
            except PreparedDataError as error:
                raise PreparedDataError(f"data.prepared_dir: {error}") from None
            self.check_identity()
        return self._meta

    @property
    def cardinalities(self) -> list[int]:
        return list(self.metadata["cardinalities"])

    @property
    def has_validation(self) -> bool:
        return self.metadata["splits"].get("valid", {}).get("rows", 0) > 0

    @property
    def multi_hot(self) -> MultiHot | None:
        """The multi-hot expansion of ``data.multi_hot`` (None: one id per feature)."""
        if self._multi_hot is None and self.multi_hot_config is not None:
            self._multi_hot = MultiHot.from_config(self.multi_hot_config, self.cardinalities)
        return self._multi_hot

    def task_inputs(self) -> CTRInputs:
        """What the CTR task takes from the data: the 26 table sizes and the dense width."""
        _ = self.multi_hot  # a bad data.multi_hot fails here, at start
        return {"cardinalities": self.cardinalities, "n_dense": N_DENSE}

    def chunks(self, split: str) -> list[Chunk]:
        """The checked row groups of ``split`` (train, valid, test); a one-line error if absent."""
        if split not in self._chunks:
            present = [s for s in SPLITS if self.metadata["splits"].get(s, {}).get("rows", 0) > 0]
            if split not in present:
                raise UserInputError(
                    f"data.prepared_dir={self.prepared_dir}: no {split!r} split (it has "
                    f"{', '.join(present) or 'none'})"
                )
            self._chunks[split] = scan_split(self.prepared_dir, split, self.metadata)
        return self._chunks[split]

    def setup(self, stage: str | None = None) -> None:
        if stage in ("fit", None):
            self.chunks("train")
        if stage in ("fit", "validate", None) and self.has_validation:
            self.chunks("valid")
        if stage == "validate" and not self.has_validation:
            self.chunks("valid")  # the one-line error: nothing to validate on
        if stage == "test" or (stage is None and "test" in self.metadata["splits"]):
            self.chunks("test")

    # ---------------------------------------------------------------- loaders
    def stream(self, split: str, rank: int = 0, world_size: int = 1, group: int = 1) -> CriteoStream:
        """Rank ``rank``'s stream of ``split``: training shares and order for ``train``,
        evaluation's for the others (``group``: see :class:`CriteoStream`)."""
        train = split == "train"
        return CriteoStream(
            self.chunks(split),
            self.batch_size if train else self.eval_batch_size,
            shuffle=train and self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            rank=rank,
            world_size=world_size,
            equal_shares=train,
            drop_last=train and self.drop_last,
            group=group,
            multi_hot=self.multi_hot,
        )

    @staticmethod
    def _group(batch_size: int) -> int:
        # Items of about ITEM_ROWS rows: a worker's hand-over cost is per item, and in-process the
        # tensors are made once per item rather than per batch. Both read the same batches.
        return max(1, ITEM_ROWS // batch_size)

    def train_dataloader(self):
        rank, world = self.rank_and_world()
        stream = self.stream("train", rank, world, self._group(self.batch_size))
        if stream.n_batches == 0:
            raise UserInputError(
                f"data.prepared_dir={self.prepared_dir}: nothing to train on: {stream.n_rows} training rows "
                f"for {world} rank(s) make no batch of data.batch_size={self.batch_size}"
                + (" with data.drop_last=true" if self.drop_last else "")
            )
        if stream.left_out and rank == 0:
            log.info(
                "training reads %d of its %d rows per epoch: %d rank(s) x %d batches of %d%s; %d rows left "
                "out (different ones each epoch when shuffling) so that the ranks run equal batch counts",
                stream.n_rows - stream.left_out, stream.n_rows, world, stream.n_batches, self.batch_size,
                ", the last partial batch dropped" if self.drop_last else "", stream.left_out,
            )
        return self.resumable(_StreamLoader(stream, self.num_workers), stream)

    def eval_dataloader(self, split: str) -> DataLoader:
        name = "valid" if split == "val" else split
        stream = self.stream(name, *self.rank_and_world(), self._group(self.eval_batch_size))
        return _StreamLoader(stream, self.num_workers)

    # ---------------------------------------------------------------- checkpoint
    def identity(self) -> dict:
        """The table sizes, so that a checkpoint's embeddings meet the data they were trained for,
        and the split sizes, which say which data that was (not compared: other rows of the same
        tables are fine)."""
        meta = self.metadata
        return {"cardinalities": list(meta["cardinalities"]),
                "rows": {s: int(info.get("rows", 0)) for s, info in meta["splits"].items()}}

    def identity_known(self) -> bool:
        # the metadata is read at setup, and checks the identity then
        return self._meta is not None

    def identity_mismatch(self, theirs: dict, mine: dict) -> str | None:
        tables = mine["cardinalities"]
        trained = list(theirs.get("cardinalities", tables))  # older checkpoints may not say
        if trained == tables:
            return None
        differ = [f"C{f + 1}: {a} vs {b}" for f, (a, b) in enumerate(zip(trained, tables)) if a != b]
        return (
            f"other tables than data.prepared_dir={self.prepared_dir} holds "
            f"({'; '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}): point data.prepared_dir at that "
            "run's data"
        )


class SyntheticCriteoDataModule(GeneratedData, CriteoDataModule):
    """Criteo-shaped rows from the synthetic click model (:mod:`recforge.data.criteo.synthetic`),
    generated once into ``cache_dir/<hash of generator and split>/`` and reused.

    ``generator``: :class:`SyntheticCriteoConfig` fields; ``split``: the train, valid, test
    fractions (a zero leaves the split out). The other arguments are :class:`CriteoDataModule`'s.
    ``metadata["oracle_auc"]`` and ``metadata["oracle_logloss"]`` are the true click
    probabilities' test metrics: the best any model of this data can reach.
    """

    generator_config = SyntheticCriteoConfig
    describes = "Criteo"

    def __init__(
        self,
        cache_dir: str,
        generator: dict | None = None,
        split: Sequence[Annotated[float, Range(ge=0, le=1)]] = (0.7, 0.2, 0.1),
        **kwargs,
    ) -> None:
        if kwargs.get("prepared_dir") is not None or kwargs.get("raw_path") is not None:
            raise UserInputError(
                "data.prepared_dir and data.raw_path are not for synthetic data: it is generated into data.cache_dir"
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in ("prepared_dir", "raw_path")}
        try:
            self.synthetic_split = list(check_split(split))
        except (TypeError, ValueError) as error:
            raise UserInputError(f"data.split: {error}") from None
        super().__init__(cache_dir, generator, **kwargs)

    def generate(self, cache_dir: Path, kwargs: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        path = ensure_synthetic_criteo(self.generator, cache_dir, self.synthetic_split)
        return path, {**kwargs, "prepared_dir": str(path)}

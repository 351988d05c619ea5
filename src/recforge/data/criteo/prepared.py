"""The prepared Criteo format: parquet parts per split plus one ``metadata.json``, written atomically.

A prepared directory is what the conversion (:mod:`recforge.data.criteo.prepare`) and the
synthetic generator write and what :class:`recforge.data.criteo.datamodule.CriteoDataModule`
reads::

    <dir>/metadata.json            written last: its presence means the directory is complete
    <dir>/<split>/part-00000.parquet, part-00001.parquet, ...    split in SPLITS

Each part has the columns ``label`` (int8, 0 or 1), ``I1`` .. ``I13`` (float32, already
transformed: log(1 + max(x, 0)), missing = 0) and ``C1`` .. ``C26`` (int32, the index of the
value in its feature's table, ``[0, cardinalities[f])``). Rows keep the order the split defines.

``metadata.json`` holds at least: ``format`` (:data:`FORMAT`), ``version``, ``splits``
(``{split: {"rows": n, "positives": k, "files": [relative paths]}}``), ``cardinalities`` (26
table sizes), ``dense_transform``, ``categorical`` (the index mode and its settings), ``split``
(how rows were assigned), ``source`` and ``malformed`` (what was skipped, with examples).

:class:`PreparedWriter` writes through :class:`recforge.data.prepared_dir.StagedDir`: into a
temporary directory beside the target, moved into place with ``metadata.json`` last on success and
removed on any error, so a failed conversion never leaves a directory that looks prepared.
"""
from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.prepared_dir import StagedDir
from recforge.errors import UserInputError

__all__ = [
    "DENSE_COLUMNS",
    "FORMAT",
    "LABEL_COLUMN",
    "N_DENSE",
    "N_SPARSE",
    "SPARSE_COLUMNS",
    "SPLITS",
    "PreparedDataError",
    "PreparedWriter",
    "read_metadata",
    "split_files",
]

FORMAT = "recforge-criteo-prepared"
VERSION = 1
N_DENSE = 13
N_SPARSE = 26
LABEL_COLUMN = "label"
DENSE_COLUMNS = tuple(f"I{i}" for i in range(1, N_DENSE + 1))
SPARSE_COLUMNS = tuple(f"C{i}" for i in range(1, N_SPARSE + 1))
SPLITS = ("train", "valid", "test")
METADATA = "metadata.json"

SCHEMA = pa.schema(
    [pa.field(LABEL_COLUMN, pa.int8())]
    + [pa.field(c, pa.float32()) for c in DENSE_COLUMNS]
    + [pa.field(c, pa.int32()) for c in SPARSE_COLUMNS]
)


class PreparedDataError(UserInputError):
    """A prepared directory that is missing, incomplete or not in this format."""


class PreparedWriter:
    """Streams rows into a prepared directory; use as a context manager.

    ``write(split, labels [n], dense [n, 13], sparse [n, 26])`` appends rows to ``split``
    (a new part file every ``rows_per_part`` rows; parquet row groups of ``row_group_size``).
    ``finish(cardinalities, **metadata)`` closes the parts and publishes the directory with
    ``metadata.json`` last (over an existing one). Leaving the ``with`` block without ``finish``
    (an exception) removes everything written; an existing directory has lost its metadata then.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        rows_per_part: int = 4_000_000,
        row_group_size: int = 262_144,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.rows_per_part = int(rows_per_part)
        self.row_group_size = int(row_group_size)
        self._staged = StagedDir(self.out_dir, METADATA)
        self._tmp: Path | None = None
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._part_rows: dict[str, int] = {}
        self._files: dict[str, list[str]] = {s: [] for s in SPLITS}
        self._rows: dict[str, int] = {s: 0 for s in SPLITS}
        self._positives: dict[str, int] = {s: 0 for s in SPLITS}
        self.finished = False

    def __enter__(self) -> PreparedWriter:
        self._tmp = self._staged.__enter__().path
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:
            try:
                self._close_writers()
            except OSError:
                pass  # the staged files go anyway; the error that brought us here is the one to tell
        self._staged.__exit__(exc_type, exc, tb)

    @property
    def rows(self) -> dict[str, int]:
        """Rows written so far per split."""
        return dict(self._rows)

    def _close_writers(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def _writer(self, split: str) -> pq.ParquetWriter:
        writer = self._writers.get(split)
        if writer is not None and self._part_rows[split] >= self.rows_per_part:
            writer.close()
            writer = None
        if writer is None:
            rel = f"{split}/part-{len(self._files[split]):05d}.parquet"
            (self._tmp / split).mkdir(exist_ok=True)
            writer = pq.ParquetWriter(self._tmp / rel, SCHEMA)
            self._writers[split] = writer
            self._part_rows[split] = 0
            self._files[split].append(rel)
        return writer

    def write(self, split: str, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        try:
            self._write(split, labels, dense, sparse)
        except OSError as error:
            raise self._write_error(error) from None

    def _write_error(self, error: OSError) -> PreparedDataError:
        """A failed write (a full disk, a quota, a read-only file system) as one line naming the
        directory; raised inside the with-block, so the staged files are removed on the way out."""
        text = str(error)
        full = error.errno == errno.ENOSPC or "No space left" in text
        what = "the disk is full" if full else (error.strerror or text or type(error).__name__)
        return PreparedDataError(f"{self.out_dir}: writing the prepared data failed ({what}); "
                                 "nothing was left there")

    def _write(self, split: str, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        if self._tmp is None:
            raise RuntimeError("PreparedWriter is used outside its with-block")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        n = len(labels)
        if dense.shape != (n, N_DENSE) or sparse.shape != (n, N_SPARSE):
            raise ValueError(
                f"expected dense [{n}, {N_DENSE}] and sparse [{n}, {N_SPARSE}], got "
                f"{tuple(dense.shape)} and {tuple(sparse.shape)}"
            )
        start = 0
        while start < n:
            writer = self._writer(split)
            take = min(n - start, self.rows_per_part - self._part_rows[split])
            rows = slice(start, start + take)
            arrays = [pa.array(np.asarray(labels[rows], dtype=np.int8))]
            dense_part = np.asarray(dense[rows], dtype=np.float32)
            sparse_part = np.asarray(sparse[rows], dtype=np.int32)
            arrays += [pa.array(dense_part[:, j]) for j in range(N_DENSE)]
            arrays += [pa.array(sparse_part[:, j]) for j in range(N_SPARSE)]
            writer.write_table(pa.Table.from_arrays(arrays, schema=SCHEMA), row_group_size=self.row_group_size)
            self._part_rows[split] += take
            self._rows[split] += take
            self._positives[split] += int(np.count_nonzero(labels[rows]))
            start += take

    def finish(self, cardinalities: Sequence[int], **metadata: Any) -> Path:
        """Close the parts and publish the directory with its metadata; its path."""
        if self._tmp is None:
            raise RuntimeError("PreparedWriter.finish outside its with-block")
        cardinalities = [int(c) for c in cardinalities]
        if len(cardinalities) != N_SPARSE or min(cardinalities) < 1:
            raise ValueError(f"expected {N_SPARSE} positive cardinalities, got {cardinalities}")
        try:
            self._close_writers()
        except OSError as error:
            raise self._write_error(error) from None
        splits = {
            s: {"rows": self._rows[s], "positives": self._positives[s], "files": self._files[s]}
            for s in SPLITS if self._rows[s]
        }
        meta = {"format": FORMAT, "version": VERSION, "splits": splits, "cardinalities": cardinalities,
                "dense_transform": "log1p_clip0", **metadata}
        try:
            self._staged.publish(meta)
        except OSError as error:
            raise self._write_error(error) from None
        self.finished = True
        return self.out_dir


def read_metadata(prepared_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of a complete prepared directory; one-line errors otherwise."""
    root = Path(prepared_dir)
    path = root / METADATA
    if not root.is_dir():
        raise PreparedDataError(f"{root}: no such directory (prepare the raw Criteo files first)")
    if not path.is_file():
        raise PreparedDataError(f"{root}: not a prepared Criteo directory (no {METADATA}: conversion unfinished?)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PreparedDataError(f"{path}: not valid JSON ({error})") from None
    if meta.get("format") != FORMAT:
        raise PreparedDataError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise PreparedDataError(f"{path}: version {meta.get('version')!r}, this code reads {VERSION}")
    cards = meta.get("cardinalities")
    if not isinstance(cards, list) or len(cards) != N_SPARSE or not all(isinstance(c, int) and c > 0 for c in cards):
        raise PreparedDataError(f"{path}: field 'cardinalities': expected {N_SPARSE} positive integers")
    for split, info in meta.get("splits", {}).items():
        for rel in info.get("files", []):
            if not (root / rel).is_file():
                raise PreparedDataError(f"{path}: split {split!r} lists {rel}, which is missing")
    return meta


def split_files(prepared_dir: str | os.PathLike[str], split: str, meta: dict[str, Any] | None = None) -> list[Path]:
    """The parquet parts of ``split`` in order; empty when the directory has no such split."""
    meta = meta or read_metadata(prepared_dir)
    info = meta["splits"].get(split)
    return [Path(prepared_dir) / rel for rel in info["files"]] if info else []

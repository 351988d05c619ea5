"""The parsed rows of a vocab conversion, kept on disk between its two passes.

A ``categorical="vocab"`` conversion needs the whole training split's counts before it can index
any value. Rather than parse the text a second time (the parse is most of a conversion's cost),
its first pass writes each run's parsed rows here, in file order, and the second pass reads them
back run by run. Per row: the split code and the label (1 byte each), the 13 transformed dense
values (float32) and the 26 raw categorical values (uint32) with a missing bit each: 162 bytes,
about 7.4 GB for Criteo Kaggle's 45.8M rows, against about 240 bytes a row of text.

The file lives in a directory beside the output named as a staging directory of it
(``.<name>.<random>.tmp``): it is removed when the conversion ends, however it ends, and a run
killed before that leaves it where the next conversion of the same output removes it
(:func:`recforge.data.prepared_dir.build_once`); nothing reads it as prepared data.
"""
from __future__ import annotations

import errno
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from recforge.data.criteo.prepared import N_DENSE, N_SPARSE, PreparedDataError

__all__ = ["BYTES_PER_ROW", "RunSpill", "SpilledRun"]

BYTES_PER_ROW = 1 + 1 + 4 * N_DENSE + 4 * N_SPARSE + N_SPARSE / 8
_KAGGLE_ROWS = 45_840_617

SpilledRun = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class RunSpill:
    """``with RunSpill(out_dir) as spill``: :meth:`write` runs in order, then :meth:`runs` reads
    them back in the same order (once). Leaving the block removes the file and its directory."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.directory: Path | None = None
        self._handle = None
        self._sizes: list[int] = []

    def __enter__(self) -> RunSpill:
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.directory = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.", suffix=".tmp",
                                                   dir=self.out_dir.parent))
            self._handle = open(self.directory / "parsed_rows.bin", "wb")
        except OSError as error:
            self._remove()
            raise self._error(error) from None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._remove()

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _error(self, error: OSError) -> PreparedDataError:
        full = error.errno == errno.ENOSPC or "No space left" in str(error)
        what = "the disk is full" if full else (error.strerror or str(error) or type(error).__name__)
        return PreparedDataError(
            f"{self.out_dir.parent}: keeping the parsed rows of {self.out_dir.name} there between the "
            f"vocabulary pass and the encoding pass failed ({what}); it needs about {BYTES_PER_ROW:.0f} "
            f"bytes a row ({BYTES_PER_ROW * _KAGGLE_ROWS / 1e9:.1f} GB for Criteo Kaggle) besides the "
            "output, or --no-spill (parses the text twice, no temporary file); nothing was left there")

    def write(self, codes: np.ndarray, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        """One run's rows: split codes [n] int8, labels [n] int8, transformed dense [n, 13] float32,
        raw categorical values [n, 26] int64 (-1 = missing), the 2-d arrays column-major."""
        n = len(labels)
        missing = np.packbits((sparse < 0).ravel(order="F"))
        arrays = (codes.astype(np.int8, copy=False), labels.astype(np.int8, copy=False),
                  np.asfortranarray(dense, dtype=np.float32), sparse.astype(np.uint32, order="F"), missing)
        try:
            for array in arrays:
                # order="A": column-major arrays go out column by column, as they are read back
                self._handle.write(memoryview(array.ravel(order="A")))
        except OSError as error:
            raise self._error(error) from None
        self._sizes.append(n)

    def runs(self) -> Iterator[SpilledRun]:
        """``(codes, labels, dense, values, missing)`` of each run written, in order: ``values``
        [n, 26] uint32 and ``missing`` [n, 26] bool, column-major."""
        try:
            self._handle.close()
            self._handle = open(self.directory / "parsed_rows.bin", "rb")
        except OSError as error:
            raise self._error(error) from None
        handle = self._handle
        for n in self._sizes:
            codes = self._read(handle, np.int8, n)
            labels = self._read(handle, np.int8, n)
            dense = self._read(handle, np.float32, n * N_DENSE).reshape((n, N_DENSE), order="F")
            values = self._read(handle, np.uint32, n * N_SPARSE).reshape((n, N_SPARSE), order="F")
            bits = self._read(handle, np.uint8, (n * N_SPARSE + 7) // 8)
            missing = np.unpackbits(bits, count=n * N_SPARSE).view(bool).reshape((n, N_SPARSE), order="F")
            yield codes, labels, dense, values, missing

    def _read(self, handle, dtype: type, count: int) -> np.ndarray:
        array = np.empty(count, dtype=dtype)
        try:
            got = handle.readinto(memoryview(array).cast("B"))
        except OSError as error:
            raise self._error(error) from None
        if got != array.nbytes:
            raise PreparedDataError(f"{self.directory}: the file of parsed rows ended early (removed or "
                                    "truncated while the conversion ran)")
        return array

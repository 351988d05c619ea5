"""Chunked, validated reading of raw CSV files: the session datasets' view of
:mod:`recforge.data.delimited`, raising :class:`RawDataError`, plus the id codings their
pipelines share.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from recforge.data import delimited
from recforge.data.delimited import Col, DelimitedFileError, Table

__all__ = [
    "Col",
    "FirstSeenCodes",
    "RawDataError",
    "Table",
    "categorical",
    "concat_parts",
    "iter_chunks",
    "numeric_items",
]


class RawDataError(DelimitedFileError):
    """A raw dataset file is missing or does not have the expected format."""


def iter_chunks(path: Path, table: Table, chunksize: int) -> Iterator[pd.DataFrame]:
    """Yield chunks of ``path`` with one column per ``table.cols`` entry, named by its key.

    Only the needed columns are read. Raises ``RawDataError`` naming the file (and the line and
    column where possible) when the file is missing or a value does not parse.
    """
    return delimited.iter_chunks(path, table, chunksize, error=RawDataError)


class FirstSeenCodes:
    """Integer codes for labels in order of first appearance, consistent across chunks."""

    def __init__(self) -> None:
        self._labels = pd.Index([], dtype=object)

    def encode(self, values: pd.Series) -> np.ndarray:
        """Codes of ``values``; labels not seen before get the next codes, in order."""
        codes = self._labels.get_indexer(values)
        unseen = codes < 0
        if unseen.any():
            fresh = pd.unique(values[unseen].to_numpy())  # keeps first-appearance order
            self._labels = self._labels.append(pd.Index(fresh, dtype=object))
            codes[unseen] = self._labels.get_indexer(values[unseen])
        return codes.astype(np.int64)

    @property
    def labels(self) -> pd.Index:
        return self._labels


def categorical(codes: np.ndarray, labels: Sequence[Any]) -> pd.Categorical:
    """A categorical of ``labels[codes]`` whose category order is the order of ``labels``."""
    return pd.Categorical.from_codes(codes, categories=pd.Index(labels, dtype=object))


def numeric_items(ids: np.ndarray) -> pd.Categorical:
    """Integer item ids as a categorical of their decimal text, ordered by numeric value.

    The reference scripts read these ids as integers, so equal timestamps break by numeric id.
    """
    codes, uniques = pd.factorize(ids, sort=True)
    return categorical(codes, [str(v) for v in uniques])


def concat_parts(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """Concatenate chunk frames; an empty frame with ``columns`` when there are none."""
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=np.int64) for c in columns})
    return pd.concat(parts, ignore_index=True)

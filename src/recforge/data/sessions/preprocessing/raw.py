"""Chunked, validated reading of raw CSV files.

The typed pandas parser reads fast but only says *that* a value is bad; when it fails, the file is
read again as text to name the line and column of the first bad value.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from recforge.errors import UserInputError

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


class RawDataError(UserInputError):
    """A raw dataset file is missing or does not have the expected format."""


@dataclass(frozen=True)
class Col:
    """One raw column: ``key`` names it in the chunks, ``names`` are accepted header spellings."""

    key: str
    kind: str  # "int" -> int64, "text" -> str ("" when empty), "time" -> int64 µs since epoch
    names: tuple[str, ...]
    position: int | None = None  # 0-based, for files without a header
    time_format: str | None = None
    example: str | None = None  # shown in errors about "time" columns
    nonempty: bool = True


@dataclass(frozen=True)
class Table:
    """The layout of one raw file format."""

    description: str
    sep: str
    has_header: bool
    cols: tuple[Col, ...]


@dataclass
class _Located:
    """A table bound to one file: the header names (or positions) actually present."""

    path: Path
    table: Table
    column_of: dict[str, Any] = field(default_factory=dict)  # key -> header name or position
    number_of: dict[str, int] = field(default_factory=dict)  # key -> 1-based column number

    @property
    def usecols(self) -> list[Any]:
        return [self.column_of[c.key] for c in self.table.cols]

    def line(self, row_label: Any) -> int:
        return int(row_label) + (2 if self.table.has_header else 1)


def iter_chunks(path: Path, table: Table, chunksize: int) -> Iterator[pd.DataFrame]:
    """Yield chunks of ``path`` with one column per ``table.cols`` entry, named by its key.

    Only the needed columns are read. Raises ``RawDataError`` naming the file (and the line and
    column where possible) when the file is missing or a value does not parse.
    """
    located = _locate(path, table)
    dtypes = {located.column_of[c.key]: ("int64" if c.kind == "int" else str) for c in table.cols}
    rename = {located.column_of[c.key]: c.key for c in table.cols}
    try:
        reader = pd.read_csv(
            path,
            sep=table.sep,
            header=0 if table.has_header else None,
            usecols=located.usecols,
            dtype=dtypes,
            keep_default_na=False,  # "NA" or "null" may be real ids; only empty fields are missing
            na_values=[""],
            chunksize=chunksize,
            encoding="utf-8",
        )
        with reader:
            for chunk in reader:
                yield _typed(chunk.rename(columns=rename), located, chunksize)
    except RawDataError:
        raise
    except pd.errors.ParserError as exc:
        raise RawDataError(f"{path}: malformed {table.description} data: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise RawDataError(f"{path}: not valid UTF-8 text: {exc}") from exc
    except (ValueError, OverflowError, TypeError) as exc:
        _diagnose(located, chunksize, exc)
        raise RawDataError(f"{path}: could not parse {table.description}: {exc}") from exc


def _typed(chunk: pd.DataFrame, located: _Located, chunksize: int) -> pd.DataFrame:
    for col in located.table.cols:
        values = chunk[col.key]
        if col.kind == "time":
            values = _parse_time(values, col)
        elif col.kind == "int" or not col.nonempty:
            continue
        if values.isna().any():
            _diagnose(located, chunksize)
            raise RawDataError(f"{located.path}: empty or unparsable {col.names[0]!r} values")
        chunk[col.key] = values.astype(np.int64) if col.kind == "time" else values
    for col in located.table.cols:
        if col.kind == "text" and not col.nonempty:
            chunk[col.key] = chunk[col.key].fillna("")
    return chunk


def _locate(path: Path, table: Table) -> _Located:
    """Check that the file exists and its header (or first line) has the needed columns."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise RawDataError(f"{table.description} file {path} {what}")
    try:
        # utf-8-sig: a byte-order mark must not hide the first column's name.
        with open(path, encoding="utf-8-sig", newline="") as handle:
            first = handle.readline().rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise RawDataError(f"{path}: not valid UTF-8 text: {exc}") from exc
    if not first.strip():
        raise RawDataError(f"{path}, line 1: the file is empty or starts with a blank line")
    fields = [f.strip().strip('"') for f in first.split(table.sep)]
    located = _Located(path, table)
    if table.has_header:
        missing = []
        for col in table.cols:
            found = [n for n in col.names if n in fields]
            if not found:
                missing.append(" or ".join(col.names))
                continue
            located.column_of[col.key] = found[0]
            located.number_of[col.key] = fields.index(found[0]) + 1
        if missing:
            expected = [" or ".join(c.names) for c in table.cols]
            hint = ""
            if len(fields) == 1 and any(s in first for s in ",;\t" if s != table.sep):
                hint = f" (the file must be separated by {table.sep!r})"
            raise RawDataError(
                f"{path}, line 1 (header): missing column(s) {missing}; expected columns "
                f"{expected} separated by {table.sep!r}, found {fields}{hint}"
            )
    else:
        needed = max(int(c.position or 0) for c in table.cols) + 1
        if len(fields) < needed:
            names = table.sep.join(c.names[0] for c in table.cols)
            raise RawDataError(
                f"{path}, line 1: expected at least {needed} {table.sep!r}-separated fields "
                f"({names}, no header), found {len(fields)}: {first[:200]!r}"
            )
        for col in table.cols:
            located.column_of[col.key] = col.position
            located.number_of[col.key] = int(col.position or 0) + 1
    return located


def _parse_time(values: pd.Series, col: Col) -> pd.Series:
    """Text timestamps -> microseconds since the Unix epoch (UTC); NaN where unparsable."""
    stamps = pd.to_datetime(values, format=col.time_format, utc=True, errors="coerce")
    # Microseconds keep RSC15's milliseconds exact, and stay exact in float64 for real dates.
    return (stamps - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(microseconds=1)


def _diagnose(located: _Located, chunksize: int, cause: BaseException | None = None) -> None:
    """Raise a RawDataError for the first bad value, reading every column as raw text."""
    table = located.table
    try:
        reader = pd.read_csv(
            located.path,
            sep=table.sep,
            header=0 if table.has_header else None,
            usecols=located.usecols,
            dtype=str,
            keep_default_na=False,
            na_filter=False,
            skip_blank_lines=False,  # one row per text line, so row labels give line numbers
            chunksize=chunksize,
            encoding="utf-8",
        )
        with reader:
            for chunk in reader:
                _report_first_bad(chunk.fillna(""), located, cause)
    except pd.errors.ParserError as exc:
        message = f"{located.path}: malformed {table.description} data: {exc}"
        raise RawDataError(message) from (cause or exc)


def _report_first_bad(chunk: pd.DataFrame, located: _Located, cause: BaseException | None) -> None:
    problems: list[tuple[int, str]] = []
    for col in located.table.cols:
        text = chunk[located.column_of[col.key]].astype(str)
        bad, expected = _bad_values(text, col)
        if bad.any():
            i = int(np.argmax(bad))
            got = repr(text.iat[i]) if text.iat[i] else "an empty field"
            where = f"column {located.number_of[col.key]} ({col.names[0]})"
            problems.append((i, f"{where}: expected {expected}, got {got}"))
    if problems:
        i, message = min(problems)
        label = chunk.index[i]
        headerless_first = not located.table.has_header and label == 0
        hint = " (this format has no header line)" if headerless_first else ""
        line = located.line(label)
        raise RawDataError(f"{located.path}, line {line}, {message}{hint}") from cause


def _bad_values(text: pd.Series, col: Col) -> tuple[np.ndarray, str]:
    """Mask of the values of ``text`` that ``col`` rejects, and what it expects instead."""
    stripped = text.str.strip()
    if col.kind == "int":
        return ~stripped.str.fullmatch(r"[+-]?\d+").to_numpy(dtype=bool), "an integer"
    if col.kind == "time":
        parsed = pd.to_datetime(text, format=col.time_format, utc=True, errors="coerce")
        return parsed.isna().to_numpy(), f"a timestamp like {col.example!r}"
    if col.nonempty:
        return (stripped == "").to_numpy(dtype=bool), "a non-empty value"
    return np.zeros(len(text), dtype=bool), ""


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

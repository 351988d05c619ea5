"""Validated reading of delimited text files (CSV, TSV, MovieLens ``::``), for every data family.

The typed pandas parser reads fast but only says *that* a value is bad. When it fails, the file is
read again as text (chunk by chunk, one frame row per text line) to name the file, the line and the
field of the first bad value and what was expected there.

Handled: gzip (told by its magic bytes, whatever the name), CRLF line ends, a UTF-8 byte-order
mark, files with a header (columns found by name, any order, extra columns ignored) or without one
(columns by position), and multi-character separators such as MovieLens' ``::``. pandas' fast C parser takes only single
characters, and its Python engine is an order of magnitude slower (ml-20m has 20M lines), so
such a separator is rewritten to one control character while the bytes stream to the C parser.
"""
from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from recforge.data.compressed import describe_compression, open_decompressed
from recforge.errors import UserInputError

__all__ = [
    "Col",
    "DelimitedFileError",
    "Table",
    "describe_separator",
    "iter_chunks",
    "locate",
    "open_text_bytes",
    "parser_separator",
    "read_table",
]

# Stands in for a multi-character separator; a file that contains it is refused.
_STAND_IN = b"\x1f"
_BLOCK = 1 << 20
# Up to 18 digits always fits in int64, so only longer integers need an exact range check.
_SAFE_INT_DIGITS = 18
_INT64_MIN, _INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
_INT_RE = r"\s*[+-]?\d+\s*"
_KINDS = ("int", "float", "text", "time")


class DelimitedFileError(UserInputError):
    """A delimited text file is missing or malformed. The message names the file and, where one
    value is at fault, its line and field; ``line``, ``field`` and ``detail`` carry them apart
    so that a format's reader can phrase them its own way."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | None = None,
        line: int | None = None,
        field: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.field = field
        self.detail = detail


@dataclass(frozen=True)
class Col:
    """One column: ``key`` names it in the chunks, ``names`` are accepted header spellings (the
    first one names it in errors).

    ``kind``: ``int`` (int64; at least ``minimum`` when given), ``float`` (float64; finite unless
    ``finite=False``), ``text`` (str; ``""`` when empty and ``nonempty=False``), ``time`` (text
    parsed with ``time_format`` into int64 microseconds since the epoch, UTC). ``expected``
    overrides the words errors use for a valid value.
    """

    key: str
    kind: str
    names: tuple[str, ...]
    position: int | None = None  # 0-based, for files without a header
    time_format: str | None = None
    example: str | None = None  # shown in errors about "time" columns
    nonempty: bool = True
    finite: bool = True
    expected: str | None = None
    minimum: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Col {self.key!r}: kind must be one of {_KINDS}, got {self.kind!r}")

    @property
    def name(self) -> str:
        return self.names[0]

    def expectation(self) -> str:
        if self.expected is not None:
            return self.expected
        if self.kind == "int":
            return "an integer"
        if self.kind == "float":
            return "a finite number" if self.finite else "a number"
        if self.kind == "time":
            return f"a timestamp like {self.example!r}"
        return "a non-empty value"


@dataclass(frozen=True)
class Table:
    """The layout of one file format.

    ``quoting`` is a :mod:`csv` constant; MovieLens ``::`` files take ``csv.QUOTE_NONE`` (titles
    hold bare double quotes). A multi-character ``sep`` implies that no value contains it.
    """

    description: str
    sep: str
    has_header: bool
    cols: tuple[Col, ...]
    encoding: str = "utf-8"
    quoting: int = csv.QUOTE_MINIMAL
    encoding_errors: str = "strict"

    def __post_init__(self) -> None:
        if not self.sep:
            raise ValueError(f"{self.description}: the separator must not be empty")
        if not self.has_header and any(c.position is None for c in self.cols):
            raise ValueError(f"{self.description}: a file without a header needs column positions")


def describe_separator(sep: str) -> str:
    """``tab-separated``, ``separated by ','``: how errors name a separator."""
    return "tab-separated" if sep == "\t" else f"separated by {sep!r}"


@dataclass
class _Located:
    """A table bound to one file: the header names (or positions) actually present."""

    path: Path
    table: Table
    error: type[DelimitedFileError]
    column_of: dict[str, Any] = field(default_factory=dict)  # key -> header name or position
    number_of: dict[str, int] = field(default_factory=dict)  # key -> 1-based column number
    name_of: dict[str, str] = field(default_factory=dict)  # key -> its name in messages

    @property
    def usecols(self) -> list[Any]:
        return [self.column_of[c.key] for c in self.table.cols]

    def line(self, row_label: Any) -> int:
        return int(row_label) + (2 if self.table.has_header else 1)


# ---------------------------------------------------------------------------- opening
class _SeparatorRewriter(io.RawIOBase):
    """The bytes of ``raw`` with every ``sep`` replaced by :data:`_STAND_IN`, left to right."""

    def __init__(self, raw: IO[bytes], sep: bytes, path: Path, error: type[DelimitedFileError]):
        self._raw = raw
        self._sep = sep
        self._path = path
        self._error = error
        self._pending = b""  # rewritten bytes not handed out yet
        self._held = b""  # a trailing part of sep, completed (or not) by the next block
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending and not self._eof:
            block = self._raw.read(_BLOCK)
            if _STAND_IN in block:
                raise self._error(
                    f"{self._path}: contains the control character {_STAND_IN!r}, which cannot be "
                    f"read with the separator {self._sep.decode()!r}",
                    path=self._path,
                )
            if not block:
                self._eof = True
                self._pending, self._held = self._held, b""
                break
            text = (self._held + block).replace(self._sep, _STAND_IN)
            self._held = b""
            # A separator cut in two by the block boundary is finished by the next block.
            for k in range(len(self._sep) - 1, 0, -1):
                if text.endswith(self._sep[:k]):
                    text, self._held = text[:-k], text[-k:]
                    break
            self._pending = text
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def open_text_bytes(
    path: str | os.PathLike[str],
    sep: str | None = None,
    error: type[DelimitedFileError] = DelimitedFileError,
) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip; with a multi-character
    ``sep``, each occurrence is replaced by one control character (the separator to give pandas
    is then :func:`parser_separator`)."""
    path = Path(path)
    raw = open_decompressed(path)
    if sep is None or len(sep) == 1:
        return raw
    return io.BufferedReader(_SeparatorRewriter(raw, sep.encode(), path, error), _BLOCK)


def parser_separator(sep: str) -> str:
    """The separator pandas' C parser sees for a file opened by :func:`open_text_bytes`."""
    return sep if len(sep) == 1 else _STAND_IN.decode()


def _check_file(path: Path, table: Table, error: type[DelimitedFileError]) -> None:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise error(f"{table.description} file {path} {what}", path=path)


def _first_line(path: Path, table: Table, error: type[DelimitedFileError]) -> str:
    encoding = "utf-8-sig" if table.encoding.lower().replace("_", "-") in ("utf-8", "utf8") \
        else table.encoding
    try:
        with open_text_bytes(path) as handle:
            raw = handle.readline(1 << 20)
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise error(f"{path}: cannot be read as {describe_compression(path)}: {exc}", path=path) from exc
    try:
        # A byte-order mark must not hide the first column's name.
        return raw.decode(encoding, errors=table.encoding_errors).rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise error(f"{path}, line 1: not valid {table.encoding} text: {exc}", path=path,
                    line=1) from exc


def locate(
    path: str | os.PathLike[str], table: Table, error: type[DelimitedFileError] = DelimitedFileError
) -> _Located:
    """Check that ``path`` exists and its header (or first line) has the table's columns."""
    path = Path(path)
    _check_file(path, table, error)
    first = _first_line(path, table, error)
    if not first.strip():
        raise error(f"{path}, line 1: the file is empty or starts with a blank line "
                    f"(expected {_layout(table)})", path=path, line=1)
    fields = [f.strip().strip('"') for f in first.split(table.sep)]
    located = _Located(path, table, error)
    sep_words = describe_separator(table.sep)
    others = [s for s in (",", ";", "\t", "::", "|") if s != table.sep and s in first]
    hint = f" (the file must be {sep_words})" if len(fields) == 1 and others else ""
    if table.has_header:
        missing = []
        for col in table.cols:
            found = [n for n in col.names if n in fields]
            if not found:
                missing.append(" or ".join(col.names))
                continue
            located.column_of[col.key] = found[0]
            located.number_of[col.key] = fields.index(found[0]) + 1
            located.name_of[col.key] = found[0]
        if missing:
            expected = [" or ".join(c.names) for c in table.cols]
            raise error(
                f"{path}, line 1 (header): missing column(s) {missing}; expected columns "
                f"{expected} {sep_words}, found {fields}{hint}",
                path=path, line=1,
            )
    else:
        needed = max(int(c.position or 0) for c in table.cols) + 1
        if len(fields) < needed:
            raise error(
                f"{path}, line 1: expected at least {needed} fields {sep_words} "
                f"({_layout(table)}), found {len(fields)}: {first[:200]!r}{hint}",
                path=path, line=1,
            )
        for col in table.cols:
            located.column_of[col.key] = col.position
            located.number_of[col.key] = int(col.position or 0) + 1
            located.name_of[col.key] = col.name
    return located


def _layout(table: Table) -> str:
    if table.has_header:
        names = ", ".join(c.name for c in table.cols)
        return f"a header line naming {names}, then data rows"
    ordered = sorted(table.cols, key=lambda c: int(c.position or 0))
    return f"{table.sep.join(c.name for c in ordered)}, no header"


# ---------------------------------------------------------------------------- reading
def _read_csv(located: _Located, handle: IO[bytes], *, text: bool, chunksize: int | None):
    table = located.table
    if text:
        dtypes: Any = str
        na = dict(na_filter=False, skip_blank_lines=False)  # one row per text line
    else:
        dtypes = {
            located.column_of[c.key]: {"int": "int64", "float": "float64"}.get(c.kind, str)
            for c in table.cols
        }
        # "NA" or "null" may be real ids: only empty fields are missing.
        na = dict(keep_default_na=False, na_values=[""])
    return pd.read_csv(
        handle,
        sep=parser_separator(table.sep),
        header=0 if table.has_header else None,
        usecols=located.usecols,
        dtype=dtypes,
        chunksize=chunksize,
        encoding=table.encoding,
        encoding_errors=table.encoding_errors,
        quoting=table.quoting,
        engine="c",
        **na,
    )


def iter_chunks(
    path: str | os.PathLike[str],
    table: Table,
    chunksize: int | None,
    *,
    error: type[DelimitedFileError] = DelimitedFileError,
) -> Iterator[pd.DataFrame]:
    """Yield frames of ``path`` with one column per ``table.cols`` entry, named by its key.

    ``chunksize`` rows at a time (None: the whole file as one frame). Only the needed columns are
    read. Raises ``error`` naming the file, and the line and field where one value is at fault.
    """
    path = Path(path)
    located = locate(path, table, error)
    rename = {located.column_of[c.key]: c.key for c in table.cols}
    handle = open_text_bytes(path, table.sep, error)
    try:
        with handle:
            result = _read_csv(located, handle, text=False, chunksize=chunksize)
            chunks = [result] if chunksize is None else result
            try:
                for chunk in chunks:
                    yield _typed(chunk.rename(columns=rename), located, chunksize)
            finally:
                if chunksize is not None:
                    result.close()
    except DelimitedFileError:
        raise
    except pd.errors.ParserError as exc:
        raise error(f"{path}: malformed {table.description} data: {exc}", path=path) from exc
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid {table.encoding} text: {exc}", path=path) from exc
    except (OSError, EOFError) as exc:
        raise error(f"{path}: cannot be read as {describe_compression(path)}: {exc}", path=path) from exc
    except (ValueError, OverflowError, TypeError) as exc:
        _diagnose(located, chunksize, exc)
        raise error(f"{path}: could not parse {table.description}: {exc}", path=path) from exc


def read_table(
    path: str | os.PathLike[str],
    table: Table,
    *,
    error: type[DelimitedFileError] = DelimitedFileError,
) -> pd.DataFrame:
    """The whole file as one frame (see :func:`iter_chunks`); refuses a file without data rows."""
    frame = next(iter_chunks(path, table, None, error=error))
    if len(frame) == 0:
        what = "after the header " if table.has_header else ""
        raise error(f"{path}: no data rows {what}(expected at least one)", path=Path(path))
    return frame


def _typed(chunk: pd.DataFrame, located: _Located, chunksize: int | None) -> pd.DataFrame:
    for col in located.table.cols:
        values = chunk[col.key]
        if col.kind == "time":
            values = _parse_time(values, col)
        if col.kind == "int":
            if col.minimum is not None and bool((values.to_numpy() < col.minimum).any()):
                _diagnose(located, chunksize)  # names the first such line
                raise located.error(
                    f"{located.path}: {col.name!r} values below {col.minimum}", path=located.path
                )
            continue
        bad = values.isna().to_numpy()
        if col.kind == "float" and col.finite:
            bad = bad | ~np.isfinite(values.to_numpy(dtype=np.float64, na_value=np.nan))
        if col.kind == "text" and not col.nonempty:
            chunk[col.key] = values.fillna("")
            continue
        if bad.any():
            _diagnose(located, chunksize)
            raise located.error(
                f"{located.path}: empty or unparsable {col.name!r} values", path=located.path
            )
        if col.kind == "time":
            chunk[col.key] = values.astype(np.int64)
    return chunk


def _parse_time(values: pd.Series, col: Col) -> pd.Series:
    """Text timestamps -> microseconds since the Unix epoch (UTC); NaN where unparsable."""
    stamps = pd.to_datetime(values, format=col.time_format, utc=True, errors="coerce")
    # Microseconds keep RSC15's milliseconds exact, and stay exact in float64 for real dates.
    return (stamps - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(microseconds=1)


# ---------------------------------------------------------------------------- diagnosis
def _diagnose(located: _Located, chunksize: int | None, cause: BaseException | None = None) -> None:
    """Raise ``located.error`` for the first bad value, reading every column as raw text."""
    table = located.table
    try:
        with open_text_bytes(located.path, table.sep, located.error) as handle:
            result = _read_csv(located, handle, text=True, chunksize=chunksize or 1_000_000)
            with result:
                for chunk in result:
                    _report_first_bad(chunk, located, cause)
    except pd.errors.ParserError as exc:
        message = f"{located.path}: malformed {table.description} data: {exc}"
        raise located.error(message, path=located.path) from (cause or exc)


def _report_first_bad(chunk: pd.DataFrame, located: _Located, cause: BaseException | None) -> None:
    cols = located.table.cols
    texts = {c.key: chunk[located.column_of[c.key]].fillna("").astype(str) for c in cols}
    # A blank line is skipped by the typed pass, so it is no error here either.
    blank = np.logical_and.reduce([(t.str.strip() == "").to_numpy(dtype=bool) for t in texts.values()])
    problems: list[tuple[int, str, Col, str]] = []
    for col in cols:
        text = texts[col.key]
        bad = _bad_values(text, col) & ~blank
        if bad.any():
            i = int(np.argmax(bad))
            got = repr(text.iat[i]) if text.iat[i] else "an empty or missing field"
            problems.append((i, col.key, col, f"expected {col.expectation()}, got {got}"))
        if col.kind == "int" and col.minimum is not None:
            # NaN (unparsable, blank) compares False: those are reported above
            parsed = pd.to_numeric(text.str.strip().where(~bad & ~blank), errors="coerce")
            low = (parsed < col.minimum).to_numpy(dtype=bool)
            if low.any():
                i = int(np.argmax(low))
                detail = f"expected {col.expectation()} >= {col.minimum}, got {text.iat[i].strip()}"
                problems.append((i, col.key, col, detail))
        if col.kind == "int":
            too_long = ~bad & ~blank & (text.str.strip().str.lstrip("+-").str.len() > _SAFE_INT_DIGITS)
            for i in np.flatnonzero(too_long.to_numpy(dtype=bool)):
                if not _INT64_MIN <= int(text.iat[i]) <= _INT64_MAX:
                    value = text.iat[i].strip()
                    detail = f"expected {col.expectation()} that fits in int64, got {value}"
                    problems.append((int(i), col.key, col, detail))
                    break
    if not problems:
        return
    i, key, col, detail = min(problems, key=lambda p: p[0])
    label = chunk.index[i]
    line = located.line(label)
    hint = ""
    if not located.table.has_header and label == 0:
        hint = " (this format has no header line)"
    name = located.name_of[key]
    raise located.error(
        f"{located.path}, line {line}, column {located.number_of[key]} ({name}): {detail}{hint}",
        path=located.path, line=line, field=name, detail=detail,
    ) from cause


def _bad_values(text: pd.Series, col: Col) -> np.ndarray:
    """Mask of the values of ``text`` that ``col`` rejects."""
    stripped = text.str.strip()
    if col.kind == "int":
        return ~text.str.fullmatch(_INT_RE).to_numpy(dtype=bool)
    if col.kind == "float":
        # Empty and unparsable text both become NaN, which no float column accepts.
        parsed = pd.to_numeric(stripped, errors="coerce")
        values = parsed.to_numpy(dtype=np.float64, na_value=np.nan)
        return ~np.isfinite(values) if col.finite else np.isnan(values)
    if col.kind == "time":
        parsed = pd.to_datetime(text, format=col.time_format, utc=True, errors="coerce")
        return parsed.isna().to_numpy()
    if col.nonempty:
        return (stripped == "").to_numpy(dtype=bool)
    return np.zeros(len(text), dtype=bool)

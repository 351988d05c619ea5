"""A fast reader for clean delimited files: pyarrow's streaming CSV parser, columns typed up front.

It reads what :func:`recforge.data.delimited.iter_chunks` reads (same :class:`Table`, same
header and position rules, gzip told by its magic bytes, ``::`` rewritten to one byte) into Arrow
arrays, so that text columns never become one Python object per row, whatever the pandas version.

It only ever *accepts* a file: anything it cannot take as it is (a bad or missing value, a row with
another number of fields, whitespace around an integer, invalid UTF-8, a one-line file without a
final newline, a row longer than a block) raises :class:`NotFastReadable`, and the caller reads the
file again with ``iter_chunks``, whose messages name the file, the line and the field. A file is
thus accepted or refused exactly as before, with the same words.
"""
from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from recforge.data.compressed import is_gzip
from recforge.data.delimited import (
    Col,
    DelimitedFileError,
    Table,
    locate,
    open_text_bytes,
    parser_separator,
)

__all__ = ["DEFAULT_BLOCK_BYTES", "NotFastReadable", "fast_readable", "iter_arrow_batches"]

# Large enough that the per-block overhead vanishes, small enough that a block's arrays (and the
# parser's copy of its bytes) stay a few hundred MB at most.
DEFAULT_BLOCK_BYTES = 16 << 20
_TYPES = {"int": pa.int64(), "float": pa.float64(), "text": pa.string()}


class NotFastReadable(Exception):
    """The fast reader does not take this file as it is; the validating reader decides."""


def fast_readable(table: Table) -> bool:
    """Whether :func:`iter_arrow_batches` can read ``table`` at all (UTF-8, no time columns)."""
    return (table.encoding.lower().replace("_", "-") in ("utf-8", "utf8")
            and table.encoding_errors == "strict"
            and table.quoting in (csv.QUOTE_MINIMAL, csv.QUOTE_NONE)
            and all(c.kind in _TYPES for c in table.cols))


def iter_arrow_batches(
    path: str | os.PathLike[str],
    table: Table,
    *,
    error: type[DelimitedFileError] = DelimitedFileError,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Iterator[dict[str, pa.Array]]:
    """Yield, block by block, one Arrow array per ``table.cols`` entry, keyed as the column.

    Types: int64 (at least ``minimum``), float64 (finite unless ``finite=False``), string
    (non-empty unless ``nonempty=False``). A missing file or header raises ``error`` (from
    :func:`locate`); any value or row the validating reader might judge differently raises
    :class:`NotFastReadable`.
    """
    if not fast_readable(table):
        raise ValueError(f"{table.description}: not readable by the fast reader")
    path = Path(path)
    located = locate(path, table, error)
    if table.has_header:
        read_options = pa_csv.ReadOptions(block_size=block_bytes, use_threads=True)
        names = {c.key: str(located.column_of[c.key]) for c in table.cols}
    else:
        read_options = pa_csv.ReadOptions(block_size=block_bytes, use_threads=True,
                                          autogenerate_column_names=True)
        names = {c.key: f"f{located.column_of[c.key]}" for c in table.cols}
    parse_options = pa_csv.ParseOptions(
        delimiter=parser_separator(table.sep),
        quote_char=False if table.quoting == csv.QUOTE_NONE else '"',
        double_quote=True,
        newlines_in_values=False,
        ignore_empty_lines=True,
    )
    convert_options = pa_csv.ConvertOptions(
        column_types={names[c.key]: _TYPES[c.kind] for c in table.cols},
        include_columns=[names[c.key] for c in table.cols],
        # "NA" or "null" may be real ids: only an empty field is missing (as for the pandas reader).
        null_values=[""],
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
        check_utf8=True,
    )
    # A plain file with a one-byte separator is read by Arrow's own I/O, outside the GIL.
    plain = len(table.sep) == 1 and not is_gzip(path)
    source = str(path) if plain else open_text_bytes(path, table.sep, error)
    try:
        reader = pa_csv.open_csv(source, read_options=read_options, parse_options=parse_options,
                                 convert_options=convert_options)
        for batch in reader:
            yield {c.key: _checked(batch.column(names[c.key]), c) for c in table.cols}
    except (pa.ArrowException, UnicodeDecodeError, OSError, EOFError) as exc:
        # OSError, EOFError: a damaged gzip stream, which the validating reader names as such
        raise NotFastReadable(f"{path}: {exc}") from exc
    finally:
        if not plain:
            source.close()


def _checked(values: pa.Array, col: Col) -> pa.Array:
    if values.null_count:
        raise NotFastReadable(f"{col.name}: an empty field")
    if not len(values):
        return values
    problem = None
    if col.kind == "int" and col.minimum is not None and pc.min(values).as_py() < col.minimum:
        problem = f"a value below {col.minimum}"
    elif (col.kind == "float" and col.finite
          and not np.isfinite(values.to_numpy(zero_copy_only=False)).all()):
        problem = "a value that is not finite"
    elif col.kind == "text" and col.nonempty and pc.min(pc.binary_length(values)).as_py() == 0:
        problem = "an empty value"
    if problem is not None:
        raise NotFastReadable(f"{col.name}: {problem}")
    return values

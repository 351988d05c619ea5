"""Reading and writing the GRU4Rec session text format.

The format is tab-separated with a header: ``SessionId`` (integer), ``ItemId`` (kept as a string,
as the reference does, so ids such as ``00123`` survive) and ``Time`` (seconds or milliseconds,
numeric). Rows are returned sorted by (SessionId, Time), ties in file order.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from recforge.data.delimited import Col, DelimitedFileError, Table, read_table
from recforge.utils.atomic import atomic_output

__all__ = [
    "SESSION_KEY",
    "ITEM_KEY",
    "TIME_KEY",
    "SessionFileError",
    "read_session_file",
    "write_session_file",
]

SESSION_KEY = "SessionId"
ITEM_KEY = "ItemId"
TIME_KEY = "Time"


class SessionFileError(DelimitedFileError):
    """A session file is missing or does not follow the GRU4Rec text format."""


def read_session_file(
    path: str | os.PathLike[str],
    session_key: str = SESSION_KEY,
    item_key: str = ITEM_KEY,
    time_key: str = TIME_KEY,
    sort: bool = True,
) -> pd.DataFrame:
    """Read a GRU4Rec session file into a frame with columns SessionId, ItemId, Time.

    With ``sort=False`` rows stay in file order (the reference builds its item map from that
    order before it sorts); :func:`sort_sessions` sorts them later.

    ``session_key``/``item_key``/``time_key`` name the columns in the file's header; the returned
    frame always uses the canonical names. Extra columns are ignored. Raises ``SessionFileError``
    naming the file, and the line and column where possible.
    """
    path = Path(path)
    table = Table(
        description="session",
        sep="\t",
        has_header=True,
        cols=(
            Col(SESSION_KEY, "int", (session_key,), expected="an integer session id"),
            Col(ITEM_KEY, "text", (item_key,), expected="an item id"),
            Col(TIME_KEY, "float", (time_key,)),
        ),
    )
    try:
        df = read_table(path, table, error=SessionFileError)
    except SessionFileError as error:
        if error.line is None or error.field is None:
            raise
        # This format names a bad value's column by its header name, quoted.
        raise SessionFileError(
            f"{path}, line {error.line}: column {error.field!r}: {error.detail}",
            path=path, line=error.line, field=error.field, detail=error.detail,
        ) from error.__cause__
    df = df[[SESSION_KEY, ITEM_KEY, TIME_KEY]]
    return sort_sessions(df) if sort else df.reset_index(drop=True)


def write_session_file(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Write ``df`` (columns SessionId, ItemId, Time) in the GRU4Rec text format, atomically.

    The file appears complete or not at all: readers and crashed writers never see a partial file.
    Parent directories are created. Times are written at full precision so they read back equal.
    """
    path = Path(path)
    keys = [SESSION_KEY, ITEM_KEY, TIME_KEY]
    missing = [k for k in keys if k not in df.columns]
    if missing:
        raise SessionFileError(
            f"cannot write {path}: frame lacks column(s) {missing}; it has {list(df.columns)}"
        )
    with atomic_output(path, newline="") as handle:
        # float_format=None writes repr(): the shortest text that parses back to the same float.
        df[keys].to_csv(handle, sep="\t", index=False, lineterminator="\n")
    return path


def sort_sessions(df: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by (SessionId, Time); ties keep their order."""
    sid = df[SESSION_KEY].to_numpy()
    time = df[TIME_KEY].to_numpy()
    d_sid, d_time = np.diff(sid), np.diff(time)
    if np.all((d_sid > 0) | ((d_sid == 0) & (d_time >= 0))):
        return df.reset_index(drop=True)
    # np.lexsort is stable, so equal (session, time) keys keep their file order.
    order = np.lexsort((time, sid))
    return df.iloc[order].reset_index(drop=True)

"""Reading and writing the GRU4Rec session text format.

The format is tab-separated with a header: ``SessionId`` (integer), ``ItemId`` (kept as a string,
as the reference does, so ids such as ``00123`` survive) and ``Time`` (seconds or milliseconds,
numeric). Rows are returned sorted by (SessionId, Time), ties in file order.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd

from recforge.errors import UserInputError
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

# The header is line 1 and ``skip_blank_lines=False`` keeps one frame row per text line, so frame
# row i is text line i + 2.
_FIRST_DATA_LINE = 2
_INT_RE = r"\s*[+-]?\d+\s*"
# Up to 18 digits always fits in int64, so only longer ids need an exact range check.
_SAFE_INT_DIGITS = 18
_INT64_MIN, _INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


class SessionFileError(UserInputError):
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
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise SessionFileError(f"session file {path} {what}")
    keys = [session_key, item_key, time_key]

    header = _read_header(path)
    missing = [k for k in keys if k not in header]
    if missing:
        hint = ""
        if len(header) == 1 and re.search(r"[,; ]", header[0]):
            hint = " (the file must be tab-separated)"
        raise SessionFileError(
            f"{path}, line 1 (header): missing column(s) {missing}; expected columns {keys}, "
            f"found header {header}{hint}"
        )

    try:
        df = pd.read_csv(
            path,
            sep="\t",
            usecols=keys,
            dtype={session_key: "int64", item_key: str, time_key: "float64"},
            # Only empty fields are missing: "NA" or "null" are legitimate item ids.
            keep_default_na=False,
            na_values=[""],
        )
    except UnicodeDecodeError as exc:
        raise SessionFileError(f"{path}: not valid UTF-8 text: {exc}") from exc
    except (ValueError, OverflowError, TypeError) as exc:
        # The typed fast path only says *that* a value is bad; re-read as text to say where.
        _diagnose(path, keys, exc)
        raise SessionFileError(f"{path}: could not parse the session file: {exc}") from exc

    if len(df) == 0:
        raise SessionFileError(f"{path}: no data rows after the header (expected at least one)")
    if df[item_key].isna().any() or not np.isfinite(df[time_key].to_numpy()).all():
        _diagnose(path, keys, None)
        raise SessionFileError(f"{path}: missing or non-finite values in {item_key!r}/{time_key!r}")

    df = df[keys].rename(columns={session_key: SESSION_KEY, item_key: ITEM_KEY, time_key: TIME_KEY})
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


def _read_header(path: Path) -> list[str]:
    try:
        return [str(c) for c in pd.read_csv(path, sep="\t", nrows=0).columns]
    except pd.errors.EmptyDataError as exc:
        raise SessionFileError(
            f"{path}: the file is empty (expected a header line 'SessionId<TAB>ItemId<TAB>Time' "
            "followed by data rows)"
        ) from exc
    except UnicodeDecodeError as exc:
        raise SessionFileError(f"{path}: not valid UTF-8 text: {exc}") from exc


def _diagnose(path: Path, keys: list[str], cause: BaseException | None) -> None:
    """Raise a SessionFileError for the first bad value, reading everything as raw text."""
    session_key, item_key, time_key = keys
    try:
        raw = pd.read_csv(
            path,
            sep="\t",
            usecols=keys,
            dtype=str,
            keep_default_na=False,
            na_filter=False,
            skip_blank_lines=False,
        )
    except (ValueError, OverflowError) as exc:  # tokenizer errors already carry the line number
        raise SessionFileError(f"{path}: malformed tab-separated data: {exc}") from (cause or exc)

    sid = raw[session_key].fillna("").astype(str)
    item = raw[item_key].fillna("").astype(str)
    time = raw[time_key].fillna("").astype(str)
    # A fully blank line is skipped by the fast path, so it is not an error here either.
    blank = (sid.str.strip() == "") & (item.str.strip() == "") & (time.str.strip() == "")

    problems: list[tuple[int, str]] = []

    bad_sid = ~blank & ~sid.str.fullmatch(_INT_RE)
    if bad_sid.any():
        i = int(np.argmax(bad_sid.to_numpy()))
        got = _shown(sid.iat[i])
        problems.append((i, f"column {session_key!r}: expected an integer session id, got {got}"))
    long_ids = ~blank & ~bad_sid & (sid.str.strip().str.lstrip("+-").str.len() > _SAFE_INT_DIGITS)
    for i in np.flatnonzero(long_ids.to_numpy()):
        if not _INT64_MIN <= int(sid.iat[i]) <= _INT64_MAX:
            value = sid.iat[i].strip()
            message = f"column {session_key!r}: session id {value} does not fit in int64"
            problems.append((int(i), message))
            break

    bad_item = ~blank & (item == "")
    if bad_item.any():
        i = int(np.argmax(bad_item.to_numpy()))
        problems.append((i, f"column {item_key!r}: expected an item id, got {_shown('')}"))

    parsed = pd.to_numeric(time.where(~blank, "0"), errors="coerce").to_numpy(dtype=np.float64)
    bad_time = ~blank.to_numpy() & ~np.isfinite(parsed)
    if bad_time.any():
        i = int(np.argmax(bad_time))
        got = _shown(time.iat[i])
        problems.append((i, f"column {time_key!r}: expected a finite number, got {got}"))

    if problems:
        row, message = min(problems)
        raise SessionFileError(f"{path}, line {row + _FIRST_DATA_LINE}: {message}") from cause


def _shown(value: str) -> str:
    return repr(value) if value else "an empty or missing field"


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

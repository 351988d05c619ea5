"""The prepared format of user histories: one directory, three files.

* ``histories.parquet``: one row per user: ``user`` (string, the raw id), ``items``
  (list<int32>, catalogue indices), ``timestamps`` (list<int64>, Unix seconds), ``ratings``
  (list<float32>); a user's events in chronological order, ties in file order.
* ``items.parquet``: the catalogue: ``item`` (int32 index 0..n-1), ``item_id`` (string, the raw
  id), ``count`` (int64 interactions in the histories; 0 for an item nobody interacted with).
* ``done.json``: written last; it records the format version, the dataset, the inputs (path, size,
  mtime), the parameters and the stats. A directory without it is incomplete.

:func:`write_prepared` writes through :class:`recforge.data.prepared_dir.StagedDir`: the marker
goes first and comes back last, so a crash never leaves a marker that vouches for a mix of old and
new files; :func:`why_stale` says whether a directory can be reused.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.prepared_dir import MARKER as MARKER_FILE
from recforge.data.prepared_dir import StagedDir, read_marker, why_not_current
from recforge.errors import UserInputError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HISTORIES_FILE",
    "ITEMS_FILE",
    "MARKER_FILE",
    "Histories",
    "PreparedDataError",
    "load_prepared",
    "read_marker",
    "why_stale",
    "write_prepared",
]

FORMAT = "recforge-histories"
# Bump when the files for the same inputs and parameters change, so old directories are redone.
FORMAT_VERSION = 1
HISTORIES_FILE = "histories.parquet"
ITEMS_FILE = "items.parquet"

_HISTORIES_SCHEMA = pa.schema(
    [
        ("user", pa.string()),
        ("items", pa.list_(pa.int32())),
        ("timestamps", pa.list_(pa.int64())),
        ("ratings", pa.list_(pa.float32())),
    ]
)
_ITEMS_SCHEMA = pa.schema([("item", pa.int32()), ("item_id", pa.string()), ("count", pa.int64())])


class PreparedDataError(UserInputError):
    """A prepared directory is missing, incomplete or not in this format."""


@dataclass(frozen=True)
class Histories:
    """Every user's events, flat: user ``u`` is ``items[offsets[u]:offsets[u + 1]]``.

    ``users`` and ``item_ids`` are the raw ids (strings); ``item_counts[j]`` counts item ``j``'s
    events. Arrays: offsets ``[U+1]`` int64; items ``[N]`` int32; timestamps ``[N]`` int64;
    ratings ``[N]`` float32; item_counts ``[n_items]`` int64.
    """

    users: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: np.ndarray
    item_ids: np.ndarray
    item_counts: np.ndarray

    @property
    def n_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    @property
    def n_events(self) -> int:
        return len(self.items)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def stats(self) -> dict[str, int]:
        return {
            "users": self.n_users,
            "items": self.n_items,
            "rated_items": int(np.count_nonzero(self.item_counts)),
            "events": self.n_events,
        }


def _identity(dataset: str, inputs: list, params: dict) -> dict[str, Any]:
    return {"format": FORMAT, "version": FORMAT_VERSION, "dataset": dataset, "inputs": inputs,
            "params": params}


def why_stale(directory: Path, dataset: str, inputs: list, params: dict) -> str | None:
    """Why ``directory`` does not hold a finished write of this dataset, these inputs and
    parameters; None when it does."""
    return why_not_current(directory, _identity(dataset, inputs, params),
                           files=(HISTORIES_FILE, ITEMS_FILE))


def write_prepared(
    directory: str | os.PathLike[str],
    histories: Histories,
    *,
    dataset: str,
    inputs: list[dict[str, Any]],
    params: dict[str, Any],
    extra_stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``histories`` into ``directory`` (created); returns the marker written last."""
    _check_consistent(histories)
    if histories.n_events > np.iinfo(np.int32).max:
        # list<int32> offsets are int32; more events would need large_list.
        raise ValueError(f"{histories.n_events} events exceed the format's 2**31 - 1")
    offsets = pa.array(histories.offsets.astype(np.int32))
    table = pa.Table.from_arrays(
        [
            pa.array(np.asarray(histories.users), type=pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(histories.items.astype(np.int32))),
            pa.ListArray.from_arrays(offsets, pa.array(histories.timestamps.astype(np.int64))),
            pa.ListArray.from_arrays(offsets, pa.array(histories.ratings.astype(np.float32))),
        ],
        schema=_HISTORIES_SCHEMA,
    )
    items = pa.Table.from_arrays(
        [
            pa.array(np.arange(histories.n_items, dtype=np.int32)),
            pa.array(np.asarray(histories.item_ids), type=pa.string()),
            pa.array(histories.item_counts.astype(np.int64)),
        ],
        schema=_ITEMS_SCHEMA,
    )
    marker = {
        **_identity(dataset, inputs, params),
        "files": {"histories": HISTORIES_FILE, "items": ITEMS_FILE},
        "stats": {**histories.stats(), **(extra_stats or {})},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with StagedDir(directory) as staged:
        try:
            pq.write_table(table, staged.path / HISTORIES_FILE, compression="zstd")
            pq.write_table(items, staged.path / ITEMS_FILE, compression="zstd")
            staged.publish(marker)
        except OSError as error:
            # Raised inside the with-block: the staged files go on the way out, and the target
            # has lost its marker (if it had one), so nothing there is taken for prepared data.
            raise _write_error(Path(directory), error) from None
    return marker


def _write_error(directory: Path, error: OSError) -> PreparedDataError:
    """A failed write (a full disk, a quota, a read-only file system) as one line naming the
    directory."""
    text = str(error)
    full = error.errno == errno.ENOSPC or "No space left" in text
    what = "the disk is full" if full else (error.strerror or text or type(error).__name__)
    return PreparedDataError(f"{directory}: writing the prepared histories failed ({what}); "
                             "nothing there counts as prepared data")


def _check_consistent(h: Histories) -> None:
    n = h.n_events
    if h.offsets[0] != 0 or h.offsets[-1] != n or np.any(np.diff(h.offsets) < 0):
        raise ValueError("histories: offsets must rise from 0 to the number of events")
    if len(h.timestamps) != n or len(h.ratings) != n or len(h.users) != h.n_users:
        raise ValueError("histories: items, timestamps, ratings and users do not line up")
    if n and (h.items.min() < 0 or h.items.max() >= h.n_items):
        raise ValueError(f"histories: item indices outside [0, {h.n_items})")
    if len(h.item_counts) != h.n_items:
        raise ValueError("histories: one count per catalogue item expected")
    _check_times(h)


def _check_times(h: Histories) -> None:
    """Each user's times non-negative and non-decreasing: models read them as event order and
    HSTU's time bias buckets their differences, where a wrong order would go unnoticed."""
    times = h.timestamps
    if not len(times):
        return
    if times.min() < 0:
        i = int(np.argmax(times < 0))
        user = int(np.searchsorted(h.offsets, i, side="right")) - 1
        raise ValueError(f"histories: user {h.users[user]!r} has timestamp {int(times[i])} at event "
                         f"{i - int(h.offsets[user])}; expected Unix seconds >= 0")
    starts_user = np.zeros(len(times), dtype=bool)
    starts_user[h.offsets[:-1][h.offsets[:-1] < len(times)]] = True
    back = (times[1:] < times[:-1]) & ~starts_user[1:]
    if back.any():
        i = int(np.argmax(back)) + 1
        user = int(np.searchsorted(h.offsets, i, side="right")) - 1
        raise ValueError(
            f"histories: user {h.users[user]!r} has timestamp {int(times[i])} at event "
            f"{i - int(h.offsets[user])} after {int(times[i - 1])}; expected each user's events "
            "in time order"
        )


def load_prepared(directory: str | os.PathLike[str], what: str = "prepared_dir") -> Histories:
    """Read a prepared directory; ``what`` names it in errors (a config key, say)."""
    out = Path(directory)
    marker = read_marker(out)
    if marker is None:
        state = "does not exist" if not out.exists() else f"has no {MARKER_FILE} (not prepared, or "\
            "the preparation did not finish)"
        raise PreparedDataError(f"{what}={out}: {state}; expected a directory written by "
                                "python -m recforge.data.sequences.preprocess")
    if marker.get("format") != FORMAT or marker.get("version") != FORMAT_VERSION:
        raise PreparedDataError(
            f"{what}={out}: {MARKER_FILE} says format {marker.get('format')!r} version "
            f"{marker.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION} "
            "(prepare it again)"
        )
    try:
        hist = pq.read_table(out / HISTORIES_FILE)
        items = pq.read_table(out / ITEMS_FILE)
    except (OSError, pa.ArrowException) as exc:
        raise PreparedDataError(f"{what}={out}: unreadable parquet file: {exc}") from exc
    try:
        offsets, item_values = _flat(hist.column("items"))
        t_offsets, timestamps = _flat(hist.column("timestamps"))
        r_offsets, ratings = _flat(hist.column("ratings"))
        catalogue = items.column("item").to_numpy()
        histories = Histories(
            users=np.asarray(hist.column("user").to_pylist(), dtype=object),
            offsets=offsets,
            items=item_values.astype(np.int32, copy=False),
            timestamps=timestamps.astype(np.int64, copy=False),
            ratings=ratings.astype(np.float32, copy=False),
            item_ids=np.asarray(items.column("item_id").to_pylist(), dtype=object),
            item_counts=items.column("count").to_numpy().astype(np.int64),
        )
    except KeyError as exc:
        raise PreparedDataError(f"{what}={out}: a parquet file lacks column {exc}") from exc
    if not (np.array_equal(offsets, t_offsets) and np.array_equal(offsets, r_offsets)) or \
            not np.array_equal(catalogue, np.arange(len(catalogue))):
        raise PreparedDataError(f"{what}={out}: items, timestamps and ratings lists differ in "
                                "length, or the catalogue is not numbered 0..n-1")
    try:
        _check_consistent(histories)
    except ValueError as exc:
        raise PreparedDataError(f"{what}={out}: {exc}") from exc
    return histories


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets from 0, values) of a list column."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    values = values[offsets[0]:offsets[-1]]
    return offsets - offsets[0], values

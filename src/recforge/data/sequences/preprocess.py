"""Raw public ratings -> the prepared user-history format (:mod:`.prepared`), as spec §2 describes.

* ``ml-1m``: ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``, no header; ``.gz`` too) and
  ``movies.dat`` (``MovieID::Title::Genres``, latin-1), which gives the whole catalogue,
  never-rated movies included (3,883 ids; 3,706 rated). No filtering: every rating counts.
* ``ml-20m``: ``ratings.csv`` (header ``userId,movieId,rating,timestamp``) and ``movies.csv``.
* ``amzn-books``: ``ratings_Books.csv`` (no header, ``user,item,rating,timestamp``; other column
  orders through ``columns``, e.g. the 2018 files' ``item,user,rating,timestamp``). One pass of
  >= ``min_interactions`` filtering on item and user counts of the raw data, then users left with
  fewer items are dropped; the catalogue is the items that survive the pass (as the reference
  numbers them before it drops users, so a few may end with no interaction).

Users and items are numbered in the sorted order of their raw ids (numeric for MovieLens),
events of a user sorted by time with ties in file order (a stable sort). The ratings file is read
block by block by Arrow's CSV reader and ids are coded per block by Arrow's hashing, so memory
stays a few compact arrays per event and no id becomes a Python object before the distinct ones
are written; a file that reader does not take as it is goes through the validating pandas reader
(:mod:`recforge.data.delimited`), whose messages name the line and field at fault. Command line::

    python -m recforge.data.sequences.preprocess ml-1m --raw <dir or files> --out data/ml-1m
"""
from __future__ import annotations

import csv
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recforge.cli import data_command_parser, run_data_command
from recforge.data.delimited import Col, DelimitedFileError, Table, iter_chunks
from recforge.data.delimited_arrow import (
    DEFAULT_BLOCK_BYTES,
    NotFastReadable,
    fast_readable,
    iter_arrow_batches,
)
from recforge.data.prepared_dir import (
    as_paths,
    build_once,
    fingerprint,
    parameters,
    read_marker,
)
from recforge.data.sequences.prepared import Histories, why_stale, write_prepared
from recforge.errors import UserInputError

__all__ = [
    "DATASETS",
    "RatingsDataError",
    "RatingsSpec",
    "build_histories",
    "main",
    "prepare",
    "read_ratings",
]

log = logging.getLogger(__name__)

_DEFAULT_CHUNKSIZE = 1_000_000
_BLOCK_BYTES = DEFAULT_BLOCK_BYTES  # of the fast reader; tests make it small to cut files in many
_AMAZON_COLUMNS = ("user", "item", "rating", "timestamp")


class RatingsDataError(DelimitedFileError):
    """A raw ratings or items file is missing or does not have the expected format."""


def _rating_cols(id_kind: str, item_word: str) -> dict[str, Col]:
    ids = "an integer {} id" if id_kind == "int" else "a non-empty {} id"
    return {
        "user": Col("user", id_kind, ("user",), expected=ids.format("user")),
        "item": Col("item", id_kind, ("item",), expected=ids.format(item_word)),
        "rating": Col("rating", "float", ("rating",), expected="a rating (a finite number)"),
        # a negative time is a placeholder, not a date: HSTU's time bias would bucket it silently
        "timestamp": Col("timestamp", "int", ("timestamp",),
                         expected="an integer timestamp (Unix seconds)", minimum=0),
    }


def _with(col: Col, **changes: Any) -> Col:
    return Col(**{**col.__dict__, **changes})


def _ml1m_ratings(params: dict[str, Any]) -> Table:
    cols = _rating_cols("int", "movie")
    names = {"user": "UserID", "item": "MovieID", "rating": "Rating", "timestamp": "Timestamp"}
    return Table(
        description="MovieLens-1M ratings (UserID::MovieID::Rating::Timestamp, no header)",
        sep="::",
        has_header=False,
        cols=tuple(_with(cols[k], names=(names[k],), position=i) for i, k in enumerate(names)),
        quoting=csv.QUOTE_NONE,
    )


ML1M_MOVIES = Table(
    description="MovieLens-1M movies (MovieID::Title::Genres, no header, latin-1)",
    sep="::",
    has_header=False,
    cols=(Col("item", "int", ("MovieID",), position=0, expected="an integer movie id"),),
    encoding="latin-1",
    quoting=csv.QUOTE_NONE,  # titles hold bare double quotes
)


def _ml20m_ratings(params: dict[str, Any]) -> Table:
    cols = _rating_cols("int", "movie")
    names = {"user": "userId", "item": "movieId", "rating": "rating", "timestamp": "timestamp"}
    return Table(
        description="MovieLens-20M ratings.csv (header userId,movieId,rating,timestamp)",
        sep=",",
        has_header=True,
        cols=tuple(_with(cols[k], names=(names[k],)) for k in names),
    )


ML20M_MOVIES = Table(
    description="MovieLens-20M movies.csv (header movieId,title,genres)",
    sep=",",
    has_header=True,
    cols=(Col("item", "int", ("movieId",), expected="an integer movie id"),),
    # Only the ids are used: a title in another encoding must not stop the reading.
    encoding_errors="replace",
)


def _amazon_ratings(params: dict[str, Any]) -> Table:
    order = list(params["columns"])
    if sorted(order) != sorted(_AMAZON_COLUMNS):
        raise UserInputError(
            f"amzn-books: columns={order}: expected the four names {list(_AMAZON_COLUMNS)} in the "
            "file's order (e.g. item,user,rating,timestamp for the 2018 files)"
        )
    cols = _rating_cols("text", "item")
    return Table(
        description=f"Amazon ratings CSV ({','.join(order)}, no header)",
        sep=",",
        has_header=False,
        cols=tuple(_with(cols[k], position=order.index(k)) for k in _AMAZON_COLUMNS),
    )


@dataclass(frozen=True)
class RatingsSpec:
    """How one dataset is prepared: its raw files' public names, their layout, its defaults."""

    name: str
    ratings_files: tuple[str, ...]  # accepted names of the ratings file in a directory
    items_files: tuple[str, ...]  # of the items (movies) file; () when the dataset has none
    ratings_table: Callable[[dict[str, Any]], Table]
    items_table: Table | None
    defaults: dict[str, Any]


DATASETS: dict[str, RatingsSpec] = {
    "ml-1m": RatingsSpec(
        "ml-1m", ("ratings.dat", "ratings.dat.gz"), ("movies.dat", "movies.dat.gz"),
        _ml1m_ratings, ML1M_MOVIES, {"min_interactions": 0},
    ),
    "ml-20m": RatingsSpec(
        "ml-20m", ("ratings.csv", "ratings.csv.gz"), ("movies.csv", "movies.csv.gz"),
        _ml20m_ratings, ML20M_MOVIES, {"min_interactions": 0},
    ),
    "amzn-books": RatingsSpec(
        "amzn-books", ("ratings_Books.csv", "ratings_Books.csv.gz"), (),
        _amazon_ratings, None, {"min_interactions": 5, "columns": list(_AMAZON_COLUMNS)},
    ),
}


# ---------------------------------------------------------------------------- reading
@dataclass
class _Events:
    """Events in file order with ids as codes into sorted labels."""

    users: np.ndarray  # int32 codes into user_labels
    items: np.ndarray  # int32 codes into item_labels
    timestamps: np.ndarray  # int64
    ratings: np.ndarray  # float32
    user_labels: pa.Array  # the distinct raw ids, sorted (int64 for MovieLens, else string)
    item_labels: pa.Array


class _ArrowCodes:
    """Ids coded per block by Arrow's hashing, made global once at the end: a distinct id is
    hashed once per block and sorted once, and never becomes a Python object."""

    def __init__(self) -> None:
        self._codes: list[np.ndarray] = []
        self._uniques: list[pa.Array] = []

    def add(self, values: pa.Array) -> None:
        encoded = pc.dictionary_encode(values)
        self._codes.append(encoded.indices.to_numpy().astype(np.int32, copy=False))
        self._uniques.append(encoded.dictionary)

    def finish(self, extra: pa.Array | None = None) -> tuple[np.ndarray, pa.Array]:
        """(codes of every value added, in order; the sorted labels, ``extra`` included)."""
        pools = self._uniques + ([extra] if extra is not None else [])
        if not pools:
            return np.zeros(0, np.int32), pa.array([], pa.string())
        # One hashing of the blocks' distinct ids gives the distinct ids of the file, in first
        # seen order, and where each block's ids are among them; sorting them once then gives
        # every id its rank. (Byte order of UTF-8 is code point order: that of sorted() on str.)
        pooled = pc.dictionary_encode(pa.chunked_array(pools))
        # Codes are stable as the memo grows: the last block's dictionary holds every id.
        distinct = pooled.chunks[-1].dictionary
        order = pc.array_sort_indices(distinct).to_numpy()
        rank = np.empty(len(order), dtype=np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        global_codes = rank[np.concatenate([c.indices.to_numpy() for c in pooled.chunks])]
        labels = distinct.take(pa.array(order))
        del pooled, rank
        out = np.empty(sum(len(c) for c in self._codes), dtype=np.int32)
        start = pos = 0
        for codes, uniques in zip(self._codes, self._uniques):
            out[pos:pos + len(codes)] = global_codes[start:start + len(uniques)][codes]
            start += len(uniques)
            pos += len(codes)
        self._codes, self._uniques = [], []
        return out, labels


class _ChunkCodes:
    """The validating reader's twin of :class:`_ArrowCodes`, on pandas chunks."""

    def __init__(self) -> None:
        self._codes: list[np.ndarray] = []
        self._uniques: list[pd.Index] = []

    def add(self, values: pd.Series) -> None:
        codes, uniques = pd.factorize(values)
        self._codes.append(codes.astype(np.int32))
        self._uniques.append(pd.Index(uniques))

    def finish(self, extra: pd.Index | None = None) -> tuple[np.ndarray, pa.Array]:
        pools = self._uniques + ([extra] if extra is not None else [])
        if not pools:
            return np.zeros(0, np.int32), pa.array([], pa.string())
        pool = pools[0].append(pools[1:]) if len(pools) > 1 else pools[0]
        global_codes, labels = pd.factorize(pool, sort=True)
        out = np.empty(sum(len(c) for c in self._codes), dtype=np.int32)
        start = pos = 0
        for codes, uniques in zip(self._codes, self._uniques):
            mapping = global_codes[start:start + len(uniques)].astype(np.int32)
            out[pos:pos + len(codes)] = mapping[codes]
            start += len(uniques)
            pos += len(codes)
        self._codes, self._uniques = [], []
        kind = pa.int64() if pd.api.types.is_integer_dtype(labels.dtype) else pa.string()
        return out, pa.array(np.asarray(labels), type=kind)


def read_ratings(
    ratings_path: Path,
    table: Table,
    chunksize: int,
    items_path: Path | None = None,
    items_table: Table | None = None,
    *,
    block_bytes: int | None = None,
) -> _Events:
    """All ratings in file order, ids coded against the sorted raw ids (``items_path``'s ids
    joining the item labels).

    The ratings go through Arrow's CSV reader; a file it does not take as it is (a bad value, an
    odd row) is read again by the validating pandas reader, which names the line at fault or,
    when the file is good after all, reads it (:func:`read_ratings_validating`).
    """
    refused = None
    if fast_readable(table):
        try:
            return _read_ratings_fast(ratings_path, table, chunksize, items_path, items_table,
                                      block_bytes or _BLOCK_BYTES)
        except NotFastReadable as why:
            refused = why
    events = read_ratings_validating(ratings_path, table, chunksize, items_path, items_table)
    if refused is not None:
        # Said only of a good file: for a bad one, the error is the one line the user sees.
        log.info("%s: read by the slower validating reader (the Arrow reader refused it: %s)",
                 ratings_path, refused)
    return events


def _read_catalogue(items_path: Path | None, items_table: Table | None,
                    chunksize: int) -> pd.Index | None:
    if items_path is None or items_table is None:
        return None
    parts = [c["item"] for c in iter_chunks(items_path, items_table, chunksize,
                                             error=RatingsDataError)]
    return pd.Index(pd.unique(pd.concat(parts, ignore_index=True))) if parts else None


def _read_ratings_fast(ratings_path: Path, table: Table, chunksize: int, items_path: Path | None,
                       items_table: Table | None, block_bytes: int) -> _Events:
    users, items = _ArrowCodes(), _ArrowCodes()
    timestamps, ratings = [], []
    for block in iter_arrow_batches(ratings_path, table, error=RatingsDataError,
                                    block_bytes=block_bytes):
        users.add(block["user"])
        items.add(block["item"])
        timestamps.append(block["timestamp"].to_numpy())
        ratings.append(block["rating"].to_numpy().astype(np.float32))
    _check_not_empty(ratings_path, timestamps)
    catalogue = _read_catalogue(items_path, items_table, chunksize)
    extra = None
    if catalogue is not None:
        extra = pa.array(np.asarray(catalogue), type=_label_type(table.cols, "item"))
    user_codes, user_labels = users.finish()
    item_codes, item_labels = items.finish(extra)
    events = _Events(user_codes, item_codes, np.concatenate(timestamps), np.concatenate(ratings),
                     user_labels, item_labels)
    del timestamps, ratings
    # Arrow's allocator keeps the blocks' freed pages; the sort that follows allocates through
    # numpy, which cannot reuse them, so unreleased they would add to the peak.
    pa.default_memory_pool().release_unused()
    return events


def read_ratings_validating(
    ratings_path: Path,
    table: Table,
    chunksize: int,
    items_path: Path | None = None,
    items_table: Table | None = None,
) -> _Events:
    """:func:`read_ratings` through the pandas reader alone (the slow twin of the fast path,
    and the one that names the line of a bad value)."""
    users, items = _ChunkCodes(), _ChunkCodes()
    timestamps, ratings = [], []
    for chunk in iter_chunks(ratings_path, table, chunksize, error=RatingsDataError):
        users.add(chunk["user"])
        items.add(chunk["item"])
        timestamps.append(chunk["timestamp"].to_numpy(dtype=np.int64))
        ratings.append(chunk["rating"].to_numpy(dtype=np.float32))
    _check_not_empty(ratings_path, timestamps)
    catalogue = _read_catalogue(items_path, items_table, chunksize)
    user_codes, user_labels = users.finish()
    item_codes, item_labels = items.finish(catalogue)
    return _Events(
        user_codes, item_codes, np.concatenate(timestamps), np.concatenate(ratings),
        user_labels, item_labels,
    )


def _check_not_empty(ratings_path: Path, timestamps: list[np.ndarray]) -> None:
    if sum(len(t) for t in timestamps) == 0:
        raise RatingsDataError(f"{ratings_path}: no data rows (expected at least one rating)",
                               path=ratings_path)


def _label_type(cols: tuple[Col, ...], key: str) -> pa.DataType:
    kind = next(c.kind for c in cols if c.key == key)
    return pa.int64() if kind == "int" else pa.string()


def build_histories(events: _Events, min_interactions: int = 0) -> tuple[Histories, dict[str, int]]:
    """Histories from events (see the module docstring for the filtering); also the counts of
    what the filtering removed."""
    users, items = events.users, events.items
    n_users, n_items = len(events.user_labels), len(events.item_labels)
    dropped = {"raw_events": int(len(users)), "raw_users": n_users, "raw_items": n_items}
    keep_items = np.ones(n_items, dtype=bool)
    keep_users = np.ones(n_users, dtype=bool)
    if min_interactions > 0:
        item_count = np.bincount(items, minlength=n_items)
        user_count = np.bincount(users, minlength=n_users)
        keep = (item_count[items] >= min_interactions) & (user_count[users] >= min_interactions)
        # The catalogue is fixed after the one pass, before short users go (the reference's order).
        keep_items = np.bincount(items[keep], minlength=n_items) > 0
        left = np.bincount(users[keep], minlength=n_users)
        keep_users = left >= min_interactions
        keep &= keep_users[users]
        users, items = users[keep], items[keep]
        timestamps, ratings = events.timestamps[keep], events.ratings[keep]
    else:
        keep_users = np.bincount(users, minlength=n_users) > 0
        timestamps, ratings = events.timestamps, events.ratings
    user_index = np.cumsum(keep_users, dtype=np.int64) - 1
    item_index = np.cumsum(keep_items, dtype=np.int64) - 1
    users = user_index[users].astype(np.int32)
    items = item_index[items].astype(np.int32)
    n_users, n_items = int(keep_users.sum()), int(keep_items.sum())

    # lexsort is stable: a user's events at the same second keep their file order.
    order = np.lexsort((timestamps, users))
    users, items = users[order], items[order]
    timestamps, ratings = timestamps[order], ratings[order]
    offsets = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(users, minlength=n_users), out=offsets[1:])
    histories = Histories(
        users=_as_strings(events.user_labels, keep_users),
        offsets=offsets,
        items=items,
        timestamps=timestamps.astype(np.int64, copy=False),
        ratings=ratings.astype(np.float32, copy=False),
        item_ids=_as_strings(events.item_labels, keep_items),
        item_counts=np.bincount(items, minlength=n_items).astype(np.int64),
    )
    return histories, dropped


def _as_strings(labels: pa.Array, keep: np.ndarray) -> np.ndarray:
    """The kept labels as text (the prepared format's ids), one Python string per kept id."""
    kept = labels.filter(pa.array(keep, type=pa.bool_())).cast(pa.string())
    return np.asarray(kept.to_numpy(zero_copy_only=False), dtype=object)


# ---------------------------------------------------------------------------- prepare
def prepare(
    dataset: str,
    raw_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    chunksize: int = _DEFAULT_CHUNKSIZE,
    **overrides: Any,
) -> Path:
    """Preprocess one raw ratings dataset into ``out_dir`` (the prepared format); returns it.

    ``raw_paths``: a directory holding the public file names, or the ratings file, or the ratings
    file then the items (movies) file. ``overrides`` replace ``DATASETS[dataset].defaults``
    (``min_interactions``; amzn-books also ``columns``).

    Reused when its ``done.json`` records the same inputs (path, size, mtime) and parameters,
    unless ``force``. Everything is read and checked before anything is written: a bad input
    leaves ``out_dir`` untouched. Raises :class:`RatingsDataError` (a ``UserInputError``) for bad
    files, ``UserInputError`` for bad arguments.
    """
    spec = _spec(dataset)
    params = parameters(dataset, spec.defaults, overrides)
    _check_params(dataset, params)
    if chunksize < 1:
        raise UserInputError(f"chunksize must be positive, got {chunksize}")
    ratings_path, items_path = _resolve_raw_paths(spec, raw_paths)
    table = spec.ratings_table(params)
    used = [ratings_path] + ([items_path] if items_path is not None else [])
    inputs = [fingerprint(p) for p in used]

    def build(target: Path) -> None:
        events = read_ratings(ratings_path, table, chunksize, items_path, spec.items_table)
        histories, raw = build_histories(events, int(params["min_interactions"]))
        del events
        if histories.n_users == 0:
            raise RatingsDataError(
                f"{ratings_path}: no user is left after keeping users and items with at least "
                f"{params['min_interactions']} interactions ({raw['raw_events']} ratings read)",
                path=ratings_path,
            )
        if items_path is None and spec.items_table is not None:
            log.warning("%s: no items file given: the catalogue is the %d rated items only (the "
                        "reference ranks every movie of %s)", dataset, histories.n_items,
                        spec.items_files[0])
        stats = histories.stats()
        log.info("%s: %d users, %d items (%d rated), %d events; read %d ratings of %d users, "
                 "%d items", dataset, stats["users"], stats["items"], stats["rated_items"],
                 stats["events"], raw["raw_events"], raw["raw_users"], raw["raw_items"])
        write_prepared(target, histories, dataset=dataset, inputs=inputs, params=params,
                       extra_stats=raw)

    return build_once(out_dir, build, lambda directory: why_stale(directory, dataset, inputs, params),
                      force=force)


def _spec(dataset: str) -> RatingsSpec:
    try:
        return DATASETS[dataset]
    except KeyError:
        raise UserInputError(
            f"unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}"
        ) from None


def _check_params(dataset: str, params: dict[str, Any]) -> None:
    k = params["min_interactions"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UserInputError(f"{dataset}: min_interactions must be an integer >= 0, got {k!r}")


def _resolve_raw_paths(
    spec: RatingsSpec, raw_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
) -> tuple[Path, Path | None]:
    paths = as_paths(raw_paths)
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        ratings = next((folder / n for n in spec.ratings_files if (folder / n).is_file()), None)
        if ratings is None:
            raise RatingsDataError(
                f"{folder}: no {spec.name} ratings file there; expected "
                f"{' or '.join(spec.ratings_files)}", path=folder,
            )
        items = next((folder / n for n in spec.items_files if (folder / n).is_file()), None)
        return ratings, items
    most = 2 if spec.items_table is not None else 1
    if not 1 <= len(paths) <= most:
        names = spec.ratings_files[0] + (f" [{spec.items_files[0]}]" if most == 2 else "")
        raise UserInputError(
            f"{spec.name} takes the ratings file{' and optionally the items file' if most == 2 else ''}"
            f" ({names}) or a directory holding them, got {len(paths)} paths"
        )
    for path in paths:
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise RatingsDataError(f"{spec.name} raw file {path} {what}", path=path)
    if len(paths) == 2 or not spec.items_files:
        return paths[0], (paths[1] if len(paths) == 2 else None)
    # The public releases ship the movies file beside the ratings: the catalogue it completes
    # (never-rated movies included) is what the reference ranks, so it is used when it is there.
    beside = next((paths[0].parent / n for n in spec.items_files if (paths[0].parent / n).is_file()), None)
    if beside is not None:
        log.info("%s: items from %s, found beside the ratings file", spec.name, beside)
    return paths[0], beside


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the process exit status."""
    parser = data_command_parser(
        "recforge.data.sequences.preprocess",
        "Preprocess raw ratings into per-user histories (histories.parquet, items.parquet, "
        "done.json) as spec §2 (HSTU) describes.",
        "a directory holding the public files (ratings.dat + movies.dat, ratings.csv + "
        "movies.csv, ratings_Books.csv), or the ratings file then the optional movies file",
        DATASETS,
    )
    parser.add_argument("--min-interactions", type=int,
                        help="keep items and users with at least this many ratings (Books: 5)")
    parser.add_argument("--columns",
                        help="amzn-books: the file's column order, e.g. item,user,rating,timestamp")
    parser.add_argument("--chunksize", type=int, default=_DEFAULT_CHUNKSIZE, help="rows per chunk")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.min_interactions is not None:
        overrides["min_interactions"] = args.min_interactions
    if args.columns is not None:
        overrides["columns"] = [c.strip() for c in args.columns.split(",")]
    out = run_data_command(lambda: prepare(args.dataset, args.raw, args.out, force=args.force,
                                           chunksize=args.chunksize, **overrides))
    stats = (read_marker(out) or {}).get("stats", {})
    print(f"{out}  users={stats.get('users')} items={stats.get('items')} "
          f"rated_items={stats.get('rated_items')} events={stats.get('events')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

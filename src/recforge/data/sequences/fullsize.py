"""Full-size stand-ins for MovieLens-20M and Amazon Books, in the real raw formats.

The published files are not redistributable here, yet the preprocessing, loading and evaluation
paths must be measured at their size. These generators write files named and laid out as the real
downloads, so that ``python -m recforge.data.sequences.preprocess DATASET --raw DIR`` takes the
directory exactly as it takes the real one:

* ``ml-20m``: ``ratings.csv`` (header ``userId,movieId,rating,timestamp``; ratings 0.5..5.0 in
  halves, printed as ``3.5``) and ``movies.csv`` (header ``movieId,title,genres``; titles quoted
  where they hold a comma or a quote, genres ``|``-separated; UTF-8). At fraction 1: 20,000,263
  ratings by 138,493 users (each at least 20, as in the real file) of 26,744 movies; 27,278 movies
  listed (so some are never rated), ids up to 131,262.
* ``amzn-books``: ``ratings_Books.csv`` (no header, ``user,item,rating,timestamp``, the 2014 SNAP
  layout): user ids like ``A1ZQ3YH3Z5U0QB``, items 10-character ASINs (ISBN-10s with their check
  digit, a few ``B00...``), ratings ``1.0``..``5.0``, timestamps at midnight UTC as in the real
  file. At fraction 1: 22,507,155 ratings of 8,026,324 users and 2,330,066 items, with popularity
  calibrated so that the project's one-pass >= 5 filter keeps about 695,762 items (spec hstu.md).

Shape: power-law item popularity; heavy-tailed history lengths (log-normal above the minimum for
MovieLens, Pareto for Books, where most users rate once); each user's events in non-decreasing
time, in file order (ties allowed, as in the real files). A user never rates an item twice.
At ``fraction`` F users, items and rows are F times the published counts (rounded); a history is
never longer than half the rated catalogue, which binds only at tiny fractions (then the file has
fewer rows than F times the published count; the summary gives the real counts).

Rows are generated and written in chunks of about a million, grouped by user, so memory holds the
per-user and per-item arrays and one chunk, never the file. The same seed gives the same bytes.
Each file is written under a temporary name in the output directory and renamed when complete.
"""
from __future__ import annotations

import csv
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from recforge.errors import UserInputError
from recforge.utils.atomic import apply_umask

__all__ = ["GENERATORS", "ML20M", "AMZN_BOOKS", "generate_ml20m", "generate_amzn_books"]

_CHUNK_ROWS = 1_000_000
_DAY = 86_400
# Arrow quotes every string unless told not to; our values never hold a comma or a quote, and
# Arrow refuses to write one that does, so nothing can come out unparseable.
_WRITE = pa_csv.WriteOptions(include_header=False, quoting_style="none")


@dataclass(frozen=True)
class Published:
    """The published dataset's counts and the shape parameters that imitate it."""

    rows: int
    users: int
    rated_items: int
    min_history: int
    max_history: int
    first_time: int  # Unix seconds of the earliest and latest rating
    last_time: int
    zipf_exponent: float  # item popularity p(rank) ~ (rank + offset) ** -exponent
    zipf_offset: float
    rating_values: tuple[str, ...]  # as printed in the file
    rating_weights: tuple[float, ...]


# ml-20m's README: 20,000,263 ratings, 138,493 users, 27,278 movies (26,744 rated), every user
# with at least 20; the most active has 9,254. Ratings as its histogram gives them, roughly.
ML20M = Published(
    rows=20_000_263, users=138_493, rated_items=26_744, min_history=20, max_history=9_254,
    first_time=789_652_009, last_time=1_427_784_002, zipf_exponent=1.1, zipf_offset=40.0,
    rating_values=("0.5", "1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0", "4.5", "5.0"),
    rating_weights=(1.1, 3.3, 1.4, 7.2, 4.4, 21.4, 10.5, 27.8, 7.7, 15.2),
)
ML20M_MOVIES = 27_278
ML20M_MAX_MOVIE_ID = 131_262
# Amazon Books 2014 (SNAP ratings_Books.csv): 22,507,155 ratings, 8,026,324 users, 2,330,066 items.
# The offset is calibrated so that the >= 5 one-pass filter keeps ~695,762 items: at fraction 1 and
# seed 0, 794 keeps 695,700 (-0.01 %), where 1,000 kept 715,223 (+2.8 %); a larger offset flattens the
# head, so more tail items reach 5 ratings. The largest history is a fraction of the catalogue so
# tiny fractions stay possible.
AMZN_BOOKS = Published(
    rows=22_507_155, users=8_026_324, rated_items=2_330_066, min_history=1, max_history=20_000,
    first_time=832_550_400, last_time=1_406_073_600, zipf_exponent=1.0, zipf_offset=794.0,
    rating_values=("1.0", "2.0", "3.0", "4.0", "5.0"),
    rating_weights=(5.0, 5.0, 9.0, 22.0, 59.0),
)

_GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary",
           "Drama", "Fantasy", "Film-Noir", "Horror", "IMAX", "Musical", "Mystery", "Romance",
           "Sci-Fi", "Thriller", "War", "Western")
_TITLE_WORDS = ("Night", "River", "Star", "Love", "City", "Dark", "Last", "Summer", "Road",
                "Ghost", "King", "Dream", "Fire", "Stranger", "Garden", "Amélie", "Über", "Café")
_BASE36 = np.frombuffer(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)


# ---------------------------------------------------------------------------- sizes
def _check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0 < fraction <= 1 or math.isnan(fraction):
        raise UserInputError(f"fraction={fraction!r}: expected a number in (0, 1]")
    return float(fraction)


def _scaled(count: int, fraction: float) -> int:
    return max(1, round(count * fraction))


def _history_bounds(spec: Published, n_rated: int, dataset: str, fraction: float) -> tuple[int, int]:
    """(shortest, longest) history: the published ones, the longest at most half the rated
    catalogue so that distinct items can always be found."""
    longest = min(spec.max_history, n_rated // 2)
    if longest < spec.min_history:
        smallest = 2 * spec.min_history / spec.rated_items
        raise UserInputError(
            f"{dataset}: fraction={fraction} leaves {n_rated} rated items, too few for histories "
            f"of at least {spec.min_history} distinct items; expected fraction >= {smallest:.4g}"
        )
    return spec.min_history, longest


def _fit_total(lengths: np.ndarray, total: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """``lengths`` (within [lo, hi]) changed as little as possible to sum to ``total``, or as
    near as [lo, hi] allows: the excess over ``lo`` scaled (stochastic rounding keeps small
    lengths' proportions), then +-1 to random users."""
    lengths = lengths.astype(np.int64)
    excess = lengths - lo
    want = total - lo * len(lengths)
    if excess.sum() > 0 and want > 0:
        scaled = excess * (want / excess.sum())
        whole = np.floor(scaled)
        excess = whole + (rng.random(len(scaled)) < scaled - whole)
        lengths = np.clip(lo + excess.astype(np.int64), lo, hi)
    diff = total - int(lengths.sum())
    while diff:
        step = 1 if diff > 0 else -1
        movable = np.flatnonzero(lengths < hi if step > 0 else lengths > lo)
        if not len(movable):
            break
        chosen = movable if abs(diff) >= len(movable) else \
            rng.choice(movable, abs(diff), replace=False)
        lengths[chosen] += step
        diff -= step * len(chosen)
    return lengths


def _lognormal_lengths(n: int, total: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    # MovieLens: the excess over the minimum is log-normal (ml-20m: median history 68, mean 144).
    raw = lo + np.floor(rng.lognormal(math.log(48.0), 1.38, size=n))
    return _fit_total(np.clip(raw, lo, hi), total, lo, hi, rng)


def _pareto_exponent(mean: float, hi: int) -> float:
    """The a for which floor(X), X Pareto with P(X >= k) = k ** -a and capped at ``hi``, has this
    mean: E = sum_{k=1..hi} k ** -a, found by bisection."""
    ks = np.arange(1, hi + 1, dtype=np.float64)
    low, high = 1.0001, 6.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if np.sum(ks ** -mid) > mean else (low, mid)
    return (low + high) / 2


def _pareto_lengths(n: int, total: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    # Books: most users rate once (P(L >= k) = k ** -a, a ~ 1.46 at the published sizes).
    a = _pareto_exponent(total / n, hi)
    raw = np.floor(rng.random(n) ** (-1.0 / a))
    return _fit_total(np.clip(raw, lo, hi), total, lo, hi, rng)


def _popularity_cdf(n: int, exponent: float, offset: float) -> np.ndarray:
    """Cumulative popularity of ranks 0..n-1. The offset is the published one times the fraction,
    so that a fraction's catalogue has the same shape (the same share of items above a count)."""
    offset = max(offset, 1.0)
    weights = (np.arange(n, dtype=np.float64) + offset) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


# ---------------------------------------------------------------------------- one chunk
def _chunks(lengths: np.ndarray) -> Iterator[tuple[int, int]]:
    """Consecutive user ranges [a, b) holding about :data:`_CHUNK_ROWS` rows each."""
    ends = np.cumsum(lengths)
    a = 0
    while a < len(lengths):
        before = int(ends[a - 1]) if a else 0
        b = int(np.searchsorted(ends, before + _CHUNK_ROWS, side="right"))
        b = max(b, a + 1)
        yield a, b
        a = b


def _distinct_items(lengths: np.ndarray, cdf: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Popularity-drawn item ranks, ``lengths[u]`` distinct ones per user, users in order, each
    user's in random order. Duplicates are redrawn; from the fourth round uniformly, which always
    ends because no history is longer than half the catalogue."""
    n_users, n_items = len(lengths), len(cdf)
    owners = np.repeat(np.arange(n_users, dtype=np.int64), lengths)
    keys = owners * n_items + _draw(cdf, len(owners), rng)
    for round_ in range(200):
        keys = _sorted_distinct(keys)  # by owner, then item
        short = lengths - np.bincount(keys // n_items, minlength=n_users)
        if (short <= 0).all():
            break
        more = np.repeat(np.arange(n_users, dtype=np.int64), 2 * np.maximum(short, 0))
        draws = _draw(cdf, len(more), rng) if round_ < 3 else rng.integers(0, n_items, len(more))
        keys = np.concatenate([keys, more * n_items + draws])
    else:  # pragma: no cover - impossible while histories are at most half the catalogue
        raise RuntimeError("could not draw distinct items")
    owners = keys // n_items
    # a random subset of exactly lengths[u] per user, in random order
    order = np.lexsort((rng.random(len(keys)), owners))
    keys, owners = keys[order], owners[order]
    starts = np.searchsorted(owners, np.arange(n_users))
    keep = np.arange(len(keys)) - starts[owners] < lengths[owners]
    return keys[keep] % n_items


def _sorted_distinct(values: np.ndarray) -> np.ndarray:
    # np.unique hashes first (numpy >= 2.3), several times slower than a sort for int64 keys
    values = np.sort(values)
    keep = np.ones(len(values), dtype=bool)
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _draw(cdf: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ranks drawn with the probabilities whose cumulative sums are ``cdf``."""
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(cdf) - 1)


def _times(lengths: np.ndarray, first: np.ndarray, span: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each user's event times: ``first + span * sorted uniforms``, non-decreasing per user."""
    owners = np.repeat(np.arange(len(lengths)), lengths)
    u = rng.random(len(owners))
    u = u[np.lexsort((u, owners))]
    return first[owners] + np.floor(u * span[owners]).astype(np.int64)


def _ratings(n: int, spec: Published, rng: np.random.Generator) -> pa.Array:
    weights = np.asarray(spec.rating_weights, dtype=np.float64)
    codes = np.searchsorted(np.cumsum(weights) / weights.sum(), rng.random(n), side="right")
    return pa.array(spec.rating_values).take(pa.array(np.minimum(codes, len(weights) - 1)))


def _chunk_rng(seed: int, stream: int, chunk: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, chunk])


# ---------------------------------------------------------------------------- ids
def _affine(index: np.ndarray, modulus: int, multiplier: int, shift: int) -> np.ndarray:
    """A bijection of [0, modulus) (``multiplier`` coprime to it), so that ids look scattered yet
    never collide; index * multiplier stays below 2**63."""
    return (index.astype(np.int64) * multiplier + shift) % modulus


def _digits(values: np.ndarray, width: int, base: int) -> np.ndarray:
    """[n, width] digits of ``values``, most significant first."""
    out = np.empty((len(values), width), dtype=np.int64)
    rest = values.copy()
    for col in range(width - 1, -1, -1):
        out[:, col] = rest % base
        rest //= base
    return out


def _strings(chars: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A string array from a [n, width] uint8 matrix, row i cut to ``lengths[i]`` characters."""
    width = chars.shape[1]
    data = chars[np.arange(width) < lengths[:, None]]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(data.tobytes()))


def _user_ids(index: np.ndarray, seed: int) -> pa.Array:
    """``A`` + 12 or 13 base-36 characters (the real ids are mostly 13 or 14 long)."""
    long_ = index % 3 == 0
    chars = np.empty((len(index), 14), dtype=np.uint8)
    chars[:, 0] = ord("A")
    chars[:, 1:13] = _BASE36[_digits(_affine(index, 36 ** 12, 274_877_906_945, 1_234_567_890_123 + seed * 7_777_777), 12, 36)]
    # a long id has one more character; ids of one length are distinct through the bijection
    chars[:, 13] = _BASE36[(index * 7 + seed) % 36]
    return _strings(chars, np.where(long_, 14, 13))


def _asins(n: int, seed: int) -> pa.Array:
    """10-character ASINs: ISBN-10s (9 digits and a check digit, 0-9 or X), and one in twelve a
    Kindle-style ``B00`` + 7 base-36 characters."""
    index = np.arange(n, dtype=np.int64)
    kindle = index % 12 == 5
    chars = np.empty((n, 10), dtype=np.uint8)
    body = _digits(_affine(index, 10 ** 9, 79_193, 123_456_789 + seed * 7_777), 9, 10)
    check = (11 - (body * np.arange(10, 1, -1)).sum(axis=1) % 11) % 11
    chars[:, :9] = body + ord("0")
    chars[:, 9] = np.where(check == 10, ord("X"), check + ord("0"))
    k = np.flatnonzero(kindle)
    chars[k, :3] = np.frombuffer(b"B00", dtype=np.uint8)
    chars[k, 3:] = _BASE36[_digits(_affine(k, 36 ** 7, 1_000_003, 9_876_543_210 + seed * 7_777), 7, 36)]
    return _strings(chars, np.full(n, 10))


# ---------------------------------------------------------------------------- files
@contextmanager
def _staged_file(path: Path) -> Iterator[IO[bytes]]:
    """A file written under a temporary name beside ``path`` and renamed over it on success;
    removed on failure, so a killed or failed run never leaves a file under the real name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_events(
    handle: IO[bytes],
    header: bytes,
    spec: Published,
    lengths: np.ndarray,
    cdf: np.ndarray,
    columns: Callable[[int, int, np.ndarray, np.ndarray, np.random.Generator], list[tuple[str, pa.Array]]],
    seed: int,
) -> int:
    """Write every user's events, chunk by chunk; ``columns(a, b, ranks, times, rng)`` gives the
    named columns of users [a, b) from their item ranks and times. Returns how many distinct
    items the file holds (a rare item may never be drawn)."""
    handle.write(header)
    span_rng = np.random.default_rng([seed, 1])
    n = len(lengths)
    # When each user starts and how long they stay: the start skewed to recent years, as both
    # sites grew; the span log-normal (most users rate within days, some over years).
    t0, t1 = spec.first_time, spec.last_time
    first = t0 + np.floor(span_rng.random(n) ** 0.6 * (t1 - t0)).astype(np.int64)
    span = np.minimum(span_rng.lognormal(math.log(3 * _DAY), 3.0, size=n), t1 - first)
    writer = None
    drawn = np.zeros(len(cdf), dtype=bool)
    for number, (a, b) in enumerate(_chunks(lengths)):
        rng = _chunk_rng(seed, 2, number)
        ranks = _distinct_items(lengths[a:b], cdf, rng)
        drawn[ranks] = True
        times = _times(lengths[a:b], first[a:b], span[a:b], rng)
        named = columns(a, b, ranks, times, rng)
        table = pa.table(dict(named))
        if writer is None:
            writer = pa_csv.CSVWriter(handle, table.schema, write_options=_WRITE)
        writer.write_table(table)
    if writer is not None:
        writer.close()
    return int(drawn.sum())


def _summary(out: Path, files: list[Path], started: float, **counts: Any) -> dict[str, Any]:
    return {
        "out": str(out),
        "files": {p.name: p.stat().st_size for p in files},
        **counts,
        "seconds": round(time.perf_counter() - started, 3),
    }


# ---------------------------------------------------------------------------- datasets
def generate_ml20m(out_dir: Path, fraction: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """Write ``ratings.csv`` and ``movies.csv`` of an ml-20m stand-in into ``out_dir``."""
    started = time.perf_counter()
    fraction = _check_fraction(fraction)
    out = Path(out_dir)
    spec = ML20M
    n_users, n_rated = _scaled(spec.users, fraction), _scaled(spec.rated_items, fraction)
    n_movies = max(n_rated, _scaled(ML20M_MOVIES, fraction))
    max_id = max(n_movies, _scaled(ML20M_MAX_MOVIE_ID, fraction))
    lo, hi = _history_bounds(spec, n_rated, "ml-20m", fraction)
    rng = np.random.default_rng([seed, 0])
    lengths = _lognormal_lengths(n_users, round(spec.rows * fraction), lo, hi, rng)
    movie_ids = np.sort(rng.choice(np.arange(1, max_id + 1), n_movies, replace=False))
    # which movies get ratings, in order of popularity (the rest are listed but never rated)
    by_popularity = movie_ids[rng.permutation(n_movies)[:n_rated]]
    cdf = _popularity_cdf(n_rated, spec.zipf_exponent, spec.zipf_offset * fraction)

    def columns(a, b, ranks, times, chunk_rng):
        users = np.repeat(np.arange(a + 1, b + 1, dtype=np.int64), lengths[a:b])
        return [("userId", pa.array(users)), ("movieId", pa.array(by_popularity[ranks])),
                ("rating", _ratings(len(ranks), spec, chunk_rng)), ("timestamp", pa.array(times))]

    ratings, movies = out / "ratings.csv", out / "movies.csv"
    with ExitStack() as stack:
        # both files under temporary names until both are complete
        ratings_handle = stack.enter_context(_staged_file(ratings))
        movies_handle = stack.enter_context(_staged_file(movies))
        rated = _write_events(ratings_handle, b"userId,movieId,rating,timestamp\n", spec,
                              lengths, cdf, columns, seed)
        _write_movies(movies_handle, movie_ids, np.random.default_rng([seed, 3]))
    return _summary(out, [ratings, movies], started, rows=int(lengths.sum()), users=n_users,
                    items=n_movies, rated_items=rated, fraction=fraction, seed=seed,
                    longest_history=int(lengths.max()), shortest_history=int(lengths.min()))


def _write_movies(handle: IO[bytes], movie_ids: np.ndarray, rng: np.random.Generator) -> None:
    """``movieId,title,genres``: titles with a year; some hold a comma (``..., The (1995)``), a
    double quote or a non-ASCII letter, as real titles do, so the reader's quoting is exercised."""
    import io

    text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["movieId", "title", "genres"])
    n = len(movie_ids)
    words = rng.integers(0, len(_TITLE_WORDS), size=(n, 2))
    kinds = rng.integers(0, 8, size=n)
    years = rng.integers(1915, 2016, size=n)
    n_genres = rng.integers(0, 4, size=n)
    genre_picks = rng.random((n, len(_GENRES))).argsort(axis=1)[:, :3]
    for i, movie in enumerate(movie_ids.tolist()):
        name = f"{_TITLE_WORDS[words[i, 0]]} {_TITLE_WORDS[words[i, 1]]} {movie}"
        if kinds[i] == 0:
            name = f"{name}, The"
        elif kinds[i] == 1:
            name = f'"{name}"'
        genres = "|".join(_GENRES[g] for g in sorted(genre_picks[i, :n_genres[i]])) \
            or "(no genres listed)"
        writer.writerow([movie, f"{name} ({years[i]})", genres])
    text.flush()
    text.detach()


def generate_amzn_books(out_dir: Path, fraction: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """Write ``ratings_Books.csv`` of an Amazon Books stand-in into ``out_dir``."""
    started = time.perf_counter()
    fraction = _check_fraction(fraction)
    out = Path(out_dir)
    spec = AMZN_BOOKS
    n_users, n_items = _scaled(spec.users, fraction), _scaled(spec.rated_items, fraction)
    lo, hi = _history_bounds(spec, n_items, "amzn-books", fraction)
    rng = np.random.default_rng([seed, 0])
    lengths = _pareto_lengths(n_users, round(spec.rows * fraction), lo, hi, rng)
    # users appear in a scattered order of their ids; items by popularity rank -> a random ASIN
    asins = _asins(n_items, seed).take(pa.array(rng.permutation(n_items)))
    cdf = _popularity_cdf(n_items, spec.zipf_exponent, spec.zipf_offset * fraction)

    def columns(a, b, ranks, times, chunk_rng):
        users = _user_ids(np.arange(a, b, dtype=np.int64), seed)
        owners = np.repeat(np.arange(b - a), lengths[a:b])
        days = times // _DAY * _DAY  # the real file's times are whole days
        return [("user", users.take(pa.array(owners))), ("item", asins.take(pa.array(ranks))),
                ("rating", _ratings(len(ranks), spec, chunk_rng)), ("timestamp", pa.array(days))]

    ratings = out / "ratings_Books.csv"
    with _staged_file(ratings) as handle:
        rated = _write_events(handle, b"", spec, lengths, cdf, columns, seed)
    return _summary(out, [ratings], started, rows=int(lengths.sum()), users=n_users,
                    items=rated, fraction=fraction, seed=seed,
                    longest_history=int(lengths.max()), shortest_history=int(lengths.min()))


GENERATORS: dict[str, Callable[[Path, float, int], dict[str, Any]]] = {
    "ml-20m": generate_ml20m,
    "amzn-books": generate_amzn_books,
}

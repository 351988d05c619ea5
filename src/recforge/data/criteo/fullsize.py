"""Full-size stand-ins for the raw Criteo downloads, in their real formats, generated.

``GENERATORS[name](out_dir, fraction, seed) -> summary`` writes

* ``criteo-kaggle``: ``out_dir/train.txt``, Criteo Kaggle's 45,840,617 rows at ``fraction`` 1
  (about 11 GB);
* ``criteo-day``: ``out_dir/day_0``, a Terabyte day file of 178,274,637 rows at 1 (day 23's count,
  about 43 GB),

``round(fraction * rows)`` rows below 1, so that the conversion and training commands run at the
published size (or a known share of it) without the download. It is the data's shape, not its
content; what is modelled on the real files:

* format: :mod:`.raw_writer`'s TSV, as ``train.txt`` / ``day_N``: label, 13 integers, 26 8-digit
  hex values, tab-separated, empty fields missing, LF line ends, no header;
* labels: about :data:`POSITIVE_RATE` positive (Kaggle's 25.6 %), drawn from a logit over the
  row's values (a value's effect is a hash of it), so models have something to learn;
* categorical tables: feature ``f`` draws from :func:`table_sizes` values: the spec's Kaggle
  counts (:data:`KAGGLE_CARDINALITIES`, 33.76M in all) at ``fraction`` 1, proportionally fewer
  below (a table never shrinks below ``min(count, SMALL_TABLE)``: a share of the real file still
  holds every value of a small feature); the day file scales them by its rows over Kaggle's
  (Kaggle's rate of new values per row; the Terabyte counts per day are not in the spec). A table
  of more than :data:`ALL_HEAD_MAX` values is a Zipf head (:data:`HEAD_SHARE` of the values,
  exponent :data:`ZIPF_EXPONENT`) plus a tail of values each used about :data:`TAIL_REPEAT` times,
  in turn as the file goes on (values never seen before keep appearing late in the file, as in the
  real logs): every value of the table occurs, so the distinct values seen are the table size;
  smaller tables are all head. A value's hex is a bijective scramble of its rank, so distinct
  ranks give distinct values;
* missing fields: Kaggle's rates (:data:`recforge.data.criteo.synthetic.DEFAULT_SPARSE_MISSING`,
  ``DEFAULT_DENSE_MISSING``), missing together in the groups where the real file misses them
  together (:data:`SPARSE_MISSING_GROUPS`, :data:`DENSE_MISSING_GROUPS`: in the real sample, e.g.
  C19, C20, C25 and C26 are empty on exactly the same rows);
* integers: the synthetic click model's heavy-tailed counts (zero-inflated log-normal with a
  shared latent factor, :mod:`.synthetic`), capped at :data:`raw_writer.MAX_DENSE`; I2 is
  negative (-1, -2, -3) on about :data:`I2_NEGATIVE_RATE` of rows (10.9 % in the real sample).

Streaming: :data:`BLOCK_ROWS` rows at a time (about 60 MB), each block from its own random stream
of ``(seed, dataset, block)``, the tail counters carried from block to block: the same seed gives
the same bytes. The file is written under a temporary name beside its target and renamed at the
end, so a killed run leaves no file of the real name; a write error (a full disk) is one line
naming the directory, and the partial file is removed.
"""
from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recforge.data.criteo.prepared import N_DENSE, N_SPARSE
from recforge.data.criteo.raw_writer import MAX_DENSE, format_tsv_lines
from recforge.data.criteo.splits import row_uniforms
from recforge.data.criteo.synthetic import (
    DEFAULT_DENSE_MISSING,
    DEFAULT_SPARSE_MISSING,
    DENSE_LATENT,
    DENSE_MEDIAN,
    DENSE_SIGMA,
    DENSE_ZERO,
    intercept_for,
)
from recforge.errors import UserInputError
from recforge.utils.atomic import apply_umask

__all__ = [
    "BLOCK_ROWS",
    "GENERATORS",
    "KAGGLE_CARDINALITIES",
    "KAGGLE_ROWS",
    "TERABYTE_DAY_ROWS",
    "RawCriteoSpec",
    "generate_kaggle",
    "generate_terabyte_day",
    "iter_raw_blocks",
    "table_sizes",
    "write_raw_criteo",
]

KAGGLE_ROWS = 45_840_617
TERABYTE_DAY_ROWS = 178_274_637  # day 23; the day files hold 150M to 200M rows each
# Distinct values per feature in Criteo Kaggle (spec dlrm.md §2, facebookresearch/dlrm's counts).
KAGGLE_CARDINALITIES = (
    1460, 583, 10_131_227, 2_202_608, 305, 24, 12_517, 633, 3, 93_145, 5683, 8_351_593, 3194,
    27, 14_992, 5_461_306, 10, 5652, 2173, 4, 7_046_547, 18, 15, 286_181, 105, 142_572,
)
POSITIVE_RATE = 0.256
SMALL_TABLE = 10_000
ALL_HEAD_MAX = 20_000
HEAD_SHARE = 0.05
TAIL_REPEAT = 1.5
ZIPF_EXPONENT = 1.05
I2_NEGATIVE_RATE = 0.10
BLOCK_ROWS = 65_536
_PILOT_ROWS = 65_536
# 0-based columns that are empty on the same rows (from the real sample's co-missingness).
SPARSE_MISSING_GROUPS = ((2, 3, 11, 15, 20, 23), (5,), (18, 19, 24, 25), (21,))
DENSE_MISSING_GROUPS = ((0, 9), (2,), (3, 12), (4,), (5,), (6, 8, 10), (7,), (11,))
_MAX_PROBABILITY_TAIL = 0.9
_SALTS = {"criteo-kaggle": 0, "criteo-day": 1}


def scaled_rows(full_rows: int, fraction: float) -> int:
    """``round(fraction * full_rows)``, at least 1; a fraction outside (0, 1] is a user error."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise UserInputError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return max(1, round(float(fraction) * full_rows))


def table_sizes(full: Sequence[int], fraction: float) -> list[int]:
    """Per feature ``max(min(n, SMALL_TABLE), round(fraction * n))``: proportional, small tables kept."""
    scaled_rows(1, fraction)
    return [max(min(int(n), SMALL_TABLE), round(fraction * int(n))) for n in full]


@dataclass(frozen=True)
class RawCriteoSpec:
    """What one generated file holds: ``rows`` rows, feature ``f`` drawing from ``tables[f]``
    values, randomness from ``(seed, salt)``."""

    rows: int
    tables: tuple[int, ...]
    seed: int
    salt: int

    def __post_init__(self) -> None:
        if len(self.tables) != N_SPARSE or min(self.tables) < 1 or max(self.tables) > 2**32:
            raise ValueError(f"tables must be {N_SPARSE} sizes in [1, 2**32], got {list(self.tables)}")
        if self.rows < 1 or self.seed < 0:
            raise ValueError(f"rows must be >= 1 and seed >= 0, got {self.rows}, {self.seed}")


def _missing_rates(groups: tuple[tuple[int, ...], ...], rates: Sequence[float], n: int) -> np.ndarray:
    out = np.zeros(n)
    for group in groups:
        out[list(group)] = rates[group[0]]
    return out


_SPARSE_MISSING = _missing_rates(SPARSE_MISSING_GROUPS, DEFAULT_SPARSE_MISSING, N_SPARSE)
_DENSE_MISSING = _missing_rates(DENSE_MISSING_GROUPS, DEFAULT_DENSE_MISSING, N_DENSE)


def _fmix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 (xor-shifts and odd multipliers)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def _zipf_ranks(u: np.ndarray, n: int) -> np.ndarray:
    """Ranks in ``[0, n)`` from uniforms ``u``, rank ``k`` with weight about ``(k + 1) ** -s``
    (the inverse of the continuous power law on ``[1, n + 1)``; no table of ``n`` entries)."""
    a = 1.0 - ZIPF_EXPONENT
    x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, n - 1)


class _Model:
    """The per-feature constants of one spec: head and tail sizes, tail probabilities, value keys,
    label weights and intercept."""

    def __init__(self, spec: RawCriteoSpec) -> None:
        self.spec = spec
        tables = np.array(spec.tables, dtype=np.int64)
        self.head = np.where(tables > ALL_HEAD_MAX, np.ceil(tables * HEAD_SHARE).astype(np.int64), tables)
        self.tail = tables - self.head
        present = spec.rows * (1.0 - _SPARSE_MISSING)
        self.p_tail = np.minimum(TAIL_REPEAT * self.tail / np.maximum(present, 1.0), _MAX_PROBABILITY_TAIL)
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, spec.salt, 0]))
        self.keys = rng.integers(0, 2**32, size=N_SPARSE, dtype=np.uint64).astype(np.uint32)
        self.sparse_weight = rng.uniform(0.1, 0.5, size=N_SPARSE)
        self.dense_weight = 0.25 * rng.standard_normal(N_DENSE)
        self.effect_seed = int(rng.integers(0, 2**62))
        self.intercept = 0.0
        pilot = _draw(self, np.random.default_rng(np.random.SeedSequence([spec.seed, spec.salt, 2])),
                      _PILOT_ROWS, np.zeros(N_SPARSE, dtype=np.int64))
        self.intercept = intercept_for(pilot.logit, POSITIVE_RATE)


@dataclass
class _Block:
    labels: np.ndarray  # [n] int8
    dense: np.ndarray  # [13, n] int64
    dense_missing: np.ndarray  # [13, n] bool
    sparse: np.ndarray  # [26, n] int64, -1 = missing
    logit: np.ndarray  # [n] float64, intercept included


def _draw(model: _Model, rng: np.random.Generator, n: int, tail_seen: np.ndarray) -> _Block:
    """``n`` rows from ``rng``; ``tail_seen[f]``: tail values of ``f`` used before (advanced)."""
    u_sparse_missing = rng.random((len(SPARSE_MISSING_GROUPS), n))
    u_rank = rng.random((N_SPARSE, n))
    u_dense_missing = rng.random((len(DENSE_MISSING_GROUPS), n))
    u_state = rng.random((N_DENSE, n))
    z = rng.standard_normal((1 + N_DENSE, n))
    u_label = rng.random(n)

    logit = np.full(n, model.intercept)
    sparse = np.empty((N_SPARSE, n), dtype=np.int64)
    missing = np.zeros((N_SPARSE, n), dtype=bool)
    for g, group in enumerate(SPARSE_MISSING_GROUPS):
        for f in group:
            missing[f] = u_sparse_missing[g] < _SPARSE_MISSING[f]
    for f in range(N_SPARSE):
        u = u_rank[f]
        p = model.p_tail[f]
        ranks = _zipf_ranks((u - p) / (1.0 - p) if p > 0 else u, int(model.head[f]))
        if p > 0:
            tail = (u < p) & ~missing[f]
            order = np.cumsum(tail) - 1 + tail_seen[f]
            ranks[tail] = model.head[f] + order[tail] % model.tail[f]
            tail_seen[f] += int(np.count_nonzero(tail))
        effect = 2.0 * row_uniforms(model.effect_seed, f, ranks) - 1.0
        logit += np.where(missing[f], 0.0, model.sparse_weight[f] * effect)
        values = _fmix32(ranks.astype(np.uint32) ^ model.keys[f]).astype(np.int64)
        sparse[f] = np.where(missing[f], -1, values)

    dense_missing = np.zeros((N_DENSE, n), dtype=bool)
    for g, group in enumerate(DENSE_MISSING_GROUPS):
        for j in group:
            dense_missing[j] = u_dense_missing[g] < _DENSE_MISSING[j]
    latent = DENSE_LATENT * z[:1] + np.sqrt(1.0 - DENSE_LATENT**2) * z[1:]
    counts = np.floor(np.exp(np.log(DENSE_MEDIAN)[:, None] + DENSE_SIGMA[:, None] * latent))
    dense = np.minimum(counts, MAX_DENSE).astype(np.int64)
    dense[u_state < DENSE_ZERO[:, None]] = 0
    negative = u_state[1] >= 1.0 - I2_NEGATIVE_RATE
    dense[1, negative] = -1 - (u_state[1, negative] >= 1.0 - 0.2 * I2_NEGATIVE_RATE) \
        - (u_state[1, negative] >= 1.0 - 0.05 * I2_NEGATIVE_RATE)
    logit += (np.where(dense_missing, 0.0, latent) * model.dense_weight[:, None]).sum(axis=0)

    labels = (u_label < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
    return _Block(labels, dense, dense_missing, sparse, logit)


def iter_raw_blocks(spec: RawCriteoSpec) -> Iterator[_Block]:
    """The rows of ``spec`` in :data:`BLOCK_ROWS` blocks, in file order."""
    model = _Model(spec)
    tail_seen = np.zeros(N_SPARSE, dtype=np.int64)
    for block, start in enumerate(range(0, spec.rows, BLOCK_ROWS)):
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, spec.salt, 1, block]))
        yield _draw(model, rng, min(BLOCK_ROWS, spec.rows - start), tail_seen)


def write_raw_criteo(path: Path, spec: RawCriteoSpec) -> dict[str, Any]:
    """Write ``spec``'s rows to ``path`` (through a temporary name beside it); rows and positives."""
    path = Path(path)
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = tempfile.NamedTemporaryFile(dir=directory, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    except OSError as error:
        raise UserInputError(f"{directory}: cannot write {path.name} there: {error.strerror or error}") from None
    tmp = Path(handle.name)
    positives = 0
    try:
        with handle:
            for block in iter_raw_blocks(spec):
                positives += int(block.labels.sum())
                lines = format_tsv_lines(block.labels, block.dense.T, block.dense_missing.T, block.sparse.T)
                handle.write(memoryview(lines))
        apply_umask(tmp)  # a plain open's mode, not the temporary file's 0600
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            what = "the disk is full" if error.errno == errno.ENOSPC else (error.strerror or str(error))
            raise UserInputError(f"{directory}: writing {path.name} failed ({what}); nothing was left there") \
                from None
        raise
    return {"rows": spec.rows, "positives": positives}


def _generate(name: str, file_name: str, full_rows: int, full_tables: Sequence[int],
              out_dir: Path, fraction: float, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    rows = scaled_rows(full_rows, fraction)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UserInputError(f"seed must be an integer >= 0, got {seed!r}")
    spec = RawCriteoSpec(rows, tuple(table_sizes(full_tables, fraction)), int(seed), _SALTS[name])
    path = Path(out_dir) / file_name
    written = write_raw_criteo(path, spec)
    return {
        "dataset": name,
        "out": str(out_dir),
        "fraction": float(fraction),
        "seed": int(seed),
        "files": {file_name: path.stat().st_size},
        "rows": written["rows"],
        "positives": written["positives"],
        "table_sizes": list(spec.tables),
        "seconds": round(time.perf_counter() - started, 3),
    }


def generate_kaggle(out_dir: Path, fraction: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """``out_dir/train.txt``: Criteo Kaggle's rows (``fraction`` of them); the summary."""
    return _generate("criteo-kaggle", "train.txt", KAGGLE_ROWS, KAGGLE_CARDINALITIES, out_dir, fraction, seed)


def generate_terabyte_day(out_dir: Path, fraction: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """``out_dir/day_0``: a Terabyte day file (``fraction`` of day 23's rows); the summary.
    Another day: another ``seed`` (and rename the file)."""
    per_row = TERABYTE_DAY_ROWS / KAGGLE_ROWS
    tables = [n if n <= SMALL_TABLE else round(n * per_row) for n in KAGGLE_CARDINALITIES]
    return _generate("criteo-day", "day_0", TERABYTE_DAY_ROWS, tables, out_dir, fraction, seed)


GENERATORS: dict[str, Callable[[Path, float, int], dict[str, Any]]] = {
    "criteo-kaggle": generate_kaggle,
    "criteo-day": generate_terabyte_day,
}

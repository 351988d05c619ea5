"""A learnable synthetic session dataset in the GRU4Rec format.

Sessions are walks on a sparse item graph: each item has a few successors with peaked transition
probabilities, and with a small probability the walk restarts from global (power-law) popularity.
A next-item model can therefore beat popularity by a wide margin, which makes the data useful for
smoke-testing that training actually learns, without downloading anything.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from recforge.data.prepared_dir import StagedDir, as_json, build_once, cache_key, why_not_current
from recforge.data.sessions.io import ITEM_KEY, SESSION_KEY, TIME_KEY, write_session_file

__all__ = [
    "SyntheticSessionsConfig",
    "SPLIT_FILES",
    "generate_sessions",
    "split_by_time",
    "write_synthetic_dataset",
]

SECONDS_PER_DAY = 86400.0
SPLIT_FILES = {
    "train_full": "train_full.txt",
    "test": "test.txt",
    "train_tr": "train_tr.txt",
    "train_valid": "train_valid.txt",
}
# Bump when the generator's output changes for the same config, so stale caches are not reused.
_GENERATOR_VERSION = 1


@dataclass(frozen=True)
class SyntheticSessionsConfig:
    """Parameters of the synthetic session generator (all of them key the on-disk cache)."""

    n_items: int = 2000
    n_sessions: int = 20000
    mean_session_length: float = 5.0  # lengths are 1 + geometric, so at least 2
    zipf_exponent: float = 1.1  # global item popularity ~ rank ** -zipf_exponent
    n_successors: int = 8  # size of each item's successor set
    successor_concentration: float = 1.5  # successor k is weighted ~ k ** -concentration
    restart_prob: float = 0.1  # chance that the next item comes from global popularity
    days: int = 30
    test_days: int = 2
    valid_days: int = 2
    seed: int = 0
    start_time: float = 1_388_534_400.0  # 2014-01-01 UTC, same era as the YooChoose data
    median_gap_seconds: float = 45.0  # typical time between clicks inside a session

    def __post_init__(self) -> None:
        if self.n_items < 2:
            raise ValueError(f"n_items must be >= 2, got {self.n_items}")
        if self.n_sessions < 1:
            raise ValueError(f"n_sessions must be >= 1, got {self.n_sessions}")
        if self.mean_session_length < 2:
            raise ValueError(f"mean_session_length must be >= 2, got {self.mean_session_length}")
        if not 1 <= self.n_successors < self.n_items:
            raise ValueError(
                f"n_successors must be in [1, n_items={self.n_items}), got {self.n_successors}"
            )
        if not 0.0 <= self.restart_prob <= 1.0:
            raise ValueError(f"restart_prob must be in [0, 1], got {self.restart_prob}")
        if self.days <= 0 or self.test_days < 0 or self.valid_days < 0:
            raise ValueError("days must be > 0 and test_days/valid_days >= 0")
        if self.test_days + self.valid_days >= self.days:
            raise ValueError(
                f"test_days + valid_days ({self.test_days} + {self.valid_days}) "
                f"must be < days ({self.days})"
            )
        if self.median_gap_seconds <= 0:
            raise ValueError(f"median_gap_seconds must be > 0, got {self.median_gap_seconds}")

    def params(self) -> dict:
        """Every field and the generator's version: what the cache directory is keyed by."""
        return {**dataclasses.asdict(self), "_generator_version": _GENERATOR_VERSION}

    def cache_key(self) -> str:
        """A short hash of every field: changing any field gives a different key."""
        return cache_key(self.params())


def generate_sessions(cfg: SyntheticSessionsConfig | None = None) -> pd.DataFrame:
    """Generate sessions as a GRU4Rec-format frame (SessionId, ItemId, Time), sorted by session.

    Session ids start at 1 and follow session start time; item ids look like ``"i123"``.
    """
    cfg = cfg or SyntheticSessionsConfig()
    rng = np.random.default_rng(cfg.seed)
    n_items = cfg.n_items

    # Popularity ranks are shuffled over item ids so that id order carries no signal.
    rank = rng.permutation(n_items)
    popularity = (rank + 1.0) ** -cfg.zipf_exponent
    popularity /= popularity.sum()
    pop_cdf = np.cumsum(popularity)

    successors = _draw_successors(rng, pop_cdf, cfg.n_successors)
    succ_rank = np.arange(1, cfg.n_successors + 1, dtype=np.float64)
    succ_weights = succ_rank ** -cfg.successor_concentration
    succ_cdf = np.cumsum(succ_weights / succ_weights.sum())

    lengths = 1 + rng.geometric(1.0 / (cfg.mean_session_length - 1.0), size=cfg.n_sessions)
    offsets = np.zeros(cfg.n_sessions + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    items = np.empty(int(offsets[-1]), dtype=np.int64)

    # Walk all sessions in lockstep; longest first, so the sessions still running at step t are a
    # prefix of `by_length` and each step is one vectorised draw.
    by_length = np.argsort(-lengths, kind="stable")
    still_running = np.bincount(lengths, minlength=lengths.max() + 1)[::-1].cumsum()[::-1]
    current = _sample(rng, pop_cdf, cfg.n_sessions)[by_length]
    items[offsets[by_length]] = current
    for step in range(1, int(lengths.max())):
        active = int(still_running[step + 1])
        current = current[:active]
        rows = by_length[:active]
        rank_drawn = _sample(rng, succ_cdf, active)
        following = successors[current, rank_drawn]
        restart = rng.random(active) < cfg.restart_prob
        if restart.any():
            following[restart] = _sample_except(rng, pop_cdf, current[restart])
        items[offsets[rows] + step] = following
        current = following

    # Session starts spread uniformly over the period; ids follow start order like real logs do.
    starts = np.sort(rng.uniform(0.0, cfg.days * SECONDS_PER_DAY, size=cfg.n_sessions))
    # Positive log-normal gaps: mostly tens of seconds, sometimes minutes, never zero.
    gaps = 1.0 + rng.lognormal(np.log(cfg.median_gap_seconds), 1.0, size=items.size)
    session_of = np.repeat(np.arange(cfg.n_sessions), lengths)
    gaps[offsets[:-1]] = 0.0
    elapsed = np.cumsum(gaps)
    elapsed -= np.repeat(elapsed[offsets[:-1]], lengths)
    times = np.round(cfg.start_time + starts[session_of] + elapsed, 3)

    names = np.array([f"i{j}" for j in range(n_items)], dtype=object)
    return pd.DataFrame(
        {
            SESSION_KEY: (session_of + 1).astype(np.int64),
            ITEM_KEY: pd.Series(names[items], dtype=object).astype(str),
            TIME_KEY: times.astype(np.float64),
        }
    )


def split_by_time(
    df: pd.DataFrame,
    days_last: float,
    session_key: str = SESSION_KEY,
    time_key: str = TIME_KEY,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split into (train, test): test holds whole sessions starting in the last ``days_last`` days.

    The boundary is ``max(Time) - days_last * 86400`` (times in seconds), as in the reference
    preprocessing; a session goes to test when its first event is at or after it.
    """
    boundary = df[time_key].max() - days_last * SECONDS_PER_DAY
    first = df.groupby(session_key, sort=False)[time_key].transform("min")
    in_test = (first >= boundary).to_numpy()
    return df[~in_test].reset_index(drop=True), df[in_test].reset_index(drop=True)


def write_synthetic_dataset(
    cfg: SyntheticSessionsConfig | None, directory: str | os.PathLike[str]
) -> dict[str, Path]:
    """Write (or reuse) the four GRU4Rec split files under ``directory / cfg.cache_key()``.

    Returns paths keyed ``train_full``, ``test``, ``train_tr``, ``train_valid``. Built once
    (:func:`recforge.data.prepared_dir.build_once`): concurrent callers wait for one writer, and
    an interrupted or incomplete directory is written again; ``done.json`` records the config.
    """
    cfg = cfg or SyntheticSessionsConfig()
    target = Path(directory) / cfg.cache_key()
    identity = {"generator": as_json(cfg.params())}

    def build(target: Path) -> None:
        train_full, test = split_by_time(generate_sessions(cfg), cfg.test_days)
        train_tr, train_valid = split_by_time(train_full, cfg.valid_days)
        frames = {"train_full": train_full, "test": test, "train_tr": train_tr,
                  "train_valid": train_valid}
        with StagedDir(target) as staged:
            for name, frame in frames.items():
                write_session_file(frame, staged.path / SPLIT_FILES[name])
            staged.publish(identity)

    build_once(target, build,
               lambda target: why_not_current(target, identity, files=SPLIT_FILES.values()))
    return {name: target / filename for name, filename in SPLIT_FILES.items()}


def _sample(rng: np.random.Generator, cdf: np.ndarray, size: int) -> np.ndarray:
    """Draw ``size`` indices from the distribution with cumulative probabilities ``cdf``."""
    # Clip guards against cdf[-1] being a hair below 1 after floating-point summation.
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), len(cdf) - 1)


def _sample_except(rng: np.random.Generator, cdf: np.ndarray, avoid: np.ndarray) -> np.ndarray:
    """Draw one index per entry of ``avoid``, never equal to it (no immediate repeats)."""
    out = _sample(rng, cdf, avoid.size)
    clash = out == avoid
    while clash.any():
        out[clash] = _sample(rng, cdf, int(clash.sum()))
        clash = out == avoid
    return out


def _draw_successors(rng: np.random.Generator, pop_cdf: np.ndarray, k: int) -> np.ndarray:
    """Pick ``k`` distinct successors per item (never itself), favouring popular items.

    Weighted sampling without replacement is done by over-drawing with replacement and keeping the
    first ``k`` distinct picks per row; the rare row left short is topped up uniformly.
    """
    n = len(pop_cdf)
    n_draws = 4 * k + 8
    cand = _sample(rng, pop_cdf, n * n_draws).reshape(n, n_draws)
    cand[cand == np.arange(n)[:, None]] = -1
    # A pick is usable unless it is a self-loop or repeats a value drawn earlier in the same row.
    order = np.argsort(cand, axis=1, kind="stable")
    ordered = np.take_along_axis(cand, order, axis=1)
    repeat = np.zeros_like(ordered, dtype=bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    usable = np.empty_like(repeat)
    np.put_along_axis(usable, order, ~repeat & (ordered >= 0), axis=1)
    # Usable picks first, each group in draw order.
    first_usable = np.argsort(~usable, axis=1, kind="stable")[:, :k]
    successors = np.take_along_axis(cand, first_usable, axis=1)
    for row in np.flatnonzero(usable.sum(axis=1) < k):
        chosen = [int(s) for s in successors[row] if s >= 0]
        chosen = list(dict.fromkeys(chosen))
        pool = np.setdiff1d(np.arange(n), np.array(chosen + [row]))
        extra = rng.choice(pool, size=k - len(chosen), replace=False)
        successors[row] = np.concatenate([np.array(chosen, dtype=np.int64), extra])
    # Shuffle within each row so the most likely successor is not simply the most popular item.
    shuffle = np.argsort(rng.random((n, k)), axis=1)
    return np.take_along_axis(successors, shuffle, axis=1)

"""Pure preprocessing steps on event frames (spec §1.9).

Frames have columns ``SessionId`` (int), ``ItemId`` and ``Time`` (float), plus whatever else the
caller carries along. ``ItemId`` may hold plain strings or be a categorical; the readers use a
categorical whose category order is the reference's tie-break between events with equal
timestamps, so sorting by ItemId reproduces it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from recforge.data.sessions.io import ITEM_KEY, SESSION_KEY, TIME_KEY

__all__ = [
    "SECONDS_PER_DAY",
    "drop_short_sessions",
    "filter_support",
    "remove_consecutive_duplicates",
    "rsc15_filter",
    "rsc15_split",
    "rsc15_train_test_valid",
    "sessionize",
    "third_party_pipeline",
    "views_after_sessionizing",
    "time_split",
    "train_test_valid",
    "unit_factor",
]

SECONDS_PER_DAY = 86400
_UNIT_PER_SECOND = {"s": 1, "ms": 1000}
Splits = dict[str, pd.DataFrame]


def unit_factor(time_unit: str) -> int:
    """Time units per second for ``time_unit`` ("s" or "ms")."""
    try:
        return _UNIT_PER_SECOND[time_unit]
    except KeyError:
        raise ValueError(
            f"time_unit must be one of {list(_UNIT_PER_SECOND)}, got {time_unit!r}"
        ) from None


def remove_consecutive_duplicates(df: pd.DataFrame) -> pd.DataFrame:
    """Drop an event when the previous event of the same session has the same item.

    ``(i, i, j)`` becomes ``(i, j)``; ``(i, j, i)`` is kept. Events are first sorted by
    (SessionId, Time, ItemId), as the reference does, so among events with equal timestamps equal
    items end up adjacent and count as consecutive.
    """
    df = _sorted(df, [SESSION_KEY, TIME_KEY, ITEM_KEY])
    sid = df[SESSION_KEY].to_numpy()
    item = _item_codes(df[ITEM_KEY])
    dup = np.zeros(len(df), dtype=bool)
    dup[1:] = (sid[1:] == sid[:-1]) & (item[1:] == item[:-1])
    return df[~dup].reset_index(drop=True)


def sessionize(
    df: pd.DataFrame,
    user_key: str,
    *,
    time_unit: str = "s",
    gap_seconds: float = 3600.0,
) -> pd.DataFrame:
    """Assign ``SessionId``: a user's new session starts after more than ``gap_seconds`` idle.

    A gap of exactly ``gap_seconds`` stays in the same session (the reference tests ``> 1 h``).
    ``time_unit`` ("s" or "ms") is the unit of ``Time``. Events are sorted by (user, Time, ItemId)
    first; session ids are 0, 1, ... in that order. Other columns are kept.
    """
    gap = gap_seconds * unit_factor(time_unit)
    keys = [user_key, TIME_KEY] + ([ITEM_KEY] if ITEM_KEY in df.columns else [])
    df = _sorted(df, keys)
    user = df[user_key].to_numpy()
    time = df[TIME_KEY].to_numpy()
    starts = np.ones(len(df), dtype=bool)
    starts[1:] = (user[1:] != user[:-1]) | (np.diff(time) > gap)
    df[SESSION_KEY] = np.cumsum(starts, dtype=np.int64) - 1
    return df


def drop_short_sessions(df: pd.DataFrame, min_length: int = 2) -> pd.DataFrame:
    """Drop the sessions with fewer than ``min_length`` events."""
    return df[_session_sizes(df) >= min_length]


def filter_support(
    df: pd.DataFrame, *, min_item_support: int = 5, min_session_length: int = 2
) -> pd.DataFrame:
    """Alternately drop short sessions and rare items until neither removes anything.

    One round drops sessions shorter than ``min_session_length``, then items with fewer than
    ``min_item_support`` events; dropping items can shorten sessions, hence the repetition.
    """
    while True:
        before = len(df)
        df = drop_short_sessions(df, min_session_length)
        df = df[_item_support(df) >= min_item_support]
        if len(df) == before:
            return df.reset_index(drop=True)


def time_split(
    df: pd.DataFrame, tsplit: float, tday: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split into (train, test) at ``boundary = tsplit - tday``, the third-party-comparison way.

    test: every event of the sessions whose first event is at or after the boundary.
    train: the events before the boundary, then sessions of length 1 dropped. A session crossing
    the boundary is therefore truncated in train and absent from test. Test is not restricted to
    training items (the evaluator skips unknown items).
    """
    boundary = tsplit - tday
    start = df.groupby(SESSION_KEY, sort=False)[TIME_KEY].transform("min").to_numpy()
    test = df[start >= boundary].reset_index(drop=True)
    train = drop_short_sessions(df[df[TIME_KEY].to_numpy() < boundary], 2)
    return train.reset_index(drop=True), test


def train_test_valid(df: pd.DataFrame, tsplit: float, tday: float) -> Splits:
    """The four splits: (train_full, test) at ``tsplit - tday``, then (train_tr, train_valid)
    from train_full at ``tsplit - 2 tday``, as the reference scripts do."""
    train_full, test = time_split(df, tsplit, tday)
    # Sessions kept in train_full start before tsplit - tday, so truncation leaves their first
    # event alone and splitting train_full equals the reference's use of the full-data starts.
    train_tr, train_valid = time_split(train_full, tsplit, 2 * tday)
    return _splits(train_full, test, train_tr, train_valid)


def third_party_pipeline(
    events: pd.DataFrame,
    *,
    tsplit: float | None,
    tday: float,
    min_item_support: int = 5,
) -> Splits:
    """The comparison scripts' shared tail: dedup, iterative filter, the four splits.

    ``tsplit`` None means the last event's time (after filtering), as the scripts use.
    """
    events = events[[SESSION_KEY, ITEM_KEY, TIME_KEY]]
    events = remove_consecutive_duplicates(events)
    events = filter_support(events, min_item_support=min_item_support)
    if events.empty:
        raise ValueError("no events are left after filtering; is the input too small?")
    if tsplit is None:
        tsplit = float(events[TIME_KEY].max())
    return train_test_valid(events, tsplit, tday)


def rsc15_filter(df: pd.DataFrame, *, min_item_support: int = 5) -> pd.DataFrame:
    """The original RSC15 filter, one pass: sessions > 1 event, items >= support, sessions >= 2."""
    df = drop_short_sessions(df, 2)
    df = df[_item_support(df) >= min_item_support]
    return drop_short_sessions(df, 2).reset_index(drop=True)


def rsc15_split(df: pd.DataFrame, tday: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The original RSC15 split into (train, test).

    test: whole sessions whose *last* event is at or after ``max(Time) - tday``, restricted to
    items seen in train and then to sessions of length >= 2. train: the other sessions, whole.
    """
    boundary = df[TIME_KEY].max() - tday
    end = df.groupby(SESSION_KEY, sort=False)[TIME_KEY].transform("max").to_numpy()
    train = df[end < boundary].reset_index(drop=True)
    test = df[end >= boundary]
    test = test[_isin_items(test[ITEM_KEY], train[ITEM_KEY])]
    return train, drop_short_sessions(test, 2).reset_index(drop=True)


def rsc15_train_test_valid(df: pd.DataFrame, tday: float) -> Splits:
    """The four RSC15 splits: the split on the data, then the same split of its train part
    (whose own last event sets the second boundary)."""
    train_full, test = rsc15_split(df, tday)
    train_tr, train_valid = rsc15_split(train_full, tday)
    return _splits(train_full, test, train_tr, train_valid)


def _splits(
    train_full: pd.DataFrame, test: pd.DataFrame, train_tr: pd.DataFrame, train_valid: pd.DataFrame
) -> Splits:
    return dict(train_full=train_full, test=test, train_tr=train_tr, train_valid=train_valid)


def _sorted(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    # Stable, so ties beyond ``keys`` keep the order the caller established.
    return df.sort_values(keys, kind="stable").reset_index(drop=True)


def _item_codes(items: pd.Series) -> np.ndarray:
    if isinstance(items.dtype, pd.CategoricalDtype):
        return items.cat.codes.to_numpy()
    return pd.factorize(items)[0]


def _per_event_count(codes: np.ndarray) -> np.ndarray:
    return np.bincount(codes)[codes] if len(codes) else np.zeros(0, dtype=np.int64)


def _session_sizes(df: pd.DataFrame) -> np.ndarray:
    """Per event, the number of events in its session."""
    return _per_event_count(pd.factorize(df[SESSION_KEY])[0])


def _item_support(df: pd.DataFrame) -> np.ndarray:
    """Per event, the number of events of its item."""
    return _per_event_count(_item_codes(df[ITEM_KEY]))


def _isin_items(items: pd.Series, known: pd.Series) -> np.ndarray:
    if (
        isinstance(items.dtype, pd.CategoricalDtype)
        and isinstance(known.dtype, pd.CategoricalDtype)
        and items.cat.categories.equals(known.cat.categories)
    ):
        seen = np.zeros(len(items.cat.categories), dtype=bool)
        seen[known.cat.codes.to_numpy()] = True
        return seen[items.cat.codes.to_numpy()]
    return items.isin(pd.unique(known.to_numpy())).to_numpy()


def views_after_sessionizing(
    events: pd.DataFrame, user_key: str, time_unit: str, params: dict
) -> Splits:
    """Cut sessions on *all* of each user's events, keep the views (``IsView``), then the shared
    pipeline: an add-to-cart or purchase between two views keeps their session open."""
    events = sessionize(events, user_key, time_unit=time_unit, gap_seconds=params["session_gap_seconds"])
    views = events[events["IsView"].to_numpy()]
    return third_party_pipeline(
        views,
        tsplit=params["tsplit"],
        tday=params["test_days"] * SECONDS_PER_DAY * unit_factor(time_unit),
        min_item_support=params["min_item_support"],
    )

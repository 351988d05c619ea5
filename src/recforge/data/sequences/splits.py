"""Users cut into training and evaluation rows, and the jagged batches built from them.

Protocols, for a user with events s_1..s_n in time order:

* ``loo`` (leave one out, three ways): test target s_n (history s_1..s_{n-1}); validation target
  s_{n-1} (history s_1..s_{n-2}); training on s_1..s_{n-2}: history s_1..s_{n-3}, target s_{n-2},
  every position supervised. Needs n >= 4 so that every split has a non-empty history.
* ``reference`` (the HSTU/SASRec code, spec §1.7): training history s_1..s_{n-2} with target
  s_{n-1}; test target s_n with history s_1..s_{n-1}; no validation. Needs n >= 3.

A row's history is truncated to its ``max_seq_len`` most recent events; nothing is padded.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from recforge.data.batches import HistoryBatch
from recforge.data.sequences.prepared import Histories

__all__ = [
    "EXCLUDE_POLICIES",
    "MIN_EVENTS",
    "PROTOCOLS",
    "HistoryRows",
    "RowDataset",
    "concat_ranges",
    "protocol_splits",
    "unique_per_row",
]

PROTOCOLS = ("loo", "reference")
EXCLUDE_POLICIES = ("history", "all_seen", "none")
# Events a user needs under each protocol: every split it is in gets a non-empty history.
MIN_EVENTS = {"loo": 4, "reference": 3}
# How many events from a user's end each split's target sits.
_TARGET_FROM_END = {
    "loo": {"train": 3, "val": 2, "test": 1},
    "reference": {"train": 2, "test": 1},
}


@dataclass(frozen=True)
class HistoryRows:
    """One split: row ``r`` is user ``users[r]``; its past is events ``[starts[r], targets[r])``
    and its target event ``targets[r]`` (indices into the flat :class:`Histories` arrays)."""

    users: np.ndarray
    starts: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.users)


def protocol_splits(histories: Histories, protocol: str) -> tuple[dict[str, HistoryRows], int]:
    """The splits of ``protocol`` and the number of users dropped for having too few events."""
    if protocol not in _TARGET_FROM_END:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    lengths = histories.lengths
    users = np.flatnonzero(lengths >= MIN_EVENTS[protocol])
    starts = histories.offsets[:-1][users]
    ends = histories.offsets[1:][users]
    splits = {
        name: HistoryRows(users, starts, ends - back)
        for name, back in _TARGET_FROM_END[protocol].items()
    }
    return splits, int(len(lengths) - len(users))


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def unique_per_row(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's distinct values, ascending: (values, offsets) of the deduplicated rows."""
    lengths = np.diff(offsets)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    order = np.lexsort((values, rows))
    v, r = values[order], rows[order]
    first = np.ones(len(v), dtype=bool)
    first[1:] = (v[1:] != v[:-1]) | (r[1:] != r[:-1])
    return v[first], _offsets(np.bincount(r[first], minlength=len(lengths)))


class RowDataset(Dataset):
    """A map-style dataset of one split's rows; :meth:`collate` builds the jagged batch.

    An item is just its row number, so fetching costs nothing per row and the batch is gathered
    in a few vectorised numpy operations. ``exclude`` (evaluation only) fills the batch's
    ``exclude_items``: ``history`` the truncated history the model sees, ``all_seen`` every item
    before the target, ``none`` (or None, for training) nothing.
    """

    def __init__(
        self,
        histories: Histories,
        rows: HistoryRows,
        max_seq_len: int,
        exclude: str | None = None,
    ) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if exclude not in (None, *EXCLUDE_POLICIES):
            raise ValueError(f"exclude must be one of {EXCLUDE_POLICIES}, got {exclude!r}")
        self.items = histories.items
        self.timestamps = histories.timestamps
        self.rows = rows
        self.max_seq_len = max_seq_len
        self.exclude = None if exclude == "none" else exclude

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> int:
        return int(index)

    def collate(self, indices: Sequence[int]) -> HistoryBatch:
        idx = np.asarray(indices, dtype=np.int64)
        starts, targets = self.rows.starts[idx], self.rows.targets[idx]
        first = np.maximum(starts, targets - self.max_seq_len)
        lengths = targets - first
        flat = concat_ranges(first, lengths)
        items = self.items[flat].astype(np.int64)
        exclude_items = exclude_offsets = None
        if self.exclude == "history":
            exclude_items, exclude_offsets = unique_per_row(items, _offsets(lengths))
        elif self.exclude == "all_seen":
            seen_lengths = targets - starts
            seen = self.items[concat_ranges(starts, seen_lengths)].astype(np.int64)
            exclude_items, exclude_offsets = unique_per_row(seen, _offsets(seen_lengths))
        return HistoryBatch(
            items=torch.from_numpy(items),
            timestamps=torch.from_numpy(self.timestamps[flat].astype(np.int64)),
            offsets=torch.from_numpy(_offsets(lengths)),
            targets=torch.from_numpy(self.items[targets].astype(np.int64)),
            target_timestamps=torch.from_numpy(self.timestamps[targets].astype(np.int64)),
            users=torch.from_numpy(self.rows.users[idx].astype(np.int64)),
            exclude_items=None if exclude_items is None else torch.from_numpy(exclude_items),
            exclude_offsets=None if exclude_offsets is None else torch.from_numpy(exclude_offsets),
        )

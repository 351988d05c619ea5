"""Session data as flat arrays plus offsets, with the item map built from the training data."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from recforge.data.sessions.parallel import session_order_by_start


@dataclass(frozen=True)
class ItemCatalog:
    """The items a model can score: ids in order of first appearance in training, and popularity.

    ``popularity[j]`` is the number of training events of item j (used for sampling and logq).
    """

    item_ids: np.ndarray
    popularity: np.ndarray

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    @classmethod
    def from_events(cls, item_ids: pd.Series) -> ItemCatalog:
        codes, uniques = pd.factorize(item_ids, sort=False)
        popularity = np.bincount(codes, minlength=len(uniques)).astype(np.int64)
        return cls(np.asarray(uniques, dtype=object), popularity)

    def index_of(self, item_ids: pd.Series) -> np.ndarray:
        """Item indices for ``item_ids``; -1 where an item is not in the catalogue."""
        lookup = pd.Index(self.item_ids)
        return lookup.get_indexer(item_ids)


@dataclass(frozen=True)
class SessionArrays:
    """Events of many sessions, contiguous per session.

    items ``[N]`` item indices, times ``[N]``, offsets ``[S+1]`` (session s is
    ``items[offsets[s]:offsets[s+1]]``), order ``[S]`` the visiting order (by first event's time).
    """

    items: np.ndarray
    times: np.ndarray
    offsets: np.ndarray
    order: np.ndarray

    @property
    def n_events(self) -> int:
        return len(self.items)

    @property
    def n_sessions(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_targets(self) -> int:
        """Number of (input, target) pairs: every event but the first of its session."""
        return self.n_events - self.n_sessions

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, catalog: ItemCatalog) -> SessionArrays:
        """Build from a frame sorted by (SessionId, Time).

        Events whose item is not in the catalogue are deleted and their sessions spliced together,
        as the reference evaluation does; sessions left empty disappear.
        """
        idx = catalog.index_of(frame["ItemId"])
        known = idx >= 0
        sessions = frame["SessionId"].to_numpy()[known]
        items = idx[known].astype(np.int64)
        times = frame["Time"].to_numpy(dtype=np.float64)[known]
        if len(sessions):
            starts = np.flatnonzero(np.r_[True, sessions[1:] != sessions[:-1]])
        else:
            starts = np.zeros(0, dtype=np.int64)
        offsets = np.r_[starts, len(items)].astype(np.int64)
        return cls(items, times, offsets, session_order_by_start(offsets, times))

    def partition(self, rank: int, world_size: int) -> np.ndarray:
        """The visiting order of one DDP rank: every world_size-th session, so ranks stay balanced."""
        return self.order[rank::world_size]

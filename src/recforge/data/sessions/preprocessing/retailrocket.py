"""RetailRocket ``events.csv`` (spec §1.9): views, sessions cut per visitor on *all* events.

A visitor's session ends after more than an hour without any event (view, addtocart or
transaction); only views are kept afterwards, as the comparison script does. Times in ms.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from recforge.data.sessions.io import ITEM_KEY, TIME_KEY
from recforge.data.sessions.preprocessing.raw import (
    Col,
    Table,
    concat_parts,
    iter_chunks,
    numeric_items,
)
from recforge.data.sessions.preprocessing.steps import (
    Splits,
    views_after_sessionizing,
)

RAW_FILES = ("events.csv",)
TIME_UNIT = "ms"
DEFAULTS: dict[str, Any] = {
    "test_days": 7.0,
    "tsplit": 1442545200000.0,
    "min_item_support": 5,
    "session_gap_seconds": 3600.0,
}

EVENTS = Table(
    description="RetailRocket events.csv",
    sep=",",
    has_header=True,
    cols=(
        Col("time", "int", ("timestamp",)),
        Col("user", "int", ("visitorid",)),
        Col("event", "text", ("event",)),
        Col("item", "int", ("itemid",)),
    ),
)


def read_events(path: Path, chunksize: int) -> pd.DataFrame:
    """All events: VisitorId, ItemId (ordered by numeric id), Time (ms), IsView."""
    parts = [
        pd.DataFrame(
            {
                "VisitorId": chunk["user"].to_numpy(),
                ITEM_KEY: chunk["item"].to_numpy(),
                TIME_KEY: chunk["time"].to_numpy().astype(np.float64),
                "IsView": (chunk["event"] == "view").to_numpy(dtype=bool),
            }
        )
        for chunk in iter_chunks(path, EVENTS, chunksize)
    ]
    df = concat_parts(parts, ["VisitorId", ITEM_KEY, TIME_KEY, "IsView"])
    df[ITEM_KEY] = numeric_items(df[ITEM_KEY].to_numpy())
    return df


def build(paths: Sequence[Path], params: dict[str, Any], chunksize: int) -> Splits:
    """The four splits from ``events.csv``."""
    return views_after_sessionizing(read_events(paths[0], chunksize), "VisitorId", TIME_UNIT, params)

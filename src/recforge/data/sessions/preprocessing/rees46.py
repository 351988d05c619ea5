"""REES46 multi-category store, monthly CSVs (spec §1.9): views, user + 1 h gap, times in s.

The split is at the fixed time 2019-12-01 00:00 UTC (the end of the November file).
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
    FirstSeenCodes,
    Table,
    categorical,
    concat_parts,
    iter_chunks,
)
from recforge.data.sessions.preprocessing.steps import (
    SECONDS_PER_DAY,
    Splits,
    sessionize,
    third_party_pipeline,
    unit_factor,
)

RAW_FILES = ("2019-Oct.csv", "2019-Nov.csv")
TIME_UNIT = "s"
DEFAULTS: dict[str, Any] = {
    "test_days": 1.0,
    "tsplit": 1575158400.0,
    "min_item_support": 5,
    "session_gap_seconds": 3600.0,
}

EVENTS = Table(
    description="REES46 monthly events",
    sep=",",
    has_header=True,
    cols=(
        Col(
            "time", "time", ("event_time",), time_format="%Y-%m-%d %H:%M:%S UTC",
            example="2019-10-01 00:00:00 UTC",
        ),
        Col("event", "text", ("event_type",)),
        Col("item", "text", ("product_id",)),
        Col("user", "int", ("user_id",)),
    ),
)


def read_views(paths: Sequence[Path], chunksize: int) -> pd.DataFrame:
    """Views of the monthly files, in the order given: UserId, ItemId, Time (s).

    Products are coded by first appearance over *all* events, as the script does, because that
    order breaks ties between a user's views with equal timestamps.
    """
    products = FirstSeenCodes()
    parts = []
    for path in paths:
        for chunk in iter_chunks(path, EVENTS, chunksize):
            codes = products.encode(chunk["item"])
            view = (chunk["event"] == "view").to_numpy(dtype=bool)
            seconds = chunk["time"].to_numpy()[view] // 1_000_000
            parts.append(
                pd.DataFrame(
                    {
                        "UserId": chunk["user"].to_numpy()[view],
                        ITEM_KEY: codes[view],
                        TIME_KEY: seconds.astype(np.float64),
                    }
                )
            )
    df = concat_parts(parts, ["UserId", ITEM_KEY, TIME_KEY])
    df[ITEM_KEY] = categorical(df[ITEM_KEY].to_numpy(), products.labels)
    return df


def build(paths: Sequence[Path], params: dict[str, Any], chunksize: int) -> Splits:
    """The four splits from the monthly files (chronological order)."""
    events = read_views(paths, chunksize)
    events = sessionize(
        events, "UserId", time_unit=TIME_UNIT, gap_seconds=params["session_gap_seconds"]
    )
    return third_party_pipeline(
        events,
        tsplit=params["tsplit"],
        tday=params["test_days"] * SECONDS_PER_DAY * unit_factor(TIME_UNIT),
        min_item_support=params["min_item_support"],
    )

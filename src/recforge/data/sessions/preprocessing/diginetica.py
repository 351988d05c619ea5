"""Diginetica ``train-item-views.csv`` (spec §1.9): given sessions, times in ms.

An event's time is its session's first ``eventdate`` (midnight UTC, in ms) plus its
``timeframe``, as the comparison script computes it.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from recforge.data.sessions.io import ITEM_KEY, SESSION_KEY, TIME_KEY
from recforge.data.sessions.preprocessing.raw import (
    Col,
    Table,
    concat_parts,
    iter_chunks,
    numeric_items,
)
from recforge.data.sessions.preprocessing.steps import (
    SECONDS_PER_DAY,
    Splits,
    third_party_pipeline,
    unit_factor,
)

RAW_FILES = ("train-item-views.csv",)
TIME_UNIT = "ms"
DEFAULTS: dict[str, Any] = {"test_days": 7.0, "tsplit": None, "min_item_support": 5}

VIEWS = Table(
    description="Diginetica train-item-views.csv",
    sep=";",
    has_header=True,
    cols=(
        Col("sid", "int", ("sessionId",)),
        Col("item", "int", ("itemId",)),
        Col("timeframe", "int", ("timeframe",)),
        Col("date", "time", ("eventdate",), time_format="%Y-%m-%d", example="2016-05-09"),
    ),
)


def read_views(path: Path, chunksize: int) -> pd.DataFrame:
    """Views: SessionId, ItemId (ordered by numeric id), Time (ms)."""
    parts = [
        pd.DataFrame(
            {
                SESSION_KEY: chunk["sid"].to_numpy(),
                ITEM_KEY: chunk["item"].to_numpy(),
                "DateMs": chunk["date"].to_numpy() // 1000,
                "Timeframe": chunk["timeframe"].to_numpy(),
            }
        )
        for chunk in iter_chunks(path, VIEWS, chunksize)
    ]
    df = concat_parts(parts, [SESSION_KEY, ITEM_KEY, "DateMs", "Timeframe"])
    # A session can span chunks (and midnight), so its first date is taken over the whole file.
    first_date = df.groupby(SESSION_KEY, sort=False)["DateMs"].transform("min").to_numpy()
    return pd.DataFrame(
        {
            SESSION_KEY: df[SESSION_KEY].to_numpy(dtype=np.int64),
            ITEM_KEY: numeric_items(df[ITEM_KEY].to_numpy()),
            TIME_KEY: (first_date + df["Timeframe"].to_numpy()).astype(np.float64),
        }
    )


def build(paths: Sequence[Path], params: dict[str, Any], chunksize: int) -> Splits:
    """The four splits from ``train-item-views.csv``."""
    return third_party_pipeline(
        read_views(paths[0], chunksize),
        tsplit=params["tsplit"],
        tday=params["test_days"] * SECONDS_PER_DAY * unit_factor(TIME_UNIT),
        min_item_support=params["min_item_support"],
    )

"""YooChoose clicks (RecSys Challenge 2015), the third-party-comparison way (spec §1.9).

Clicks and test ``.dat`` files are concatenated; sessions are given; times are floored to whole
seconds as that script does. Not comparable with :mod:`.rsc15`, the original GRU4Rec procedure.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from recforge.data.sessions.io import ITEM_KEY, SESSION_KEY, TIME_KEY
from recforge.data.sessions.preprocessing.raw import Col, Table, iter_chunks, numeric_items
from recforge.data.sessions.preprocessing.steps import (
    SECONDS_PER_DAY,
    Splits,
    third_party_pipeline,
    unit_factor,
)

RAW_FILES = ("yoochoose-clicks.dat", "yoochoose-test.dat")
TIME_UNIT = "s"
DEFAULTS: dict[str, Any] = {"test_days": 1.0, "tsplit": None, "min_item_support": 5}

CLICKS = Table(
    description="YooChoose clicks (SessionID,Timestamp,ItemID,Category; no header)",
    sep=",",
    has_header=False,
    cols=(
        Col("sid", "int", ("SessionID",), position=0),
        Col(
            "time", "time", ("Timestamp",), position=1, time_format="ISO8601",
            example="2014-04-07T10:51:09.277Z",
        ),
        Col("item", "int", ("ItemID",), position=2),
    ),
)


def read_clicks(paths: Sequence[Path], chunksize: int, *, whole_seconds: bool) -> pd.DataFrame:
    """YooChoose ``.dat`` files, concatenated in file order -> SessionId, ItemId, Time (s).

    ItemId is a categorical ordered by numeric id. ``whole_seconds`` floors the times (the
    comparison script); otherwise the milliseconds are kept (the original RSC15 script).
    """
    sids, times, items = [], [], []
    for path in paths:
        for chunk in iter_chunks(path, CLICKS, chunksize):
            micros = chunk["time"].to_numpy()
            seconds = micros // 1_000_000 if whole_seconds else micros / 1e6
            sids.append(chunk["sid"].to_numpy())
            times.append(seconds.astype(np.float64))
            items.append(chunk["item"].to_numpy())
    if not sids:
        sids, times, items = [np.zeros(0, np.int64)], [np.zeros(0)], [np.zeros(0, np.int64)]
    return pd.DataFrame(
        {
            SESSION_KEY: np.concatenate(sids).astype(np.int64),
            ITEM_KEY: numeric_items(np.concatenate(items)),
            TIME_KEY: np.concatenate(times),
        }
    )


def build(paths: Sequence[Path], params: dict[str, Any], chunksize: int) -> Splits:
    """The four splits from the clicks and test files."""
    events = read_clicks(paths, chunksize, whole_seconds=True)
    return third_party_pipeline(
        events,
        tsplit=params["tsplit"],
        tday=params["test_days"] * SECONDS_PER_DAY * unit_factor(TIME_UNIT),
        min_item_support=params["min_item_support"],
    )

"""Coveo browsing data (SIGIR eCom'21 challenge, spec §1.9): ``detail`` events, times in ms.

Sessions are the given session hashes, cut again after more than an hour idle; the gap is measured
on all events of the session before the details are kept, as the comparison script does. Item ids
are the product hashes.
"""
from __future__ import annotations

import logging
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
    Splits,
    views_after_sessionizing,
)

log = logging.getLogger(__name__)

RAW_FILES = ("browsing_train.csv",)
ALTERNATIVE_RAW_FILES = (("release_10_23_2020.csv",),)  # the file name the script used
TIME_UNIT = "ms"
DEFAULTS: dict[str, Any] = {
    "test_days": 1.0,
    "tsplit": None,
    "min_item_support": 5,
    "session_gap_seconds": 3600.0,
}

BROWSING = Table(
    description="Coveo browsing data",
    sep=",",
    has_header=True,
    cols=(
        Col("session", "text", ("session_id_hash",)),
        Col("action", "text", ("product_action",), nonempty=False),
        # The challenge release calls it product_sku_hash, the script's file product_skus_hash.
        Col("item", "text", ("product_sku_hash", "product_skus_hash"), nonempty=False),
        Col("time", "int", ("server_timestamp_epoch_ms",)),
    ),
)


def read_browsing(path: Path, chunksize: int) -> pd.DataFrame:
    """All events: SessionKey, ItemId, Time (ms), IsView (a detail event with a product).

    Session hashes and products are coded by first appearance, as the script does, so its
    tie-break between events with equal timestamps is reproduced.
    """
    sessions, products = FirstSeenCodes(), FirstSeenCodes()
    parts = []
    skipped = 0
    for chunk in iter_chunks(path, BROWSING, chunksize):
        is_detail = (chunk["action"] == "detail").to_numpy(dtype=bool)
        no_product = (chunk["item"] == "").to_numpy(dtype=bool)
        skipped += int((is_detail & no_product).sum())
        parts.append(
            pd.DataFrame(
                {
                    "SessionKey": sessions.encode(chunk["session"]),
                    ITEM_KEY: products.encode(chunk["item"]),
                    TIME_KEY: chunk["time"].to_numpy().astype(np.float64),
                    "IsView": is_detail & ~no_product,
                }
            )
        )
    if skipped:
        log.warning("%s: skipped %d detail events without a product hash", path, skipped)
    df = concat_parts(parts, ["SessionKey", ITEM_KEY, TIME_KEY, "IsView"])
    df[ITEM_KEY] = categorical(df[ITEM_KEY].to_numpy(), products.labels)
    return df


def build(paths: Sequence[Path], params: dict[str, Any], chunksize: int) -> Splits:
    """The four splits from the browsing file."""
    return views_after_sessionizing(read_browsing(paths[0], chunksize), "SessionKey", TIME_UNIT, params)

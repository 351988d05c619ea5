"""RSC15: the original GRU4Rec preprocessing of ``yoochoose-clicks.dat`` (spec §1.9).

No deduplication, one filtering pass, test = sessions whose last event is in the final day,
restricted to training items. Times keep their milliseconds (UTC; the original script used the
machine's local time, which it notes does not matter).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recforge.data.sessions.preprocessing.steps import (
    SECONDS_PER_DAY,
    Splits,
    rsc15_filter,
    rsc15_train_test_valid,
)
from recforge.data.sessions.preprocessing.yoochoose import read_clicks

RAW_FILES = ("yoochoose-clicks.dat",)
TIME_UNIT = "s"
DEFAULTS: dict[str, Any] = {"test_days": 1.0, "min_item_support": 5}


def build(paths: Sequence[Path], params: dict[str, Any], chunksize: int) -> Splits:
    """The four splits. Rows stay in raw file order: the trainer indexes items by first
    appearance in train_full, and the original script wrote its splits in that order."""
    events = read_clicks(paths, chunksize, whole_seconds=False)
    events = rsc15_filter(events, min_item_support=params["min_item_support"])
    if events.empty:
        raise ValueError("no events are left after filtering; is the input too small?")
    return rsc15_train_test_valid(events, params["test_days"] * SECONDS_PER_DAY)

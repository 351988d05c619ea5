"""How src/train.py and src/eval.py end: a user's mistake is one line, anything else a traceback."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from recforge.errors import UserInputError

T = TypeVar("T")


def one_line_errors(run: Callable[[], T]) -> T:
    """Run ``run``; a :class:`UserInputError` exits non-zero with one ``recforge:`` line.

    ``HYDRA_FULL_ERROR=1`` (Hydra's own switch for full tracebacks) shows its traceback instead.
    """
    try:
        return run()
    except UserInputError as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SystemExit(f"recforge: {error}") from None

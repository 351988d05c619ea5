"""Shared pytest fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The real data samples (``shared/data`` next to the repo, or ``$RECFORGE_SHARED_DATA``)."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    path = Path(os.environ.get("RECFORGE_SHARED_DATA", default))
    if not path.is_dir():
        pytest.skip(f"real data samples not found at {path} (set RECFORGE_SHARED_DATA)")
    return path

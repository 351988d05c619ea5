"""Raw files, plain or gzip-compressed: told apart by their first two bytes, never by their name
(a ``.gz`` file may have been decompressed in place, a compressed one renamed)."""
from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import IO

__all__ = ["GZIP_MAGIC", "describe_compression", "is_gzip", "open_decompressed"]

GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts with the gzip magic bytes."""
    with open(path, "rb") as handle:
        return handle.read(len(GZIP_MAGIC)) == GZIP_MAGIC


def open_decompressed(path: str | os.PathLike[str]) -> IO[bytes]:
    """The bytes of ``path``, decompressed when it is gzip."""
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def describe_compression(path: str | os.PathLike[str]) -> str:
    """``gzip-compressed text`` or ``text``: how read errors name what the file was taken for."""
    try:
        return "gzip-compressed text" if is_gzip(Path(path)) else "text"
    except OSError:
        return "text"

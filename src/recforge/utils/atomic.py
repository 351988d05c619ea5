"""Files that appear complete or not at all: write a temporary file beside the target, then rename."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def apply_umask(path: str | os.PathLike[str]) -> None:
    """Give ``path``, and everything under it when it is a directory, the mode a plain ``open`` or
    ``mkdir`` would: ``mkstemp`` and ``mkdtemp`` make them 0600 and 0700, which would hide results
    and shared caches from other users."""
    root = Path(path)
    for item in [root, *(root.rglob("*") if root.is_dir() else ())]:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~_UMASK)


@contextmanager
def atomic_output(path: str | os.PathLike[str], newline: str | None = None) -> Iterator[IO[str]]:
    """A text handle whose contents replace ``path`` only when the block exits without error.

    Parent directories are created. The temporary file sits in the target's directory, so the
    final ``os.replace`` is a rename on one filesystem; on any error it is removed and an existing
    ``path`` keeps its old contents. The result gets the umask's mode (:func:`apply_umask`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline=newline) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_output`)."""
    with atomic_output(path) as handle:
        handle.write(text)
    return Path(path)


def atomic_torch_save(obj: object, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` atomically: a temporary file beside ``path``, then a rename."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        torch.save(obj, tmp)
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

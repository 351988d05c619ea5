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


@contextmanager
def atomic_output(path: str | os.PathLike[str], newline: str | None = None) -> Iterator[IO[str]]:
    """A text handle whose contents replace ``path`` only when the block exits without error.

    Parent directories are created. The temporary file sits in the target's directory, so the
    final ``os.replace`` is a rename on one filesystem; on any error it is removed and an existing
    ``path`` keeps its old contents. The result gets the umask's mode (``mkstemp`` makes files
    0600, which would hide results and shared caches from other users).
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
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_output`)."""
    with atomic_output(path) as handle:
        handle.write(text)
    return Path(path)

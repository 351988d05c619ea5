"""Prepared directories: raw files turned into a directory keyed by inputs and parameters, built once.

A prepared directory is complete when its marker is there (``done.json``; Criteo's
``metadata.json``). The marker is written last and records what the directory was built from, so
a directory is reused while its marker matches the inputs (:func:`fingerprint`) and parameters of
the run at hand. Two ways to name one:

* a directory the user chose (``--out``, ``data.prepared_dir``), whose marker holds the inputs
  and parameters;
* ``cache_root/<cache_key(...)>``, where the key itself stands for them.

:func:`build_once` is the one way to (re)build either: concurrent callers (the ranks of a
distributed run) wait on a lock file beside the target and only the first builds; the files are
written by :class:`StagedDir` into a private sibling directory and moved over the target, the
marker last, so a crash or a failure never leaves a marker that vouches for unfinished files.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recforge.errors import UserInputError
from recforge.utils.atomic import apply_umask

__all__ = [
    "MARKER",
    "StagedDir",
    "as_json",
    "as_paths",
    "parameters",
    "build_once",
    "cache_key",
    "fingerprint",
    "read_marker",
    "why_not_current",
]

log = logging.getLogger(__name__)

MARKER = "done.json"

PathArg = str | os.PathLike[str]


def as_paths(value: PathArg | Sequence[PathArg] | None) -> list[Path]:
    """The raw input as a list of paths: one path, several, or none (None)."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [Path(value)]
    return [Path(v) for v in value]


def fingerprint(path: PathArg) -> dict[str, Any]:
    """What identifies the version of an input file: its absolute path, size and mtime."""
    path = Path(path)
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def as_json(value: Any) -> Any:
    """``value`` as it reads back from a marker (tuples become lists, keys strings), so that what a
    run computes compares equal to what an earlier run recorded."""
    return json.loads(json.dumps(value, sort_keys=True))


def parameters(what: str, defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with ``overrides`` applied, as a marker records them (:func:`as_json`); an
    override that names no default is a one-line error naming ``what`` takes which."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise UserInputError(f"{what}: unknown parameter(s) {unknown}; it accepts {sorted(defaults)}")
    return as_json({**defaults, **overrides})


def cache_key(identity: Any, length: int = 12) -> str:
    """The first ``length`` hex digits of the SHA-256 of ``identity`` as sorted-key JSON: any change
    to a value gives another key."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:length]


def read_marker(directory: PathArg, name: str = MARKER) -> dict[str, Any] | None:
    """The marker of a finished build in ``directory``; None when there is none (an unreadable one
    counts as none: the build did not finish)."""
    try:
        marker = json.loads((Path(directory) / name).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) else None


def why_not_current(
    directory: PathArg, expected: dict[str, Any], *, marker: str = MARKER, files: Iterable[str] = ()
) -> str | None:
    """Why ``directory`` cannot be reused: no marker, a marker entry that differs from ``expected``
    (or that an older layout did not record), or a missing file; None when it can."""
    directory = Path(directory)
    if not directory.exists():
        return "not prepared yet"
    found = read_marker(directory, marker)
    if found is None:
        return f"no readable {marker} (the build did not finish, or none was made here)"
    for key, value in expected.items():
        if key not in found:
            return f"its {marker} has no {key!r} entry (written by an older version)"
        if found[key] != value:
            return f"its {marker} records a different {key!r} than this run"
    for name in files:
        if not (directory / name).is_file():
            return f"{name} is missing"
    return None


def build_once(
    target: PathArg,
    build: Callable[[Path], Any],
    why_stale: Callable[[Path], str | None],
    *,
    force: bool = False,
) -> Path:
    """``target``, built by ``build(target)`` unless ``why_stale(target)`` is None (it is current).

    ``build`` writes through a :class:`StagedDir`. The check is repeated under a lock file beside
    the target, so of concurrent callers one builds and the others reuse its result. Reuse logs
    one line, and so does a rebuild of an existing directory, saying why. ``force`` rebuilds a
    current directory too.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise UserInputError(f"{target}: exists and is not a directory; expected a prepared "
                             "directory or a new name")
    if not force and why_stale(target) is None:
        log.info("%s is up to date", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        reason = "forced" if force else why_stale(target)
        if reason is None:  # another process built it while this one waited
            log.info("%s is up to date", target)
            return target
        for entry in target.parent.iterdir():
            if _is_staging_of(entry, target.name):  # left by a build that was killed
                shutil.rmtree(entry, ignore_errors=True)
        if target.exists():
            log.info("rebuilding %s: %s", target, reason)
        build(target)
    return target


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<name>.lock`` beside ``target``; the file is removed after.

    Removing it is safe because a waiter that gets the lock checks that the file it locked is
    still the one at that path (the holder before it may have removed it) and otherwise retries.
    """
    path = target.parent / f".{target.name}.lock"
    while True:
        handle = open(path, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        if _still_at(handle, path):
            break
        handle.close()
    _remove_stale_locks(target.parent, keep=path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()


def _remove_stale_locks(directory: Path, keep: Path) -> None:
    """Remove the lock files of other targets that no process holds: a build that was SIGKILLed
    cannot remove its own. One that is held, or that its holder is removing, is left alone."""
    for path in directory.glob(".*.lock"):
        if path == keep:
            continue
        try:
            handle = open(path, "a")
        except OSError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a build is running
            handle.close()
            continue
        if _still_at(handle, path):  # not removed (and made again) meanwhile: no one holds it
            path.unlink(missing_ok=True)
        handle.close()


def _still_at(handle, path: Path) -> bool:
    """Whether the locked file ``handle`` is still the one at ``path`` (a holder before us may
    have removed it, and another process made a new one there)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _is_staging_of(entry: Path, name: str) -> bool:
    """Whether ``entry`` is a :class:`StagedDir` of target ``name`` (``.<name>.<random>.tmp``)."""
    prefix, suffix = f".{name}.", ".tmp"
    middle = entry.name[len(prefix):-len(suffix)]
    return (entry.name.startswith(prefix) and entry.name.endswith(suffix) and bool(middle)
            and "." not in middle and entry.is_dir())


class StagedDir:
    """Files for ``target``, written into a private sibling directory and published over it.

    Entering removes the target's marker (its old files no longer count as finished) and creates
    ``path``, where the caller writes. :meth:`publish` writes the marker, moves every entry of
    ``path`` over its namesake in the target, the marker last, and gives them the umask's mode;
    a target that does not exist yet arrives in one rename. Other files in the target are left
    alone. Leaving the block without publishing (an error) removes ``path`` and everything in it.
    """

    def __init__(self, target: PathArg, marker: str = MARKER) -> None:
        self.target = Path(target)
        self.marker = marker
        self.path: Path | None = None
        self.published = False

    def __enter__(self) -> StagedDir:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        try:
            (self.target / self.marker).unlink(missing_ok=True)
        except NotADirectoryError:
            pass  # the rename in publish refuses it
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".tmp",
                                          dir=self.target.parent))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.published and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def publish(self, marker: dict[str, Any]) -> Path:
        """Write ``marker`` and move the staged files into the target; returns the target."""
        if self.path is None:
            raise RuntimeError("StagedDir.publish outside its with-block")
        (self.path / self.marker).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
        apply_umask(self.path)
        if self.target.is_dir() and any(self.target.iterdir()):
            for entry in sorted(self.path.iterdir()):
                if entry.name != self.marker:
                    self._move_over(entry, self.target / entry.name)
            os.replace(self.path / self.marker, self.target / self.marker)
            shutil.rmtree(self.path)
        else:
            os.replace(self.path, self.target)  # rename(2) also replaces an empty directory
        self.published = True
        return self.target

    def _move_over(self, entry: Path, destination: Path) -> None:
        if destination.is_dir() and not destination.is_symlink():
            # A directory is not replaced by a rename: the old one goes into the staging
            # directory, which is removed at the end.
            os.replace(destination, self.path / f".replaced-{destination.name}")
        os.replace(entry, destination)

"""The preparation toolkit (recforge.data.prepared_dir, recforge.data.compressed): fingerprints and
keys against hand-made values, the marker protocol, building once under a lock, and what a failed
build leaves (nothing)."""
from __future__ import annotations

import gzip
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from recforge.data.compressed import describe_compression, is_gzip, open_decompressed
from recforge.data.prepared_dir import (
    MARKER,
    StagedDir,
    as_json,
    build_once,
    cache_key,
    fingerprint,
    read_marker,
    why_not_current,
)
from recforge.errors import UserInputError

IDENTITY = {"params": {"k": 1}}


def current(directory: Path) -> str | None:
    return why_not_current(directory, IDENTITY, files=("data.txt",))


class Builder:
    """Writes ``data.txt`` holding ``text`` and a marker with IDENTITY; counts its calls."""

    def __init__(self, text: str = "new", fail_after_data: bool = False, seconds: float = 0.0):
        self.text = text
        self.fail_after_data = fail_after_data
        self.seconds = seconds
        self.calls = 0

    def __call__(self, target: Path) -> None:
        self.calls += 1
        with StagedDir(target) as staged:
            (staged.path / "data.txt").write_text(self.text)
            (staged.path / "parts").mkdir()
            (staged.path / "parts" / "p0").write_text(self.text)
            time.sleep(self.seconds)
            if self.fail_after_data:
                raise OSError("No space left on device")
            staged.publish(IDENTITY)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------------------- values
def test_fingerprint_is_absolute_path_size_and_mtime(tmp_path, monkeypatch):
    path = tmp_path / "raw.txt"
    path.write_bytes(b"12345\n")
    os.utime(path, ns=(1_000_000_007, 1_700_000_000_123_456_789))
    monkeypatch.chdir(tmp_path)
    assert fingerprint("raw.txt") == {
        "path": str(tmp_path.resolve() / "raw.txt"), "size": 6, "mtime_ns": 1_700_000_000_123_456_789}


def test_cache_keys_are_the_ones_earlier_versions_gave():
    # sha256 of '{"a": 1, "b": [2, 3]}' (sorted keys, json's default separators), by hand:
    # printf '{"a": 1, "b": [2, 3]}' | sha256sum
    assert cache_key({"b": [2, 3], "a": 1}) == "fd28b17488e0"
    assert cache_key({"b": [2, 3], "a": 1}, 16) == "fd28b17488e0d3ec"
    assert cache_key({"a": 1, "b": [2, 3]}) != cache_key({"a": 1, "b": [3, 2]})
    # The synthetic caches keep their directory names (values from before the toolkit).
    from recforge.data.criteo.synthetic import SyntheticCriteoConfig, synthetic_criteo_key
    from recforge.data.sequences.synthetic import SyntheticHistoriesConfig
    from recforge.data.sessions.synthetic import SyntheticSessionsConfig

    assert SyntheticSessionsConfig().cache_key() == "d42b5db32567"
    assert SyntheticHistoriesConfig().cache_key() == "929b0d9bdbd9"
    assert synthetic_criteo_key(SyntheticCriteoConfig()) == "6d7fd82fc702"
    assert synthetic_criteo_key(SyntheticCriteoConfig(n_rows=3000), (0.8, 0.1, 0.1)) == "0dc57329b005"


def test_as_json_is_what_a_marker_reads_back():
    assert as_json({"t": (1, 2), "n": {3: None}}) == {"t": [1, 2], "n": {"3": None}}


def test_read_marker_counts_an_unreadable_marker_as_none(tmp_path):
    assert read_marker(tmp_path / "absent") is None
    (tmp_path / MARKER).write_text('{"half": ')
    assert read_marker(tmp_path) is None
    (tmp_path / MARKER).write_text("[1, 2]")
    assert read_marker(tmp_path) is None
    (tmp_path / MARKER).write_text('{"a": 1}')
    assert read_marker(tmp_path) == {"a": 1}
    assert read_marker(tmp_path / MARKER) is None  # a file is no directory


def test_why_not_current_names_the_reason(tmp_path):
    assert current(tmp_path / "nope") == "not prepared yet"
    assert "no readable done.json" in current(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"other": 1}))
    assert current(tmp_path) == "its done.json has no 'params' entry (written by an older version)"
    (tmp_path / MARKER).write_text(json.dumps({"params": {"k": 2}}))
    assert current(tmp_path) == "its done.json records a different 'params' than this run"
    (tmp_path / MARKER).write_text(json.dumps({"params": {"k": 1}}))
    assert current(tmp_path) == "data.txt is missing"
    (tmp_path / "data.txt").write_text("x")
    assert current(tmp_path) is None


# ---------------------------------------------------------------------------- building
def test_built_once_then_reused_then_rebuilt_with_one_line(tmp_path, caplog):
    target = tmp_path / "prepared"
    builder = Builder()
    assert build_once(target, builder, current) == target
    assert builder.calls == 1 and read_marker(target) == IDENTITY
    assert (target / "data.txt").read_text() == "new" and (target / "parts" / "p0").read_text() == "new"
    assert names(tmp_path) == ["prepared"]  # no staging directory, no lock file
    build_once(target, builder, current)
    assert builder.calls == 1
    (target / MARKER).write_text(json.dumps({"params": {"k": 0}}))  # as an older run left it
    (target / "notes.txt").write_text("mine")
    with caplog.at_level(logging.INFO, logger="recforge.data.prepared_dir"):
        build_once(target, Builder("newer"), current)
    lines = [r.getMessage() for r in caplog.records if r.name == "recforge.data.prepared_dir"]
    assert lines == [f"rebuilding {target}: its done.json records a different 'params' than this run"]
    assert (target / "parts" / "p0").read_text() == "newer" and read_marker(target) == IDENTITY
    assert (target / "notes.txt").read_text() == "mine"  # files of others are left alone
    assert names(tmp_path) == ["prepared"]
    build_once(target, builder, current, force=True)
    assert builder.calls == 2


def test_a_build_that_fails_leaves_no_directory_marker_or_lock(tmp_path):
    target = tmp_path / "prepared"
    with pytest.raises(OSError, match="No space left"):
        build_once(target, Builder(fail_after_data=True), current)
    assert names(tmp_path) == []
    build_once(target, Builder("old"), current)
    # A failed rebuild of an existing directory takes its marker away: the old files no longer
    # count as finished; they are not mixed with half of the new ones either.
    with pytest.raises(OSError, match="No space left"):
        build_once(target, Builder(fail_after_data=True), current, force=True)
    assert read_marker(target) is None and (target / "data.txt").read_text() == "old"
    assert names(tmp_path) == ["prepared"]
    assert build_once(target, Builder("again"), current) == target
    assert (target / "data.txt").read_text() == "again"


def test_the_staging_directory_of_a_killed_build_is_removed(tmp_path):
    target = tmp_path / "abc"
    killed = tmp_path / ".abc.k1ll3d_x.tmp"
    killed.mkdir()
    (killed / "data.txt").write_text("half")
    other = tmp_path / ".abc.d.e.tmp"  # the staging directory of a target named "abc.d"
    other.mkdir()
    build_once(target, Builder(), current)
    assert not killed.exists() and other.exists()


def test_the_lock_files_a_killed_build_left_are_removed_unless_held(tmp_path):
    import fcntl
    import signal
    import sys

    from processes import run_child

    # a build SIGKILLed while it held its lock: the kernel releases the lock, the file stays
    code = ("import fcntl, os, signal, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    killed = tmp_path / ".criteo_a.lock"
    done = run_child([sys.executable, "-c", code, str(killed)], timeout=60)
    assert done.returncode == -signal.SIGKILL and killed.exists()
    held = tmp_path / ".criteo_b.lock"  # another build, running
    holder = open(held, "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        build_once(tmp_path / "criteo_c", Builder(), current)
        assert not killed.exists() and held.exists()
        assert names(tmp_path) == [".criteo_b.lock", "criteo_c"]
    finally:
        holder.close()


def test_published_files_take_the_umask_mode(tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    build_once(tmp_path / "p", Builder(), current)
    assert stat.S_IMODE((tmp_path / "p").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "p" / "parts").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "p" / "data.txt").stat().st_mode) == 0o666 & ~mask


def test_a_file_in_the_way_is_a_one_line_error(tmp_path):
    (tmp_path / "p").write_text("not a directory")
    with pytest.raises(UserInputError, match=r"p: exists and is not a directory"):
        build_once(tmp_path / "p", Builder(), current)


def test_concurrent_callers_build_once(tmp_path):
    target = tmp_path / "prepared"
    builder = Builder(seconds=0.3)
    start = threading.Barrier(4)
    errors = []

    def call() -> None:
        try:
            start.wait()
            build_once(target, builder, current)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and builder.calls == 1
    assert read_marker(target) == IDENTITY and names(tmp_path) == ["prepared"]


# ---------------------------------------------------------------------------- gzip
def test_gzip_is_told_by_its_magic_bytes(tmp_path):
    text = b"a\tb\n1\t2\n"
    packed = tmp_path / "packed.txt"  # gzip without the name
    packed.write_bytes(gzip.compress(text))
    plain = tmp_path / "plain.txt.gz"  # the name without gzip
    plain.write_bytes(text)
    assert is_gzip(packed) and not is_gzip(plain)
    for path in (packed, plain):
        with open_decompressed(path) as handle:
            assert handle.read() == text
    assert describe_compression(packed) == "gzip-compressed text"
    assert describe_compression(plain) == "text"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert not is_gzip(empty)


def test_as_paths_takes_one_path_several_or_none(tmp_path):
    from recforge.data.prepared_dir import as_paths

    assert as_paths(None) == []
    assert as_paths(str(tmp_path)) == [tmp_path]
    assert as_paths(tmp_path / "a") == [tmp_path / "a"]
    assert as_paths(["a", tmp_path / "b"]) == [Path("a"), tmp_path / "b"]


def test_parameters_override_defaults_and_refuse_unknown_names():
    from recforge.data.prepared_dir import parameters

    assert parameters("ml-1m", {"k": 0, "cols": ("a", "b")}, {"k": 5}) == {"k": 5, "cols": ["a", "b"]}
    with pytest.raises(UserInputError, match=r"^ml-1m: unknown parameter\(s\) \['kk'\]; it accepts \['cols', 'k'\]$"):
        parameters("ml-1m", {"k": 0, "cols": ()}, {"kk": 1})

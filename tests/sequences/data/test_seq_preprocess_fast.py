"""The fast (Arrow) ratings reader of recforge.data.sequences.preprocess against its slow twin.

Oracles: the validating pandas reader (``read_ratings_validating``, the reader the fast one
replaces), whose prepared files the fast path must reproduce byte for byte; the naive pure-Python
reference of test_seq_preprocess; for a killed or failing run, what is on disk afterwards and a
clean run of the same input.
"""
from __future__ import annotations

import errno
import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sequences.data.test_seq_preprocess import files_content, naive, write

import recforge.data.sequences.prepared as prepared_module
import recforge.data.sequences.preprocess as pp
from recforge.data.sequences.prepared import (
    MARKER_FILE,
    PreparedDataError,
    load_prepared,
    read_marker,
)
from recforge.data.sequences.preprocess import RatingsDataError, main, prepare

# Ids that sort one way as text and another as numbers ("10" < "9"), non-ASCII ones (code point
# order), ids pandas would read as missing by default ("NA", "null"), quoted ids holding the
# separator or a doubled quote, inner spaces and a bare quote inside a field; equal timestamps
# (file order must hold), blank lines and CRLF ends.
BOOKS_TRICKY = [
    "9,0001713353,5.0,100",
    "10,B00005N7P0,4.0,100",
    '"A,1",0001713353,3.0,50',
    "NA,null,2.0,70",
    "",
    "\u00e9l\u00e8ve,0001713353,1.0,100",
    "zed,B00005N7P0,5.0,100",
    "9,10,4.5,100",
    "9,9,4.0,99",
    '"x""y",0001713353,2.5,100',
    "A 1,B00005N7P0,1.5,1",
    'q"r,9,3.5,100',
    "10,9,5.0,100",
    "",
    "NA,10,4.0,70",
]
ML20M_TRICKY = [
    "userId,movieId,rating,timestamp",
    "10,9,4.0,100", "9,10,3.5,100", "10,100,5.0,100", "9,9,1.0,50", "", "2,9,0.5,100",
    "10,9,2.0,100", "100,2,4.0,7", "9,100,3.0,100",
]


def _rows(lines: list[str]) -> list[tuple[str, str, str, str]]:
    """The rows of ``lines`` as the csv module reads them (blank lines skipped)."""
    import csv

    return [tuple(r) for r in csv.reader(lines) if r]


def _prepared_bytes(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("histories.parquet", "items.parquet")}


def _both_ways(monkeypatch, tmp_path, dataset, raw, block_bytes=64, **kwargs):
    """Prepare ``raw`` through the fast reader (cut in blocks of ``block_bytes``) and through the
    validating reader alone; returns both output directories."""
    monkeypatch.setattr(pp, "_BLOCK_BYTES", block_bytes)
    real_slow = pp.read_ratings_validating

    def must_not_run(*args, **kw):
        raise AssertionError("the fast reader fell back to the validating one")

    monkeypatch.setattr(pp, "read_ratings_validating", must_not_run)
    fast = prepare(dataset, raw, tmp_path / "fast", **kwargs)
    monkeypatch.setattr(pp, "read_ratings_validating", real_slow)
    monkeypatch.setattr(pp, "fast_readable", lambda table: False)
    slow = prepare(dataset, raw, tmp_path / "slow", **kwargs)
    monkeypatch.undo()
    return fast, slow


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("k", [0, 2])
def test_books_fast_equals_validating_and_naive(tmp_path, monkeypatch, newline, k):
    raw = write(tmp_path / "ratings_Books.csv", BOOKS_TRICKY, newline=newline)
    fast, slow = _both_ways(monkeypatch, tmp_path, "amzn-books", raw, min_interactions=k)
    assert _prepared_bytes(fast) == _prepared_bytes(slow)
    assert files_content(fast) == naive(_rows(BOOKS_TRICKY), numeric=False, k=k)
    if k == 0:
        users = files_content(fast)["users"]
        assert users[:3] == ["10", "9", "A 1"] and "NA" in users and 'x"y' in users


def test_ml20m_fast_equals_validating_and_naive(tmp_path, monkeypatch):
    raw = write(tmp_path / "ratings.csv", ML20M_TRICKY)
    movies = write(tmp_path / "movies.csv", ["\ufeffmovieId,title,genres", "9,A,X", "1000,B,Y", "2,C,Z"])
    fast, slow = _both_ways(monkeypatch, tmp_path, "ml-20m", [raw, movies])
    assert _prepared_bytes(fast) == _prepared_bytes(slow)
    rows = _rows(ML20M_TRICKY[1:])
    assert files_content(fast) == naive(rows, numeric=True, extra_items=["9", "1000", "2"])
    assert files_content(fast)["item_ids"] == ["2", "9", "10", "100", "1000"]  # numeric order


def test_ml1m_gzip_and_byte_order_mark_fast_equals_validating(tmp_path, monkeypatch):
    lines = ["\ufeff1::10::5::978300760", "2::9::3::978300760", "1::9::4::978300760", "",
             "10::100::2::5"]
    raw = write(tmp_path / "ratings.dat.gz", lines)
    fast, slow = _both_ways(monkeypatch, tmp_path, "ml-1m", raw, block_bytes=32)
    assert _prepared_bytes(fast) == _prepared_bytes(slow)
    assert files_content(fast)["users"] == ["1", "2", "10"]


def test_many_blocks_of_a_generated_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    n = 5_000
    users = rng.integers(0, 300, n)
    items = rng.zipf(1.5, n) % 700
    stamps = rng.integers(0, 50, n)  # many equal times per user
    lines = [f"U{u:04d}{'x' * (u % 3)},{i:010d},{r:.1f},{t}"
             for u, i, r, t in zip(users, items, rng.integers(1, 11, n) / 2, stamps)]
    raw = write(tmp_path / "ratings_Books.csv", lines)
    fast, slow = _both_ways(monkeypatch, tmp_path, "amzn-books", raw, block_bytes=1 << 12)
    assert _prepared_bytes(fast) == _prepared_bytes(slow)
    assert files_content(fast) == naive(_rows(lines), numeric=False, k=5)


# ---------------------------------------------------------------------------- the fallback
FAST_READER_REFUSES = [
    # (dataset, file name, lines): good files that only the validating reader takes
    ("ml-20m", "ratings.csv", ["userId,movieId,rating,timestamp", "1,2,3.5,+4", "1,3,3.5,5"]),
    ("amzn-books", "ratings_Books.csv", ["A1,B1,5.0,100", "A2,B1,4.0,100,an extra field"]),
    ("amzn-books", "ratings_Books.csv", ["A1,B1,5.0,100"]),  # one line, no final newline
]


@pytest.mark.parametrize("dataset,name,lines", FAST_READER_REFUSES)
def test_a_file_the_fast_reader_refuses_is_read_by_the_validating_one(tmp_path, monkeypatch, caplog,
                                                                       dataset, name, lines):
    raw = tmp_path / name
    raw.write_text("\n".join(lines))  # no final newline
    with caplog.at_level("INFO", logger="recforge.data.sequences.preprocess"):
        out = prepare(dataset, raw, tmp_path / "out", **({"min_interactions": 0}
                                                          if dataset == "amzn-books" else {}))
    assert "read by the slower validating reader (the Arrow reader refused it: " in caplog.text
    monkeypatch.setattr(pp, "fast_readable", lambda table: False)
    slow = prepare(dataset, raw, tmp_path / "slow", **({"min_interactions": 0}
                                                        if dataset == "amzn-books" else {}))
    assert _prepared_bytes(out) == _prepared_bytes(slow)


@pytest.mark.parametrize("line,expected", [
    ("A9,B1,4.0,", ("column 4 (timestamp): expected an integer timestamp (Unix seconds), got an "
                    "empty or missing field")),
    ("A9,B1,4.0,-5", "column 4 (timestamp): expected an integer timestamp (Unix seconds) >= 0, got -5"),
    ("A9,B1,nan,5", "column 3 (rating): expected a rating (a finite number), got 'nan'"),
    ("A9,,4.0,5", "column 2 (item): expected a non-empty item id, got an empty or missing field"),
    ("A9,B1,4.0,5.5", "column 4 (timestamp): expected an integer timestamp (Unix seconds), got '5.5'"),
])
def test_a_bad_value_in_a_late_block_is_named_by_line(tmp_path, monkeypatch, line, expected):
    monkeypatch.setattr(pp, "_BLOCK_BYTES", 256)
    good = [f"A{i % 7},B{i % 5},4.0,{i}" for i in range(300)]
    raw = write(tmp_path / "ratings_Books.csv", good[:250] + [line] + good[250:])
    with pytest.raises(RatingsDataError) as info:
        prepare("amzn-books", raw, tmp_path / "out")
    assert str(info.value) == f"{raw}, line 251, {expected}"
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- killed, disk full
_PAUSED_RUN = """
import sys, time
from pathlib import Path
import recforge.data.sequences.prepared as prepared
from recforge.data.sequences.preprocess import main

real = prepared.pq.write_table

def pause_in_items(table, where, **kwargs):
    # histories.parquet is complete, items.parquet half there: then wait to be killed
    if str(where).endswith("items.parquet"):
        Path(where).write_bytes(b"PAR1 half")
        Path(sys.argv[1]).touch()
        time.sleep(120)
    return real(table, where, **kwargs)

prepared.pq.write_table = pause_in_items
main(sys.argv[2:])
"""


def _staging(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.endswith(".tmp")]


def _kill_while_writing(tmp_path: Path, raw: Path, out: Path, *extra: str) -> None:
    """Run the real command in a subprocess, stopped halfway through writing, and SIGKILL it."""
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-c", _PAUSED_RUN, str(ready), "ml-20m", "--raw", str(raw),
               "--out", str(out), *extra]
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before it could be killed: {proc.stderr.read()!r}")
        assert time.monotonic() < deadline, "the run never reached the writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _ml20m(tmp_path: Path, n: int = 2_000) -> Path:
    lines = ["userId,movieId,rating,timestamp"] + [f"{i % 37},{i % 101},{(i % 10 + 1) / 2},{i}"
                                                   for i in range(n)]
    return write(tmp_path / "ratings.csv", lines)


def test_a_run_killed_while_writing_leaves_nothing_taken_for_prepared_data(tmp_path):
    raw = _ml20m(tmp_path)
    out = tmp_path / "prepared"
    _kill_while_writing(tmp_path, raw, out)
    staged = _staging(tmp_path)
    assert len(staged) == 1 and (staged[0] / "histories.parquet").is_file(), "nothing was interrupted"
    assert not out.exists()
    with pytest.raises(PreparedDataError):
        load_prepared(out)
    prepare("ml-20m", raw, out)  # the next run starts over
    assert _staging(tmp_path) == [] and not (tmp_path / ".prepared.lock").exists()
    clean = prepare("ml-20m", raw, tmp_path / "clean")
    assert _prepared_bytes(out) == _prepared_bytes(clean)


def test_a_rebuild_killed_while_writing_takes_the_old_marker_away(tmp_path):
    raw = _ml20m(tmp_path)
    out = prepare("ml-20m", raw, tmp_path / "prepared")
    old = _prepared_bytes(out)
    _kill_while_writing(tmp_path, raw, out, "--force")
    assert read_marker(out) is None and _prepared_bytes(out) == old  # old files, no marker
    with pytest.raises(PreparedDataError, match="has no done.json"):
        load_prepared(out)
    prepare("ml-20m", raw, out)  # not current any more: redone without --force
    assert read_marker(out) is not None and _staging(tmp_path) == []
    assert _prepared_bytes(out) == old


@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_is_one_line_naming_the_directory(tmp_path, monkeypatch, existing):
    raw = _ml20m(tmp_path)
    out = tmp_path / "prepared"
    if existing:
        prepare("ml-20m", raw, out)
    real = prepared_module.pq.write_table

    def full_at_items(table, where, **kwargs):
        if str(where).endswith("items.parquet"):
            Path(where).write_bytes(b"PAR1 half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(table, where, **kwargs)

    monkeypatch.setattr(prepared_module.pq, "write_table", full_at_items)
    with pytest.raises(SystemExit) as caught:
        main(["ml-20m", "--raw", str(raw), "--out", str(out), "--force"])
    assert str(caught.value) == (f"recforge: {out}: writing the prepared histories failed (the disk "
                                 "is full); nothing there counts as prepared data")
    assert _staging(tmp_path) == []
    if existing:
        assert read_marker(out) is None and not (out / MARKER_FILE).exists()
    else:
        assert not out.exists()
    monkeypatch.undo()
    assert read_marker(prepare("ml-20m", raw, out)) is not None


def test_the_prepared_files_of_the_fast_reader_are_readable(tmp_path):
    raw = write(tmp_path / "ratings_Books.csv.gz", BOOKS_TRICKY)
    with gzip.open(raw, "rb") as handle:
        assert handle.read(4) == b"9,00"
    out = prepare("amzn-books", raw, tmp_path / "out", min_interactions=0)
    table = pq.read_table(out / "histories.parquet")
    assert table.num_rows == len(load_prepared(out).users)


def test_the_ratings_file_is_judged_before_the_movies_file(tmp_path):
    ratings = write(tmp_path / "ratings.csv", ["userId,movieId,rating,timestamp", "1,2,3.5,4", "1,x,3.5,5"])
    movies = write(tmp_path / "movies.csv", ["movieId,title,genres", "two,A,X"])
    with pytest.raises(RatingsDataError, match=r"ratings\.csv, line 3, column 2 \(movieId\)"):
        prepare("ml-20m", [ratings, movies], tmp_path / "out")
    write(ratings, ["userId,movieId,rating,timestamp", "1,2,3.5,4", "1,3,3.5,5"])
    with pytest.raises(RatingsDataError, match=r"movies\.csv, line 2, column 1 \(movieId\)"):
        prepare("ml-20m", [ratings, movies], tmp_path / "out")

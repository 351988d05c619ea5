"""The vocab conversion that parses the text once and keeps the parsed rows on disk (``spill``).

Oracles: the conversion that parses the text twice (``spill=False``, the path before the spill),
whose parts must be the same bytes and whose metadata the same but for the clock; a naive
per-line reading (``str.split``, a dict vocabulary) of the same file, whose indices the parts must
hold; and what is on disk after a run that fails or is killed (no spill directory left after the
next run, nothing the reader takes for prepared data).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recforge.data.criteo import spill as spill_module
from recforge.data.criteo.fullsize import GENERATORS
from recforge.data.criteo.prepare import main, prepare_criteo
from recforge.data.criteo.prepared import (
    SPARSE_COLUMNS,
    PreparedDataError,
    read_metadata,
)
from recforge.data.criteo.raw import TSV, explain
from recforge.data.criteo.splits import kaggle7_part_sizes
from recforge.data.criteo.transform import VocabEncoder
from recforge.errors import UserInputError

MALFORMED = [b"", b"not a criteo row", b"1" + b"\tzz" * 39, b"2" + b"\t" * 39]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """2,292 generated Kaggle rows (empty fields among them) with malformed lines in the train,
    test and valid parts, the last line without its line break."""
    root = tmp_path_factory.mktemp("raw")
    GENERATORS["criteo-kaggle"](root, 5e-5, 3)
    lines = (root / "train.txt").read_bytes().split(b"\n")[:-1]
    for at in (2290, 2100, 700, 5):  # from the end, so that the positions hold
        lines[at:at] = MALFORMED
    path = root / "dirty.txt"
    path.write_bytes(b"\n".join(lines))
    return path


def _parts(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.parquet"))}


def _metadata(directory: Path) -> dict:
    meta = json.loads((directory / "metadata.json").read_text())
    meta["conversion"].pop("elapsed_seconds")
    return meta


def _staging(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("split,min_frequency,workers", [
    ("kaggle7", 1, 0), ("kaggle7", 2, 0), ("random_7_2_1", 2, 0), ("random_8_1_1", 1, 1),
])
def test_keeping_the_parsed_rows_gives_the_bytes_of_parsing_twice(raw, tmp_path, split, min_frequency, workers):
    settings = dict(categorical="vocab", split=split, min_frequency=min_frequency, chunk_rows=97,
                    max_malformed_fraction=0.01, workers=workers)
    kept = prepare_criteo(raw, tmp_path / "kept", spill=True, **settings)
    twice = prepare_criteo(raw, tmp_path / "twice", spill=False, **settings)
    parts = _parts(kept)
    assert len(parts) == 3 and parts == _parts(twice)
    assert _metadata(kept) == _metadata(twice)
    meta = _metadata(kept)
    assert meta["malformed"]["count"] == 4 * len(MALFORMED) and meta["malformed"]["lines_read"] == 2292 + 16
    assert _staging(tmp_path) == []  # the spill went with the conversion


def _naive_kaggle7(raw: Path, min_frequency: int) -> dict[str, np.ndarray]:
    """Per split, the [rows, 26] indices read line by line: the vocabulary a dict of the training
    rows' values seen ``min_frequency`` times, 0 missing, 1 out of vocabulary, 2.. in value order."""
    lines = raw.read_bytes().split(b"\n")
    parts = kaggle7_part_sizes(len(lines))
    train_end = sum(parts[:6])
    test_end = train_end + (parts[6] + 1) // 2
    rows: dict[str, list[list[str]]] = {"train": [], "test": [], "valid": []}
    for at, line in enumerate(lines):
        if explain(line, TSV) == "":
            split = "train" if at < train_end else "test" if at < test_end else "valid"
            rows[split].append(line.decode().split("\t")[14:])
    counts = [Counter(int(row[j], 16) for row in rows["train"] if row[j]) for j in range(26)]
    index = [{value: 2 + k for k, value in enumerate(sorted(v for v, n in c.items() if n >= min_frequency))}
             for c in counts]
    return {split: np.array([[index[j].get(int(v, 16), 1) if v else 0 for j, v in enumerate(row)]
                             for row in found], dtype=np.int64).reshape(-1, 26)
            for split, found in rows.items()}


def test_kept_rows_hold_the_indices_of_a_naive_line_by_line_reading(raw, tmp_path):
    out = prepare_criteo(raw, tmp_path / "kept", categorical="vocab", min_frequency=2, chunk_rows=97,
                         max_malformed_fraction=0.01)
    expected = _naive_kaggle7(raw, 2)
    for split, want in expected.items():
        table = pq.read_table(out / split, columns=list(SPARSE_COLUMNS))
        got = np.column_stack([table[c].to_numpy() for c in SPARSE_COLUMNS])
        assert len(want) > 100 and np.array_equal(got, want), split
    assert (expected["train"] == 1).any() and (expected["valid"] == 1).any() and (expected["train"] == 0).any()


@pytest.mark.parametrize("kept_values", [0, 3, 1023, 1024, 5000])
def test_vocabulary_lookup_against_a_dict(kept_values):
    # both sides of the size from which the lookup sorts the values first
    rng = np.random.default_rng(kept_values)
    keys = np.unique(rng.integers(0, 2**32, size=kept_values, dtype=np.uint64).astype(np.uint32))
    kept = [keys] * 26
    encoder = VocabEncoder(kept, 1, [len(keys)] * 26, 0)
    n = 4000
    present = keys[rng.integers(0, max(len(keys), 1), size=(n, 26))] if len(keys) else np.zeros((n, 26), np.uint32)
    values = np.where(rng.random((n, 26)) < 0.5, present, rng.integers(0, 2**32, size=(n, 26), dtype=np.uint64))
    values[:4] = np.array([[0], [2**32 - 1], [1], [2**31]])  # the ends of the range
    missing = rng.random((n, 26)) < 0.2
    values = np.asfortranarray(values.astype(np.uint32))
    missing = np.asfortranarray(missing)
    got = encoder.encode_values(values, missing)
    index = {int(v): 2 + k for k, v in enumerate(keys)}
    want = np.array([[0 if missing[i, j] else index.get(int(values[i, j]), 1) for j in range(26)]
                     for i in range(n)])
    assert got.dtype == np.int32 and got.flags.f_contiguous and np.array_equal(got, want)
    sparse = np.where(missing, -1, values.astype(np.int64))
    assert np.array_equal(encoder.encode(np.asfortranarray(sparse)), want)


class _FullDisk:
    """A file whose writes fail with ENOSPC after the first ``allowed``."""

    def __init__(self, handle, allowed: int) -> None:
        self._handle, self._left = handle, allowed

    def write(self, data):
        if self._left == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._left -= 1
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_a_full_disk_while_keeping_the_rows_is_one_line_and_leaves_nothing(raw, tmp_path, monkeypatch):
    real_open = open

    def open_on_a_small_disk(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return _FullDisk(handle, 12) if "w" in mode else handle

    monkeypatch.setattr(spill_module, "open", open_on_a_small_disk, raising=False)
    out = tmp_path / "prepared"
    with pytest.raises(SystemExit) as caught:
        main(["--raw", str(raw), "--out", str(out), "--categorical", "vocab", "--chunk-rows", "97",
              "--max-malformed-fraction", "0.01"])
    message = str(caught.value)
    assert message.startswith(f"recforge: {tmp_path}: keeping the parsed rows of prepared there ")
    assert "(the disk is full)" in message and "--no-spill" in message and "\n" not in message
    assert not out.exists() and _staging(tmp_path) == []

    monkeypatch.undo()  # --no-spill needs no such file
    assert main(["--raw", str(raw), "--out", str(out), "--categorical", "vocab", "--chunk-rows", "97",
                 "--max-malformed-fraction", "0.01", "--no-spill"]) == 0
    assert read_metadata(out)["categorical"]["mode"] == "vocab"


def test_spill_option_is_checked(raw, tmp_path):
    with pytest.raises(UserInputError, match="spill must be True or False, got 'no'"):
        prepare_criteo(raw, tmp_path / "p", categorical="vocab", spill="no")


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="Linux: SIGKILL of a child process")
def test_a_conversion_killed_while_keeping_the_rows_leaves_nothing_taken_for_prepared_data(tmp_path):
    GENERATORS["criteo-kaggle"](tmp_path / "raw", 5e-4, 1)  # 22,920 rows: 230 runs of 100 lines
    raw = tmp_path / "raw" / "train.txt"
    out = tmp_path / "prepared"
    command = [sys.executable, "-m", "recforge.data.criteo.prepare", "--raw", str(raw), "--out", str(out),
               "--categorical", "vocab", "--chunk-rows", "100"]
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    # Kill once the spill holds some runs, before the encoding pass.
    while not any((s / "parsed_rows.bin").is_file() and (s / "parsed_rows.bin").stat().st_size > 0
                  for s in _staging(tmp_path)):
        assert proc.poll() is None, "the conversion ended before it could be killed"
        assert time.monotonic() < deadline, "no spill file appeared"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _staging(tmp_path), "the kill left no spill: it did not interrupt anything"
    with pytest.raises(PreparedDataError):
        read_metadata(out)

    prepare_criteo(raw, out, categorical="vocab", chunk_rows=100)  # the next run starts over
    assert _staging(tmp_path) == []
    twice = prepare_criteo(raw, tmp_path / "twice", categorical="vocab", chunk_rows=100, spill=False)
    assert _parts(out) == _parts(twice) and len(_parts(out)) == 3

"""The full-size raw Criteo generator (:mod:`recforge.data.criteo.fullsize`) and its line writer,
at tiny fractions.

Oracles: the real 1,999-row head of Kaggle's ``train.txt`` (its format, its missing-value groups,
its bytes per row), a naive per-row formatter (``str(int)``, ``f"{v:08x}"``), the project's raw
reader (which must read the generated file as it reads the real one), and table sizes worked out
by hand from the spec's Kaggle counts.
"""
from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from recforge.data.criteo import fullsize
from recforge.data.criteo.fullsize import (
    DENSE_MISSING_GROUPS,
    GENERATORS,
    KAGGLE_CARDINALITIES,
    KAGGLE_ROWS,
    SPARSE_MISSING_GROUPS,
    TERABYTE_DAY_ROWS,
    table_sizes,
)
from recforge.data.criteo.raw import TSV, MalformedLog, detect_layout, iter_raw_chunks
from recforge.data.criteo.raw_writer import MAX_DENSE, format_tsv_lines
from recforge.data.criteo.synthetic import DEFAULT_DENSE_MISSING, DEFAULT_SPARSE_MISSING
from recforge.errors import UserInputError

FIELD_RES = [re.compile(r"[01]")] + [re.compile(r"(-?[0-9]{1,9})?")] * 13 + [re.compile(r"([0-9a-f]{8})?")] * 26
TINY = 2e-5  # 917 Kaggle rows
SMALL = 3e-3  # 137,522 Kaggle rows: C3, C12 and C21 get tables above ALL_HEAD_MAX


@pytest.fixture(scope="module")
def kaggle_small(tmp_path_factory) -> tuple[Path, dict, list[list[str]]]:
    out = tmp_path_factory.mktemp("kaggle_small")
    summary = GENERATORS["criteo-kaggle"](out, SMALL, 7)
    return out / "train.txt", summary, _read_rows(out / "train.txt")


def _read_rows(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_bytes().decode("ascii").split("\n")[:-1]]


def _empty(rows: list[list[str]]) -> np.ndarray:
    """[rows, 39] bool: which of I1..C26 are empty."""
    return np.array([[field == "" for field in row[1:]] for row in rows])


def naive_line(label, dense, dense_missing, sparse) -> str:
    fields = [str(int(label))]
    fields += ["" if m else str(int(v)) for v, m in zip(dense, dense_missing)]
    fields += ["" if v < 0 else f"{int(v):08x}" for v in sparse]
    return "\t".join(fields) + "\n"


# ---------------------------------------------------------------------------- the line writer
def test_writer_matches_a_naive_formatter_on_edge_values():
    rng = np.random.default_rng(0)
    n = 300
    labels = rng.integers(0, 2, n)
    dense = rng.integers(-3, 20, (n, 13)) * 10 ** rng.integers(0, 8, (n, 13))
    dense[0] = [0, -1, MAX_DENSE, -MAX_DENSE, 9, 10, 99, 100, 1, 0, 7, 123456789, 5]
    missing = rng.random((n, 13)) < 0.3
    sparse = rng.integers(-1, 2**32, (n, 26))
    sparse[1] = [0, 2**32 - 1, 0xA, 0xF0, 0x10000000, -1] + [0x68FD1E64] * 20
    text = format_tsv_lines(labels, dense, missing, sparse).tobytes().decode("ascii")
    assert text == "".join(naive_line(*row) for row in zip(labels, dense, missing, sparse))


def test_writer_output_reads_back_through_the_project_reader(tmp_path):
    rng = np.random.default_rng(1)
    n = 500
    labels = rng.integers(0, 2, n)
    dense = rng.integers(-3, 10**6, (n, 13))
    missing = rng.random((n, 13)) < 0.2
    sparse = np.where(rng.random((n, 26)) < 0.2, -1, rng.integers(0, 2**32, (n, 26)))
    path = tmp_path / "rows.txt"
    path.write_bytes(format_tsv_lines(labels, dense, missing, sparse).tobytes())
    log = MalformedLog("fail")
    (chunk,) = list(iter_raw_chunks(path, detect_layout(path), 10_000, log))
    np.testing.assert_array_equal(chunk.labels, labels)
    np.testing.assert_array_equal(chunk.dense, np.where(missing, 0, dense))  # the reader's missing = 0
    np.testing.assert_array_equal(chunk.sparse, sparse)


def test_writer_refuses_values_it_cannot_write():
    ok = {"labels": np.zeros(1, int), "dense": np.zeros((1, 13), int),
          "dense_missing": np.zeros((1, 13), bool), "sparse": np.zeros((1, 26), int)}
    with pytest.raises(ValueError, match="dense values"):
        format_tsv_lines(**{**ok, "dense": np.full((1, 13), MAX_DENSE + 1)})
    with pytest.raises(ValueError, match="sparse"):
        format_tsv_lines(**{**ok, "sparse": np.full((1, 26), 2**32)})
    with pytest.raises(ValueError, match="labels"):
        format_tsv_lines(**{**ok, "labels": np.array([2])})


# ---------------------------------------------------------------------------- the files
def test_format_matches_the_real_kaggle_sample(kaggle_small, shared_data_dir):
    real = shared_data_dir / "criteo" / "train.tiny.txt"
    if not real.is_file():
        pytest.skip(f"{real} is absent: the real Criteo sample is needed to compare formats")
    path, _, generated = kaggle_small
    per_row = {}
    for sample, rows in ((real, _read_rows(real)), (path, generated)):
        raw = sample.read_bytes()
        assert raw.endswith(b"\n") and b"\r" not in raw
        assert all(len(row) == 40 for row in rows)
        assert all(regex.fullmatch(field) for row in rows[:2000] for regex, field in zip(FIELD_RES, row))
        # The project's reader takes both the same way: raw TSV, no header, nothing malformed.
        assert detect_layout(sample) == TSV
        log = MalformedLog("fail")
        assert sum(len(c) for c in iter_raw_chunks(sample, TSV, 100_000, log)) == len(rows)
        per_row[sample] = len(raw) / len(rows)
    assert per_row[path] == pytest.approx(per_row[real], rel=0.1)  # ~241 bytes a row


def test_missing_groups_are_the_real_samples_and_rates_are_kaggles(kaggle_small, shared_data_dir):
    _, _, rows = kaggle_small
    empty = _empty(rows)
    dense_rates, sparse_rates = empty[:, :13].mean(axis=0), empty[:, 13:].mean(axis=0)
    np.testing.assert_allclose(dense_rates, DEFAULT_DENSE_MISSING, atol=0.015)
    np.testing.assert_allclose(sparse_rates, DEFAULT_SPARSE_MISSING, atol=0.015)
    real = shared_data_dir / "criteo" / "train.tiny.txt"
    samples = [empty] + ([_empty(_read_rows(real))] if real.is_file() else [])
    for found in samples:
        for offset, groups in ((0, DENSE_MISSING_GROUPS), (13, SPARSE_MISSING_GROUPS)):
            for group in groups:
                columns = found[:, [offset + j for j in group]]
                assert (columns == columns[:, :1]).all(), f"columns {group} are not empty together"
    assert not empty[:, 1].any()  # I2 is never empty in Kaggle


def test_positives_negatives_and_heavy_tails(kaggle_small):
    _, summary, rows = kaggle_small
    assert summary["rows"] == len(rows) == round(SMALL * KAGGLE_ROWS)
    labels = np.array([int(r[0]) for r in rows])
    assert summary["positives"] == labels.sum()
    assert labels.mean() == pytest.approx(0.256, abs=0.01)
    i2 = np.array([int(r[2]) for r in rows])
    assert set(i2[i2 < 0]) == {-1, -2, -3} and (i2 < 0).mean() == pytest.approx(0.10, abs=0.01)
    i5 = np.array([int(r[5]) for r in rows if r[5]])
    assert i5.max() > 100 * np.median(i5) > 0  # heavy-tailed counts


def test_table_sizes_scale_with_the_fraction():
    assert table_sizes(KAGGLE_CARDINALITIES, 1.0) == list(KAGGLE_CARDINALITIES)
    assert table_sizes(KAGGLE_CARDINALITIES, SMALL)[2] == 30_394  # round(0.003 * 10,131,227)
    assert sum(KAGGLE_CARDINALITIES) == 33_762_577
    half = table_sizes(KAGGLE_CARDINALITIES, 0.5)
    assert half[2] == 5_065_614  # C3: round(10,131,227 / 2) (even-rounding of .5)
    assert half[6] == 10_000  # C7: 12,517 / 2 is below the floor, min(12,517, 10,000)
    assert half[0] == 1460 and half[8] == 3  # small tables keep every value
    with pytest.raises(UserInputError, match="fraction"):
        table_sizes(KAGGLE_CARDINALITIES, 0.0)


def test_every_value_of_a_tailed_table_occurs_and_small_tables_are_covered(kaggle_small):
    _, summary, rows = kaggle_small
    distinct = [len({r[14 + f] for r in rows} - {""}) for f in range(26)]
    sizes = summary["table_sizes"]
    assert sizes == table_sizes(KAGGLE_CARDINALITIES, SMALL)
    for f in (2, 11, 20):  # C3, C12, C21: 30,394 / 25,055 / 21,140 values, head and tail
        assert distinct[f] == sizes[f]
    assert distinct[8] == 3 and distinct[19] == 4  # C9, C20
    assert all(d <= s for d, s in zip(distinct, sizes))


def test_terabyte_day_scales_kaggles_tables_by_its_rows(tmp_path):
    summary = GENERATORS["criteo-day"](tmp_path, TINY, 0)
    assert set(summary["files"]) == {"day_0"}
    assert summary["rows"] == round(TINY * TERABYTE_DAY_ROWS) == len(_read_rows(tmp_path / "day_0"))
    ratio = TERABYTE_DAY_ROWS / KAGGLE_ROWS
    expected = table_sizes([n if n <= 10_000 else round(n * ratio) for n in KAGGLE_CARDINALITIES], TINY)
    assert summary["table_sizes"] == expected
    assert summary["table_sizes"][2] == 10_000  # C3 at this fraction: the floor


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = GENERATORS["criteo-kaggle"](tmp_path / "a", TINY, 3)
    b = GENERATORS["criteo-kaggle"](tmp_path / "b", TINY, 3)
    c = GENERATORS["criteo-kaggle"](tmp_path / "c", TINY, 4)
    first = (tmp_path / "a" / "train.txt").read_bytes()
    assert first == (tmp_path / "b" / "train.txt").read_bytes()
    assert first != (tmp_path / "c" / "train.txt").read_bytes()
    assert a["files"] == b["files"] and a["rows"] == c["rows"] == 917
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["train.txt"]  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a" / "train.txt").stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open makes it


def test_tail_values_keep_counting_across_blocks(monkeypatch):
    # Tables of 30,000 values (a head of 1,500, a tail of 28,500) over 1,000 rows in blocks of 100:
    # about 90 % of the rows draw a tail value, each one new, as long as the count is carried from
    # block to block (restarted per block, the blocks would repeat the same ~90 tail values).
    monkeypatch.setattr(fullsize, "BLOCK_ROWS", 100)
    spec = fullsize.RawCriteoSpec(rows=1000, tables=(30_000,) * 26, seed=0, salt=0)
    blocks = list(fullsize.iter_raw_blocks(spec))
    assert [len(b.labels) for b in blocks] == [100] * 10
    c1 = np.concatenate([b.sparse[0] for b in blocks])
    assert len(np.unique(c1)) >= 850


def test_a_full_disk_is_one_line_naming_the_directory_and_leaves_nothing(tmp_path, monkeypatch):
    real = tempfile.NamedTemporaryFile

    def failing(*args, **kwargs):
        handle = real(*args, **kwargs)

        def write(data):
            raise OSError(errno.ENOSPC, "No space left on device")

        handle.write = write
        return handle

    monkeypatch.setattr(fullsize.tempfile, "NamedTemporaryFile", failing)
    out = tmp_path / "out"
    with pytest.raises(UserInputError) as caught:
        GENERATORS["criteo-kaggle"](out, TINY, 0)
    message = str(caught.value)
    assert "\n" not in message and str(out) in message and "disk is full" in message
    assert list(out.iterdir()) == []


def test_bad_fraction_and_seed_are_user_errors(tmp_path):
    with pytest.raises(UserInputError, match="fraction"):
        GENERATORS["criteo-kaggle"](tmp_path, 1.5, 0)
    with pytest.raises(UserInputError, match="seed"):
        GENERATORS["criteo-day"](tmp_path, TINY, -1)

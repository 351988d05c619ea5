"""The raw Criteo -> prepared parquet conversion, against oracles written here.

The oracle is a naive per-line reader of the raw format (``str.split``, ``int(x, 16)``,
``math.log1p``, regular expressions for what a valid value is), the split boundaries are
worked out by hand, and the real 1,999-row sample's .txt and .csv copies must give the same data.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from processes import run_child

from recforge.data.criteo.prepare import ensure_prepared, prepare_criteo, prepared_key
from recforge.data.criteo.prepared import SPLITS, read_metadata, split_files
from recforge.data.criteo.raw import MalformedLog, detect_layout, iter_raw_chunks
from recforge.data.criteo import transform
from recforge.data.criteo.splits import DaysSplit, Kaggle7Split, kaggle7_part_sizes, row_uniforms
from recforge.errors import UserInputError

INT_RE = re.compile(r"-?[0-9]{1,18}")
HEX_RE = re.compile(r"[0-9a-fA-F]{1,8}")


# ---------------------------------------------------------------------------- oracle
def naive_parse(line: str):
    """(label, 13 dense ints or None, 26 hex ints or None), or None for a malformed line."""
    fields = line.rstrip("\r").split("\t")
    if len(fields) != 40 or fields[0] not in ("0", "1"):
        return None
    dense, cats = [], []
    for value in fields[1:14]:
        if value and not INT_RE.fullmatch(value):
            return None
        dense.append(int(value) if value else None)
    for value in fields[14:]:
        if value and not HEX_RE.fullmatch(value):
            return None
        cats.append(int(value, 16) if value else None)
    return int(fields[0]), dense, cats


def naive_dense(dense: list) -> list[np.float32]:
    return [np.float32(math.log1p(max(x or 0, 0))) for x in dense]


def naive_hash(cats: list, max_ind_range: int) -> list[int]:
    return [0 if v is None else 1 + v % max_ind_range for v in cats]


def line(label, dense, cats) -> str:
    """One raw line; ``None`` = missing, ints written as decimal / 8-digit hex, str as is."""
    def text(v, hexa):
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        return f"{v:08x}" if hexa else str(v)
    return "\t".join([str(label)] + [text(v, False) for v in dense] + [text(v, True) for v in cats])


def synthetic_lines(n: int, seed: int = 0, vocab: int = 6) -> list[str]:
    """Valid lines; I1 = the row number (to find rows after splitting), C1 from a small vocabulary."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        dense = [i] + [rng.choice([None, -2, 0, 1, 7, 123456, rng.randint(0, 10**9)]) for _ in range(12)]
        cats = [rng.randrange(vocab) * 0x1F3A5 + 0xA0000000 if rng.random() > 0.1 else None for _ in range(26)]
        out.append(line(rng.randint(0, 1), dense, cats))
    return out


def write_lines(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_bytes("".join(l + end for l in lines).encode())
    return path


def read_prepared(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """split -> label [n], dense [n, 13], sparse [n, 26], from the parquet parts in order."""
    meta = read_metadata(path)
    out = {}
    for split in SPLITS:
        files = split_files(path, split, meta)
        if not files:
            continue
        tables = [pq.read_table(f) for f in files]
        cols = {name: np.concatenate([t.column(name).to_numpy() for t in tables]) for name in tables[0].column_names}
        out[split] = {
            "label": cols["label"],
            "dense": np.stack([cols[f"I{i}"] for i in range(1, 14)], axis=1),
            "sparse": np.stack([cols[f"C{i}"] for i in range(1, 27)], axis=1),
        }
    return out


def assert_same_data(a: Path, b: Path) -> None:
    da, db = read_prepared(a), read_prepared(b)
    assert da.keys() == db.keys()
    for split in da:
        for key in ("label", "dense", "sparse"):
            np.testing.assert_array_equal(da[split][key], db[split][key], err_msg=f"{split}/{key}")
    assert read_metadata(a)["cardinalities"] == read_metadata(b)["cardinalities"]


def first_column(data: dict, split: str) -> list[int]:
    """The I1 values (row numbers of synthetic_lines) of a split, undoing log1p."""
    return [int(round(math.expm1(float(v)))) for v in data[split]["dense"][:, 0]] if split in data else []


def left_behind(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir()] if parent.exists() else []


# ---------------------------------------------------------------------------- the real sample
def test_real_sample_txt_and_csv_give_identical_data_matching_the_oracle(shared_data_dir, tmp_path):
    txt = shared_data_dir / "criteo" / "train.tiny.txt"
    csv = shared_data_dir / "criteo" / "train.tiny.csv"
    a = prepare_criteo(txt, tmp_path / "txt", max_ind_range=1000)
    b = prepare_criteo(csv, tmp_path / "csv", max_ind_range=1000, chunk_rows=97)
    assert_same_data(a, b)
    assert read_metadata(a)["source"]["inputs"][0]["layout"] == "tsv"
    assert read_metadata(b)["source"]["inputs"][0]["layout"] == "csv"

    rows = [naive_parse(l) for l in txt.read_text().splitlines()]
    assert len(rows) == 1999 and all(r is not None for r in rows)
    data = read_prepared(a)
    # 1999 = 7 * 285 + 4: parts 286 x 4, 285 x 3; train 1714; part 6 (285) -> test 143, valid 142
    order = {"train": rows[:1714], "test": rows[1714:1857], "valid": rows[1857:]}
    for split, expected in order.items():
        assert data[split]["label"].tolist() == [r[0] for r in expected]
        dense = np.array([naive_dense(r[1]) for r in expected], dtype=np.float32)
        np.testing.assert_array_equal(data[split]["dense"], dense)
        np.testing.assert_array_equal(data[split]["sparse"], np.array([naive_hash(r[2], 1000) for r in expected]))
    meta = read_metadata(a)
    assert meta["split"]["rows"] == {"train": 1714, "valid": 142, "test": 143}
    assert meta["splits"]["train"]["positives"] == sum(r[0] for r in rows[:1714])
    assert sum(s["positives"] for s in meta["splits"].values()) == 418  # README: 418 label-1 rows


def test_real_sample_csv_with_labelled_test_file_as_files_split(shared_data_dir, tmp_path):
    folder = shared_data_dir / "criteo"
    out = prepare_criteo(folder / "train.tiny.csv", tmp_path / "p", split="files", test=folder / "test.tiny.csv",
                         categorical="vocab", min_frequency=2)
    meta = read_metadata(out)
    assert meta["split"]["rows"] == {"train": 1999, "valid": 0, "test": 1999}
    assert [i["role"] for i in meta["source"]["inputs"]] == ["train", "test"]
    data = read_prepared(out)
    assert data["test"]["sparse"].max(axis=0).tolist() < meta["cardinalities"]


# ---------------------------------------------------------------------------- parsing
def test_parser_matches_the_naive_reader_on_edge_values(tmp_path):
    rng = random.Random(3)
    ints = ["", "0", "-1", "-", "7", "12345678", "-1234567", "123456789", "-123456789012",
            "999999999999999999", "1234567890123456789", "1.5", "+3", " 5", "1e3", "٣", "00042"]
    hexes = ["", "0", "a", "F", "68fd1e64", "FFFFFFFF", "123456789", "xyz", "0x12", "-1", "ab cd", "7", "é1", "Ab"]
    lines = []
    for i in range(3000):
        if rng.random() < 0.03:
            lines.append(rng.choice(["", "1\t2", "\t".join(["0"] * 41), "0"]))
            continue
        label = rng.choice(["0", "1"]) if rng.random() > 0.01 else rng.choice(["2", "", "00", "a"])
        dense = [rng.choice(ints) if rng.random() < 0.06 else str(rng.randint(0, 99)) for _ in range(13)]
        cats = [rng.choice(hexes) if rng.random() < 0.03 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        lines.append("\t".join([label, *dense, *cats]))
    path = tmp_path / "edge.txt"
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())  # CRLF line ends too
    expected = {i: naive_parse(l) for i, l in enumerate(lines)}
    for chunk_rows in (7, 100_000):
        log = MalformedLog(keep=10**6)
        got = {}
        for chunk in iter_raw_chunks(path, detect_layout(path), chunk_rows, log):
            for r, lab, d, c in zip(chunk.rows, chunk.labels, chunk.dense, chunk.sparse):
                got[int(r)] = (int(lab), d.tolist(), c.tolist())
        valid = {i: v for i, v in expected.items() if v is not None}
        assert got == {i: (v[0], [x or 0 for x in v[1]], [-1 if x is None else x for x in v[2]])
                       for i, v in valid.items()}
        bad_lines = [i + 1 for i, v in expected.items() if v is None]
        assert log.count == len(bad_lines) > 50
        assert [int(e.split(":")[1]) for e in log.examples] == bad_lines
        assert not any(e.endswith(": malformed") for e in log.examples)  # every one explained


def test_gzip_input_gives_the_same_data(tmp_path):
    lines = synthetic_lines(60)
    plain = write_lines(tmp_path / "train.txt", lines)
    zipped = tmp_path / "train.txt.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    renamed = tmp_path / "day_0"  # recognised by its magic bytes, not its name
    renamed.write_bytes(zipped.read_bytes())
    a = prepare_criteo(plain, tmp_path / "a", max_ind_range=50)
    b = prepare_criteo(zipped, tmp_path / "b", max_ind_range=50, chunk_rows=9)
    c = prepare_criteo(renamed, tmp_path / "c", max_ind_range=50)
    assert_same_data(a, b)
    assert_same_data(a, c)


def test_bom_last_line_without_break_and_bars_header_without_id(tmp_path):
    lines = synthetic_lines(30)
    tsv = tmp_path / "a.txt"
    tsv.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())  # no final line break
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    csv = tmp_path / "bars.csv"
    csv.write_text(header + "\n" + "\n".join(l.replace("\t", ",") for l in lines) + "\n")
    a = prepare_criteo(tsv, tmp_path / "pa", max_ind_range=97)
    b = prepare_criteo(csv, tmp_path / "pb", max_ind_range=97, chunk_rows=4)
    assert_same_data(a, b)
    assert sum(read_metadata(a)["split"]["rows"].values()) == 30


# ---------------------------------------------------------------------------- categorical modes
def test_hash_mode_indices_and_table_size(tmp_path):
    lines = [
        line(1, [5, -3, None] + [0] * 10, [0, 0xFFFFFFFF, None, "Ab", 7] + [1] * 21),
        line(0, [None] * 13, [None] * 26),
        line(1, [10**17] + [1] * 12, [6, 13, 20, "abcdef12", 0x7FFFFFFF] + [2] * 21),
    ] * 3  # 9 rows: kaggle7 puts 2, 2, 1, 1, 1, 1, 1 -> 8 train rows, 1 test
    path = write_lines(tmp_path / "h.txt", lines)
    out = prepare_criteo(path, tmp_path / "p", max_ind_range=7)
    meta = read_metadata(out)
    assert meta["cardinalities"] == [8] * 26
    assert meta["categorical"]["mode"] == "hash" and meta["categorical"]["max_ind_range"] == 7
    data = read_prepared(out)
    expected = [naive_parse(l) for l in lines]
    got = np.concatenate([data["train"]["sparse"], data["test"]["sparse"]])
    np.testing.assert_array_equal(got, [naive_hash(r[2], 7) for r in expected])
    # by hand: 0xFFFFFFFF = 4294967295 = 7 * 613566756 + 3; 0xAB = 171 = 7 * 24 + 3
    assert got[0, :5].tolist() == [1, 4, 0, 4, 1]
    dense = np.concatenate([data["train"]["dense"], data["test"]["dense"]])
    assert dense[0, :3].tolist() == [np.float32(math.log(6)), 0.0, 0.0]  # negative and missing -> 0
    assert dense.dtype == np.float32
    # rows used: C1 holds 0 -> 1, missing -> 0, 6 -> 1 + 6 % 7 = 7: three rows of its table
    assert meta["categorical"]["rows_used"][0] == 3


def test_vocab_mode_min_frequency_oov_and_train_only(tmp_path):
    a, b, c, d, e = 0x10, 0x0B, 0xFFFF0000, 0x2, 0x99  # a x3, b x2, c x1, missing x1 in train
    train_c1 = [a, b, a, c, None, b, a]
    train = [line(i % 2, [i] + [0] * 12, [v] + [1] * 25) for i, v in enumerate(train_c1)]
    # valid/test: e is frequent there but absent from train -> out of vocabulary
    valid = [line(0, [100 + i] + [0] * 12, [v] + [1] * 25) for i, v in enumerate([e, e, e, a, d])]
    test = [line(1, [200 + i] + [0] * 12, [v] + [1] * 25) for i, v in enumerate([b, None, c, e])]
    paths = [write_lines(tmp_path / f"{name}.txt", ls)
             for name, ls in (("train", train), ("valid", valid), ("test", test))]
    out = prepare_criteo(paths[0], tmp_path / "p", split="files", valid=paths[1], test=paths[2],
                         categorical="vocab", min_frequency=2)
    meta = read_metadata(out)
    # kept in ascending order of value: b (0x0B) -> 2, a (0x10) -> 3; c rare -> 1; missing -> 0
    assert meta["cardinalities"][0] == 4
    assert meta["categorical"]["vocab_sizes"][0] == 2
    assert meta["categorical"]["distinct_values"][0] == 3
    assert meta["cardinalities"][1:] == [3] * 25  # one kept value (1) + missing + OOV
    data = read_prepared(out)
    assert data["train"]["sparse"][:, 0].tolist() == [3, 2, 3, 1, 0, 2, 3]
    assert data["valid"]["sparse"][:, 0].tolist() == [1, 1, 1, 3, 1]
    assert data["test"]["sparse"][:, 0].tolist() == [2, 0, 1, 1]
    assert meta["categorical"]["oov_index"] == 1 and meta["categorical"]["missing_index"] == 0

    loose = prepare_criteo(paths[0], tmp_path / "q", split="files", valid=paths[1], test=paths[2],
                           categorical="vocab", min_frequency=1)
    # min_frequency 1 keeps c too: b -> 2, a -> 3, c -> 4
    assert read_prepared(loose)["train"]["sparse"][:, 0].tolist() == [3, 2, 3, 4, 0, 2, 3]


def test_value_counts_merged_over_many_chunks_equal_a_counter(monkeypatch):
    from collections import Counter

    monkeypatch.setattr(transform, "_MERGE_MIN", 3)  # merge often: every path of the merge runs
    rng = np.random.default_rng(0)
    counter, expected = transform.ValueCounter(), [Counter() for _ in range(26)]
    for _ in range(30):
        sparse = rng.integers(-1, 40, size=(int(rng.integers(0, 25)), 26)) * 0x01000193
        sparse[sparse < 0] = -1
        counter.update(sparse)
        for j in range(26):
            expected[j].update(v for v in sparse[:, j].tolist() if v >= 0)
    for (keys, counts), oracle in zip(counter.finish(), expected):
        assert dict(zip(keys.tolist(), counts.tolist())) == dict(oracle)
        assert keys.tolist() == sorted(keys.tolist())


def test_vocab_lookup_in_a_large_vocabulary_matches_a_dict(monkeypatch):
    rng = np.random.default_rng(1)
    kept = [np.unique(rng.integers(0, 2**32, size=int(rng.integers(0, 3000)), dtype=np.uint64)).astype(np.uint32)
            for _ in range(26)]
    sparse = np.stack([np.where(rng.random(5000) < 0.5, rng.choice(k, 5000) if len(k) else -1,
                                rng.integers(-1, 2**32, 5000)) for k in kept], axis=1).astype(np.int64)
    tables = [{int(x): 2 + i for i, x in enumerate(k)} for k in kept]
    oracle = [[0 if v < 0 else table.get(v, 1) for v in sparse[:, j].tolist()] for j, table in enumerate(tables)]
    encoder = transform.VocabEncoder(kept, 1, [len(k) for k in kept], 0)
    for threshold in (1, 1 << 30):  # the sorted-lookup path and the plain one
        monkeypatch.setattr(transform, "_SORTED_LOOKUP_MIN", threshold)
        assert encoder.encode(sparse).T.tolist() == oracle


def test_vocab_is_counted_on_the_kaggle7_training_part_only(tmp_path):
    # 14 rows: parts of 2; train = rows 0-11, test = 12, valid = 13. Rows 12-13 carry a value
    # never seen in train: it must be out of vocabulary, and not counted.
    lines = [line(0, [i] + [0] * 12, [0x55] + [1] * 25) for i in range(12)]
    lines += [line(0, [12 + i] + [0] * 12, [0x77] + [1] * 25) for i in range(2)]
    out = prepare_criteo(write_lines(tmp_path / "k.txt", lines), tmp_path / "p", categorical="vocab")
    meta = read_metadata(out)
    assert meta["categorical"]["distinct_values"][0] == 1
    data = read_prepared(out)
    assert data["train"]["sparse"][:, 0].tolist() == [2] * 12
    assert data["test"]["sparse"][:, 0].tolist() == [1] and data["valid"]["sparse"][:, 0].tolist() == [1]


# ---------------------------------------------------------------------------- splits
def test_kaggle7_boundaries_by_hand_on_23_rows(tmp_path):
    # divmod(23, 7) = (3, 2): parts 4, 4, 3, 3, 3, 3, 3; train = rows 0-19; part 6 = rows 20-22,
    # np.array_split in two -> test = rows 20, 21, valid = row 22
    assert kaggle7_part_sizes(23) == [4, 4, 3, 3, 3, 3, 3]
    path = write_lines(tmp_path / "t.txt", synthetic_lines(23))
    data = read_prepared(prepare_criteo(path, tmp_path / "p", max_ind_range=5))
    assert first_column(data, "train") == list(range(20))
    assert first_column(data, "test") == [20, 21]
    assert first_column(data, "valid") == [22]


def test_split_sizes_of_the_full_datasets_match_the_reference_counts():
    # facebookresearch/dlrm on Kaggle's 45,840,617 rows printed 306,968 training and 25,580 test
    # batches of 128 (issue #27): whole batches of 39,291,958 and 3,274,330 rows
    kaggle = Kaggle7Split([45_840_617])
    assert kaggle.train_end // 128 == 306_968 and (kaggle.test_end - kaggle.train_end) // 128 == 25_580
    assert kaggle.train_end == 4 * 6_548_660 + 2 * 6_548_659
    assert kaggle.total - kaggle.test_end == 6_548_659 // 2
    # Terabyte: day 23's 178,274,637 rows -> 89,137,319 test, 89,137,318 valid
    terabyte = DaysSplit(24, 178_274_637)
    lines = np.array([0, 89_137_318, 89_137_319, 178_274_636])
    assert terabyte.assign(23, lines).tolist() == [2, 2, 1, 1]  # TEST, TEST, VALID, VALID
    assert terabyte.assign(22, lines).tolist() == [0] * 4


def test_kaggle7_keeps_malformed_lines_in_place_and_spans_several_files(tmp_path):
    lines = synthetic_lines(23)
    lines[3] = "garbage"
    lines[21] = lines[21].replace("\t", ",", 1)
    first = write_lines(tmp_path / "a.txt", lines[:10])
    second = write_lines(tmp_path / "b.txt", lines[10:])
    out = prepare_criteo([first, second], tmp_path / "p", max_ind_range=5, max_malformed_fraction=0.1)
    data = read_prepared(out)
    assert first_column(data, "train") == [i for i in range(20) if i != 3]
    assert first_column(data, "test") == [20]
    assert first_column(data, "valid") == [22]
    meta = read_metadata(out)
    assert meta["malformed"]["count"] == 2
    assert meta["malformed"]["examples"] == [
        f"{first}:4: expected 40 fields separated by tab, found 1",
        f"{second}:12: expected 40 fields separated by tab, found 39",
    ]


@pytest.mark.parametrize("kind, fractions", [("random_7_2_1", (0.7, 0.2, 0.1)), ("random_8_1_1", (0.8, 0.1, 0.1))])
def test_random_splits_are_seeded_disjoint_complete_and_proportioned(tmp_path, kind, fractions):
    n = 6000
    path = write_lines(tmp_path / "r.txt", synthetic_lines(n))
    runs = {}
    for name, seed, chunk in (("a", 0, 100_000), ("b", 0, 61), ("c", 1, 1000)):
        runs[name] = read_prepared(prepare_criteo(path, tmp_path / name, split=kind, seed=seed,
                                                  chunk_rows=chunk, max_ind_range=11))
    ids = {s: first_column(runs["a"], s) for s in ("train", "valid", "test")}
    everything = sorted(ids["train"] + ids["valid"] + ids["test"])
    assert everything == list(range(n))  # disjoint and complete
    for split, fraction in zip(("train", "valid", "test"), fractions):
        assert ids[split] == sorted(ids[split])  # file order kept
        assert abs(len(ids[split]) / n - fraction) < 4 * math.sqrt(fraction * (1 - fraction) / n)
        assert first_column(runs["b"], split) == ids[split]  # same seed, other chunks: same rows
    assert first_column(runs["c"], "train") != ids["train"]  # another seed: other rows
    meta = read_metadata(tmp_path / "a")
    assert meta["split"]["kind"] == kind and meta["split"]["seed"] == 0
    assert "not BARS's released" in meta["split"]["caveat"]


def test_row_uniforms_do_not_depend_on_how_rows_are_cut():
    lines = np.arange(1000)
    whole = row_uniforms(5, 2, lines)
    parts = np.concatenate([row_uniforms(5, 2, lines[a:a + 37]) for a in range(0, 1000, 37)])
    np.testing.assert_array_equal(whole, parts)
    assert 0.0 <= whole.min() and whole.max() < 1.0
    assert not np.array_equal(whole, row_uniforms(5, 3, lines))  # another input file
    assert abs(whole.mean() - 0.5) < 0.05


def test_days_split_in_day_order(tmp_path):
    lines = synthetic_lines(18)
    days = tmp_path / "days"
    days.mkdir()
    # day_10 is the last day: a shell glob would list it before day_2
    write_lines(days / "day_0", lines[:5])
    write_lines(days / "day_2", lines[5:11])
    (days / "day_10.gz").write_bytes(gzip.compress("".join(l + "\n" for l in lines[11:]).encode()))
    given = [days / "day_10.gz", days / "day_0", days / "day_2"]
    a = prepare_criteo(given, tmp_path / "a", split="days", max_ind_range=3)
    b = prepare_criteo(days, tmp_path / "b", split="days", max_ind_range=3)  # the directory
    assert_same_data(a, b)
    data = read_prepared(a)
    # train = days 0 and 2 (rows 0-10); last day = rows 11-17 (7 lines): test 4, valid 3
    assert first_column(data, "train") == list(range(11))
    assert first_column(data, "test") == [11, 12, 13, 14]
    assert first_column(data, "valid") == [15, 16, 17]
    meta = read_metadata(a)
    assert [Path(i["path"]).name for i in meta["source"]["inputs"]] == ["day_0", "day_2", "day_10.gz"]
    with pytest.raises(UserInputError, match="at least 2 day files"):
        prepare_criteo(days / "day_0", tmp_path / "c", split="days", max_ind_range=3)


def test_chunk_boundaries_do_not_change_the_output(tmp_path):
    lines = synthetic_lines(200, seed=4)
    lines[50] = lines[50].replace("\t1\t", "\tx\t", 1)
    path = write_lines(tmp_path / "c.txt", lines)
    for mode in ({"max_ind_range": 13}, {"categorical": "vocab", "min_frequency": 2}):
        small = prepare_criteo(path, tmp_path / f"s{len(mode)}", chunk_rows=7, split="random_7_2_1",
                               max_malformed_fraction=0.01, **mode)
        large = prepare_criteo(path, tmp_path / f"l{len(mode)}", chunk_rows=100_000, split="random_7_2_1",
                               max_malformed_fraction=0.01, **mode)
        assert_same_data(small, large)
        assert read_metadata(small)["malformed"]["count"] == 1


# ---------------------------------------------------------------------------- malformed lines
MALFORMED = {
    2: ("\t".join(["0"] * 39), "expected 40 fields separated by tab, found 39"),
    4: ("", "empty line"),
    5: (line(2, [1] * 13, [1] * 26), "label (field 1): expected a label 0 or 1, got '2'"),
    7: (line("", [1] * 13, [1] * 26), "label (field 1): expected a label 0 or 1, got ''"),
    8: (line(0, [1, 2, "3.5"] + [1] * 10, [1] * 26),
        "I3 (field 4): expected an integer or an empty field, got '3.5'"),
    11: (line(0, [1] * 13, [1] * 5 + ["zz12"] + [1] * 20),
         "C6 (field 20): expected hex digits or an empty field, got 'zz12'"),
    12: (line(0, [1] * 13, [1] * 25 + ["123456789"]),
         "C26 (field 40): expected at most 8 hex digits, got '123456789'"),
}


def malformed_file(tmp_path: Path, n: int = 40) -> tuple[Path, list[str]]:
    lines = synthetic_lines(n)
    for number, (text, _) in MALFORMED.items():
        lines[number - 1] = text
    return write_lines(tmp_path / "bad.txt", lines), lines


def test_every_malformed_kind_is_counted_with_its_line(tmp_path):
    path, lines = malformed_file(tmp_path)
    out = prepare_criteo(path, tmp_path / "p", max_ind_range=5, max_malformed_fraction=0.5)
    meta = read_metadata(out)
    assert meta["malformed"]["count"] == len(MALFORMED)
    assert meta["malformed"]["examples"] == [f"{path}:{n}: {reason}" for n, (_, reason) in MALFORMED.items()]
    data = read_prepared(out)
    kept = [r for r in (naive_parse(l) for l in lines) if r is not None]
    assert sum(len(d["label"]) for d in data.values()) == len(kept) == 40 - len(MALFORMED)
    assert meta["conversion"]["rows_read"] == 40


def test_csv_line_numbers_count_the_header(tmp_path):
    lines = synthetic_lines(12)
    lines[4] = lines[4].replace("\t", "\t\t", 1)  # one field too many
    header = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    path = tmp_path / "k.csv"
    rows = "".join(f"{10**7 + i},{l.replace(chr(9), ',')}\r\n" for i, l in enumerate(lines))
    path.write_bytes((header + "\r\n" + rows).encode())
    out = prepare_criteo(path, tmp_path / "p", max_ind_range=5, max_malformed_fraction=0.2)
    examples = read_metadata(out)["malformed"]["examples"]
    assert examples == [f"{path}:6: expected 41 fields separated by ',', found 42"]


def test_fail_policy_and_the_fraction_limit(tmp_path):
    path, _ = malformed_file(tmp_path)
    with pytest.raises(UserInputError) as error:
        prepare_criteo(path, tmp_path / "f", max_ind_range=5, on_malformed="fail")
    assert str(error.value) == f"malformed line (on_malformed='fail'): {path}:2: {MALFORMED[2][1]}"
    # 7 of 40 lines = 17.5%
    with pytest.raises(UserInputError) as error:
        prepare_criteo(path, tmp_path / "g", max_ind_range=5, max_malformed_fraction=0.17)
    message = str(error.value)
    assert message.startswith("7 of 40 lines malformed (17.5000%, more than max_malformed_fraction=0.17)")
    assert f"{path}:2:" in message and f"{path}:4: empty line" in message and "\n" not in message
    assert prepare_criteo(path, tmp_path / "h", max_ind_range=5, max_malformed_fraction=0.175).is_dir()
    assert not (tmp_path / "f").exists() and not (tmp_path / "g").exists()
    assert sorted(left_behind(tmp_path)) == ["bad.txt", "h"]  # no temporary directories either


# ---------------------------------------------------------------------------- user errors
def assert_one_line_error(tmp_path: Path, match: str, *args, **kwargs) -> None:
    out = tmp_path / "out"
    with pytest.raises(UserInputError, match=match) as error:
        prepare_criteo(*args, out, **kwargs)
    assert "\n" not in str(error.value)
    assert not out.exists()
    assert not [n for n in left_behind(tmp_path) if n.startswith(".out.")]


def test_empty_missing_truncated_and_wrong_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert_one_line_error(tmp_path, f"{re.escape(str(empty))}: the file is empty", empty, max_ind_range=5)
    missing = tmp_path / "nope.txt"
    assert_one_line_error(tmp_path, f"{re.escape(str(missing))}: no such file", missing, max_ind_range=5)

    # cut in the middle: the first lines decompress, the stream then ends early
    whole = gzip.compress("".join(l + "\n" for l in synthetic_lines(3000)).encode())
    truncated = tmp_path / "cut.txt.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    assert_one_line_error(tmp_path, f"{re.escape(str(truncated))}: cannot be read as gzip-compressed text",
                          truncated, max_ind_range=5)
    assert_one_line_error(tmp_path, "cannot be read as gzip", truncated, max_ind_range=5, split="random_8_1_1")

    header_only = tmp_path / "h.csv"
    header_only.write_text("Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + ","
                           + ",".join(f"C{i}" for i in range(1, 27)) + "\n")
    assert_one_line_error(tmp_path, "no data lines after the header", header_only, max_ind_range=5)

    no_header = tmp_path / "noheader.csv"
    write_lines(no_header, [l.replace("\t", ",") for l in synthetic_lines(3)])
    assert_one_line_error(tmp_path, "a CSV file needs its header line", no_header, max_ind_range=5)

    wrong = tmp_path / "wrong.txt"  # right field count on line 1, every line bad: refused at once
    write_lines(wrong, ["\t".join(["x"] * 40)] * 1200)
    assert_one_line_error(tmp_path, "none of the first 1000 lines is a valid Criteo row", wrong,
                          max_ind_range=5, max_malformed_fraction=1.0)


def test_bad_parameters_and_a_directory_that_is_not_prepared(tmp_path):
    path = write_lines(tmp_path / "t.txt", synthetic_lines(10))
    assert_one_line_error(tmp_path, "needs max_ind_range", path, categorical="hash")
    assert_one_line_error(tmp_path, "min_frequency applies to categorical='vocab' only", path,
                          max_ind_range=5, min_frequency=3)
    assert_one_line_error(tmp_path, "max_ind_range applies to categorical='hash' only", path,
                          categorical="vocab", max_ind_range=5)
    assert_one_line_error(tmp_path, "split must be one of", path, max_ind_range=5, split="x")
    assert_one_line_error(tmp_path, "needs the valid and/or test files", path, max_ind_range=5, split="files")
    assert_one_line_error(tmp_path, "are for split='files'", path, max_ind_range=5, valid=path)
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(UserInputError, match="not a prepared Criteo directory; refusing to replace it"):
        prepare_criteo(path, keep, max_ind_range=5)
    assert (keep / "notes.txt").read_text() == "precious"


def test_the_mode_follows_max_ind_range_when_not_given(tmp_path):
    path = write_lines(tmp_path / "t.txt", synthetic_lines(30))
    hashed = json.loads((prepare_criteo(path, tmp_path / "h", max_ind_range=7) / "metadata.json").read_text())
    vocab = json.loads((prepare_criteo(path, tmp_path / "v") / "metadata.json").read_text())
    assert hashed["cardinalities"] == [8] * 26
    assert hashed["categorical"]["mode"] == "hash" and vocab["categorical"]["mode"] == "vocab"


# ---------------------------------------------------------------------------- metadata, cache, CLI
def test_metadata_records_the_conversion(tmp_path):
    path = write_lines(tmp_path / "m.txt", synthetic_lines(21))
    meta = read_metadata(prepare_criteo(path, tmp_path / "p", categorical="vocab", min_frequency=2, chunk_rows=5))
    (source,) = meta["source"]["inputs"]
    assert source["path"] == str(path.resolve()) and source["size"] == path.stat().st_size
    assert source["layout"] == "tsv"
    assert meta["categorical"]["mode"] == "vocab" and meta["categorical"]["min_frequency"] == 2
    assert len(meta["categorical"]["distinct_values"]) == 26 and "index_layout" in meta["categorical"]
    assert meta["split"]["kind"] == "kaggle7" and meta["split"]["part_lines"] == [3] * 7
    assert meta["split"]["rows"] == {"train": 18, "valid": 1, "test": 2}
    assert meta["conversion"]["rows_read"] == 21 and meta["conversion"]["chunk_rows"] == 5
    assert meta["conversion"]["elapsed_seconds"] >= 0
    assert meta["malformed"] == {"count": 0, "lines_read": 21, "fraction": 0.0, "policy": "skip",
                                 "max_fraction": 0.001, "examples": []}


def test_ensure_prepared_reuses_and_reconverts(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "e.txt", synthetic_lines(30))
    cache = tmp_path / "cache"
    first = ensure_prepared(path, cache, max_ind_range=9)
    assert first.parent == cache and read_metadata(first)
    stamp = (first / "metadata.json").stat().st_mtime_ns
    assert ensure_prepared(path, cache, max_ind_range=9, chunk_rows=3) == first  # chunking is no key
    assert (first / "metadata.json").stat().st_mtime_ns == stamp
    other = ensure_prepared(path, cache, max_ind_range=10)
    assert other != first and read_metadata(other)["cardinalities"] == [11] * 26
    vocab = ensure_prepared(path, cache, categorical="vocab")
    assert len({first, other, vocab}) == 3
    # a changed input file is a new key
    write_lines(path, synthetic_lines(31))
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert prepared_key(path, max_ind_range=9) != first.name
    # an incomplete directory under the key is converted again, not trusted; the temporary
    # directory of a killed conversion of the same key is cleared away
    again = cache / prepared_key(path, max_ind_range=9)
    again.mkdir()
    (again / "train").mkdir()
    killed = cache / f".{again.name}.x1y2.tmp"
    killed.mkdir()
    assert ensure_prepared(path, cache, max_ind_range=9) == again
    assert read_metadata(again)["split"]["rows"]["train"] == 27
    assert not killed.exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_child([sys.executable, "-m", "recforge.data.criteo.prepare", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_help_conversion_and_error(tmp_path):
    helped = run_cli("--help")
    assert helped.returncode == 0
    for flag in ("--raw", "--out", "--categorical", "--max-ind-range", "--min-frequency", "--split", "--seed",
                 "--chunk-rows", "--on-malformed", "--max-malformed-fraction", "--valid", "--test", "--layout"):
        assert flag in helped.stdout
    path = write_lines(tmp_path / "c.txt", synthetic_lines(40))
    done = run_cli("--raw", str(path), "--out", str(tmp_path / "out"), "--categorical", "vocab",
                   "--min-frequency", "2", "--split", "random_7_2_1", "--seed", "3", "--chunk-rows", "8")
    assert done.returncode == 0, done.stderr
    meta = read_metadata(tmp_path / "out")
    assert meta["split"]["seed"] == 3 and meta["categorical"]["min_frequency"] == 2
    assert sum(meta["split"]["rows"].values()) == 40
    assert f"train={meta['split']['rows']['train']}" in done.stdout
    failed = run_cli("--raw", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x"), "--max-ind-range", "5")
    assert failed.returncode != 0
    missing = tmp_path / "missing.txt"
    assert failed.stderr.strip().splitlines() == [f"recforge: {missing}: no such file (the raw Criteo input)"]
    assert not (tmp_path / "x").exists()


def test_prepared_parts_follow_the_schema(tmp_path):
    path = write_lines(tmp_path / "s.txt", synthetic_lines(15))
    out = prepare_criteo(path, tmp_path / "p", max_ind_range=4)
    schema = pq.read_schema(split_files(out, "train")[0])
    assert str(schema.field("label").type) == "int8"
    assert {str(schema.field(f"I{i}").type) for i in range(1, 14)} == {"float"}
    assert {str(schema.field(f"C{i}").type) for i in range(1, 27)} == {"int32"}
    assert json.loads((out / "metadata.json").read_text())["format"] == "recforge-criteo-prepared"


# ---------------------------------------------------------------------------- written before prepared_dir
def _as_before_the_toolkit(prepared: Path) -> dict:
    """Rewrite a prepared directory's metadata as the converter wrote it before prepared_dir: the
    inputs' size under "bytes"."""
    meta = json.loads((prepared / "metadata.json").read_text())
    for entry in meta["source"]["inputs"]:
        entry["bytes"] = entry.pop("size")
    (prepared / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def test_a_cache_converted_before_the_toolkit_is_found_under_its_old_key(tmp_path, monkeypatch, caplog):
    import hashlib

    import recforge.data.criteo.prepare as prepare_module

    path = write_lines(tmp_path / "e.txt", synthetic_lines(30))
    cache = tmp_path / "cache"
    cache.mkdir()
    made = prepare_criteo(path, tmp_path / "made", max_ind_range=9)
    meta = _as_before_the_toolkit(made)
    st = path.stat()
    # the key exactly as ensure_prepared computed it before: sizes spelt "bytes"
    blob = json.dumps({"converter": 1, "params": meta["conversion"]["params"], "inputs": {
        "raw": [{"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}],
        "valid": [], "test": []}}, sort_keys=True)
    old = cache / hashlib.sha256(blob.encode()).hexdigest()[:16]
    made.rename(old)

    def refuse(*args, **kwargs):
        raise AssertionError("a converted cache was converted again")

    monkeypatch.setattr(prepare_module, "_convert", refuse)
    caplog.clear()
    with caplog.at_level("INFO", logger="recforge"):
        found = ensure_prepared(path, cache, max_ind_range=9)
    assert found == cache / prepared_key(path, max_ind_range=9) != old
    assert [r.getMessage() for r in caplog.records] == [
        f"criteo cache {old}: renamed to {found.name} (the key now spells the input sizes 'size')"]
    assert read_metadata(found) == meta and not old.exists()
    assert ensure_prepared(path, cache, max_ind_range=9) == found


def test_an_out_dir_converted_before_the_toolkit_is_converted_again_with_one_line(tmp_path, caplog):
    path = write_lines(tmp_path / "e.txt", synthetic_lines(30))
    out = prepare_criteo(path, tmp_path / "out", max_ind_range=9)
    _as_before_the_toolkit(out)
    caplog.clear()
    with caplog.at_level("INFO", logger="recforge.data.prepared_dir"):
        assert prepare_criteo(path, out, max_ind_range=9) == out
    assert [r.getMessage() for r in caplog.records if r.name == "recforge.data.prepared_dir"] == [
        f"rebuilding {out}: its metadata.json records other inputs or settings than this run's"]
    assert read_metadata(out)["source"]["inputs"][0]["size"] == path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.txt", "out"]


def test_an_out_dir_of_the_synthetic_generator_is_converted_over(tmp_path):
    from recforge.data.criteo.synthetic import SyntheticCriteoConfig, write_synthetic_criteo

    path = write_lines(tmp_path / "e.txt", synthetic_lines(30))
    out = write_synthetic_criteo(SyntheticCriteoConfig(n_rows=200), tmp_path / "out")
    assert prepare_criteo(path, out, max_ind_range=9) == out
    assert read_metadata(out)["cardinalities"] == [10] * 26


def test_malformed_lines_are_shown_on_the_console_by_file_and_line(tmp_path, caplog):
    lines = synthetic_lines(3000)
    lines[9] = "1\t2"  # line 10: too few fields
    lines[99] = "7" + lines[99][1:]  # line 100: a label that is not 0 or 1
    path = write_lines(tmp_path / "train.txt", lines)
    with caplog.at_level("WARNING", logger="recforge.data.criteo.prepare"):
        out = prepare_criteo(path, tmp_path / "out", max_ind_range=50)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    shown = [line for line in warnings[0].splitlines() if line.startswith(f"  {path}:")]
    assert [int(s.split(":")[1]) for s in shown] == [10, 100]
    assert all(s.split(": ", 1)[1] for s in shown)  # each with its reason
    assert warnings[0].startswith("2 malformed lines skipped")
    assert str(Path(out) / "metadata.json") in warnings[0]

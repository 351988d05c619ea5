"""Full-size stand-ins of ml-20m and Amazon Books (recforge.data.sequences.fullsize) and their CLI.

Checked at tiny fractions against what the real files look like (the real samples in
shared/data, the published layouts) by plain-Python parsing that shares no code with the
generator, and through the project's own readers.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recforge.data.sequences import fullsize
from recforge.data.sequences.fullsize import GENERATORS
from recforge.data.sequences.prepared import load_prepared, read_marker
from recforge.data.sequences.preprocess import DATASETS, prepare, read_ratings
from recforge.errors import UserInputError

REPO = Path(__file__).resolve().parents[3]
# Small enough for a few seconds, large enough that a history of >= 20 distinct movies fits.
ML_FRACTION = 0.004
BOOKS_FRACTION = 0.0005


@pytest.fixture(scope="module")
def ml20m(tmp_path_factory):
    out = tmp_path_factory.mktemp("ml-20m")
    return out, GENERATORS["ml-20m"](out, ML_FRACTION, 7)


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    out = tmp_path_factory.mktemp("books")
    return out, GENERATORS["amzn-books"](out, BOOKS_FRACTION, 7)


def csv_rows(path: Path, header: bool) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return rows[1:] if header else rows


def per_user(rows: list[list[str]], user: int, item: int, time: int) -> dict[str, list[tuple[str, int]]]:
    """Each user's (item, time) in file order."""
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for row in rows:
        out[row[user]].append((row[item], int(row[time])))
    return out


# ---------------------------------------------------------------------------- ml-20m
def test_ml20m_layout_and_counts(ml20m):
    out, summary = ml20m
    assert sorted(p.name for p in out.iterdir()) == ["movies.csv", "ratings.csv"]  # no temporaries
    with open(out / "ratings.csv", "rb") as f:
        assert f.readline() == b"userId,movieId,rating,timestamp\n"
    rows = csv_rows(out / "ratings.csv", header=True)
    assert all(len(r) == 4 for r in rows)
    halves = {f"{k / 2:.1f}" for k in range(1, 11)}
    assert {r[2] for r in rows} <= halves and len({r[2] for r in rows}) >= 8
    users = per_user(rows, 0, 1, 3)
    # the published counts, times the fraction
    assert len(users) == summary["users"] == round(138_493 * ML_FRACTION)
    assert sorted(int(u) for u in users) == list(range(1, len(users) + 1))
    assert len(rows) == summary["rows"]
    assert summary["rated_items"] == len({r[1] for r in rows})
    for events in users.values():
        assert len(events) >= 20  # as in the real file
        assert len({item for item, _ in events}) == len(events)  # nobody rates a movie twice
        times = [t for _, t in events]
        assert times == sorted(times)
        assert 789_652_009 <= times[0] and times[-1] <= 1_427_784_002


def test_ml20m_movies_file(ml20m, shared_data_dir):
    out, summary = ml20m
    rows = csv_rows(out / "movies.csv", header=False)
    assert rows[0] == ["movieId", "title", "genres"]
    movies = rows[1:]
    assert len(movies) == summary["items"] == round(27_278 * ML_FRACTION)
    ids = [int(m[0]) for m in movies]
    assert ids == sorted(set(ids))
    rated = {int(r[1]) for r in csv_rows(out / "ratings.csv", header=True)}
    assert rated < set(ids)  # every rated movie is listed, and some listed ones are never rated
    assert any("," in m[1] for m in movies) and any('"' in m[1] for m in movies)
    # The genre vocabulary is real ml-1m's, with ml-20m's renaming (Children's -> Children) and
    # additions (IMAX, "(no genres listed)"); titles end with the year as the real ones do.
    real = shared_data_dir / "ml-1m" / "movies.dat"
    if not real.is_file():
        pytest.skip(f"ml-1m sample not found at {real}")
    vocabulary = set()
    for line in real.read_text(encoding="latin-1").splitlines():
        vocabulary |= set(line.split("::")[2].split("|"))
    vocabulary = (vocabulary - {"Children's"}) | {"Children", "IMAX", "(no genres listed)"}
    assert {g for m in movies for g in m[2].split("|")} <= vocabulary
    assert all(re.search(r" \(\d{4}\)$", m[1]) for m in movies)


def test_ml20m_prepares_like_the_real_layout(ml20m, shared_data_dir, tmp_path):
    out, summary = ml20m
    prepared = prepare("ml-20m", out, tmp_path / "prepared")
    stats = read_marker(prepared)["stats"]
    assert (stats["users"], stats["items"], stats["rated_items"], stats["events"]) == \
        (summary["users"], summary["items"], summary["rated_items"], summary["rows"])
    # The project's reader gives the generated file the types it gives the real ml-1m sample.
    real = shared_data_dir / "ml-1m" / "ratings.partial.dat.gz"
    if not real.is_file():
        pytest.skip(f"ml-1m sample not found at {real}")
    spec = DATASETS["ml-20m"]
    mine = read_ratings(out / "ratings.csv", spec.ratings_table({}), 10_000)
    theirs = read_ratings(real, DATASETS["ml-1m"].ratings_table({}), 100_000)
    for name in ("users", "items", "timestamps", "ratings"):
        assert getattr(mine, name).dtype == getattr(theirs, name).dtype, name
    assert mine.user_labels.type == theirs.user_labels.type == pa.int64()  # Arrow arrays
    assert mine.item_labels.type == theirs.item_labels.type


# ---------------------------------------------------------------------------- Books
USER_ID = re.compile(r"A[0-9A-Z]{11,20}")
ASIN = re.compile(r"[0-9]{9}[0-9X]|B[0-9A-Z]{9}")


def isbn10_valid(asin: str) -> bool:
    digits = [10 if c == "X" else int(c) for c in asin]
    return sum((10 - i) * d for i, d in enumerate(digits)) % 11 == 0


def test_books_layout_matches_the_real_sample(books, shared_data_dir):
    out, summary = books
    assert [p.name for p in out.iterdir()] == ["ratings_Books.csv"]
    rows = csv_rows(out / "ratings_Books.csv", header=False)
    assert len(rows) == summary["rows"] == round(22_507_155 * BOOKS_FRACTION)
    assert all(len(r) == 4 for r in rows)
    assert all(USER_ID.fullmatch(r[0]) and ASIN.fullmatch(r[1]) for r in rows)
    assert all(isbn10_valid(r[1]) for r in rows if not r[1].startswith("B"))
    assert any(r[1].startswith("B00") for r in rows)
    assert {r[2] for r in rows} == {"1.0", "2.0", "3.0", "4.0", "5.0"}
    assert all(int(r[3]) % 86_400 == 0 for r in rows)  # whole days, as in the real file
    users = per_user(rows, 0, 1, 3)
    assert len(users) == summary["users"] == round(8_026_324 * BOOKS_FRACTION)
    assert len({r[1] for r in rows}) == summary["items"]
    for events in users.values():
        times = [t for _, t in events]
        assert times == sorted(times)
        assert len({item for item, _ in events}) == len(events)
    lengths = Counter(len(e) for e in users.values())
    # heavy-tailed: most users rate once, a few rate hundreds of books
    assert lengths[1] > 0.5 * len(users) and max(lengths) > 100
    # The real sample (2018 layout, item first) has ids, ratings and days of the same form.
    real = shared_data_dir / "amazon" / "Magazine_Subscriptions.sample.csv"
    if not real.is_file():
        pytest.skip(f"Amazon sample not found at {real}")
    real_rows = csv_rows(real, header=False)
    assert all(USER_ID.fullmatch(r[1]) and ASIN.fullmatch(r[0]) for r in real_rows)
    assert {r[2] for r in real_rows} <= {r[2] for r in rows}
    assert all(int(r[3]) % 86_400 == 0 for r in real_rows)


def test_books_reads_like_the_real_sample_and_filters_as_a_naive_count(books, shared_data_dir, tmp_path):
    out, _ = books
    path = out / "ratings_Books.csv"
    rows = csv_rows(path, header=False)
    prepared = load_prepared(prepare("amzn-books", path, tmp_path / "prepared"))
    # the >= 5 one-pass filter, counted by hand
    item_count, user_count = Counter(r[1] for r in rows), Counter(r[0] for r in rows)
    kept = [r for r in rows if item_count[r[1]] >= 5 and user_count[r[0]] >= 5]
    left = Counter(r[0] for r in kept)
    assert sorted(prepared.users) == sorted(u for u, n in left.items() if n >= 5)
    assert list(prepared.item_ids) == sorted({r[1] for r in kept})
    real = shared_data_dir / "amazon" / "Magazine_Subscriptions.sample.csv"
    if not real.is_file():
        pytest.skip(f"Amazon sample not found at {real}")
    mine = read_ratings(path, DATASETS["amzn-books"].ratings_table({"columns": ["user", "item", "rating", "timestamp"]}), 5_000)
    theirs = read_ratings(real, DATASETS["amzn-books"].ratings_table({"columns": ["item", "user", "rating", "timestamp"]}), 5_000)
    for name in ("users", "items", "timestamps", "ratings"):
        assert getattr(mine, name).dtype == getattr(theirs, name).dtype, name
    assert mine.user_labels.type == theirs.user_labels.type
    assert mine.item_labels.type == theirs.item_labels.type


# ---------------------------------------------------------------------------- both
@pytest.mark.parametrize("dataset,fraction", [("ml-20m", 0.002), ("amzn-books", 0.0002)])
def test_same_seed_same_bytes(dataset, fraction, tmp_path):
    a = GENERATORS[dataset](tmp_path / "a", fraction, 3)
    b = GENERATORS[dataset](tmp_path / "b", fraction, 3)
    c = GENERATORS[dataset](tmp_path / "c", fraction, 4)
    for name in a["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    main = next(iter(a["files"]))
    assert (tmp_path / "a" / main).read_bytes() != (tmp_path / "c" / main).read_bytes()


def test_counts_scale_with_the_fraction(tmp_path):
    small = GENERATORS["amzn-books"](tmp_path / "s", 0.0002, 0)
    large = GENERATORS["amzn-books"](tmp_path / "l", 0.0004, 0)
    assert (small["rows"], small["users"]) == (round(22_507_155 * 0.0002), round(8_026_324 * 0.0002))
    assert (large["rows"], large["users"]) == (round(22_507_155 * 0.0004), round(8_026_324 * 0.0004))
    assert 1.6 < large["items"] / small["items"] < 2.4
    # MovieLens at a tiny fraction: users and movies scale; a history is at most half the rated
    # catalogue, so the rows fall short of the fraction of 20M and say so
    tiny = GENERATORS["ml-20m"](tmp_path / "m", 0.002, 0)
    assert (tiny["users"], tiny["items"]) == (round(138_493 * 0.002), round(27_278 * 0.002))
    assert tiny["longest_history"] == round(26_744 * 0.002) // 2
    assert tiny["rows"] < round(20_000_263 * 0.002)


def test_history_lengths_hit_the_total_within_bounds():
    rng = np.random.default_rng(0)
    for total in (9_000, 10_000, 12_345):
        lengths = fullsize._fit_total(rng.integers(20, 60, 200), total, 20, 80, rng)
        assert lengths.sum() == total and lengths.min() >= 20 and lengths.max() <= 80
    capped = fullsize._fit_total(np.full(10, 5), 1_000, 1, 50, rng)
    assert capped.tolist() == [50] * 10  # the best [lo, hi] allows


def test_ids_are_distinct_and_well_formed():
    users = fullsize._user_ids(np.arange(200_000, dtype=np.int64), 0).to_pylist()
    assert len(set(users)) == len(users) and all(USER_ID.fullmatch(u) for u in users[:1000])
    asins = fullsize._asins(200_000, 0).to_pylist()
    assert len(set(asins)) == len(asins) and all(ASIN.fullmatch(a) for a in asins[:1000])


def test_a_failure_leaves_no_file_under_the_real_name(tmp_path, monkeypatch):
    monkeypatch.setattr(fullsize, "_CHUNK_ROWS", 2_000)
    calls = {"n": 0}
    real = fullsize._distinct_items

    def fail_on_the_second_chunk(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(fullsize, "_distinct_items", fail_on_the_second_chunk)
    with pytest.raises(OSError):
        GENERATORS["ml-20m"](tmp_path / "out", 0.002, 0)
    assert list((tmp_path / "out").iterdir()) == []


def test_too_small_a_fraction_is_one_line(tmp_path):
    with pytest.raises(UserInputError, match=r"ml-20m: fraction=0.0001 .* expected fraction >= "):
        GENERATORS["ml-20m"](tmp_path, 0.0001, 0)
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(UserInputError, match=r"expected a number in \(0, 1\]"):
            GENERATORS["amzn-books"](tmp_path, bad, 0)


# ---------------------------------------------------------------------------- CLI
def cli():
    spec = importlib.util.spec_from_file_location("fullsize_data", REPO / "benchmarks" / "fullsize_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_writes_and_reports(tmp_path, capsys):
    assert cli().main(["amzn-books", "--out", str(tmp_path / "b"), "--fraction", "0.0002",
                       "--seed", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["dataset"] == "amzn-books" and summary["rows"] == round(22_507_155 * 0.0002)
    assert summary["files"] == {"ratings_Books.csv": (tmp_path / "b" / "ratings_Books.csv").stat().st_size}
    assert "ratings_Books.csv" in lines[0]


@pytest.mark.parametrize("args,message", [
    (["--out", str(REPO / "data" / "fullsize-refused")], "inside the repository"),
    (["--out", "{tmp}", "--fraction", "0"], r"--fraction 0.0: expected a number in \(0, 1\]"),
    (["--out", "{tmp}", "--fraction", "2"], r"--fraction 2.0: expected a number in \(0, 1\]"),
])
def test_cli_refusals_are_one_line(args, message, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as info:
        cli().main(["ml-20m", *args])
    assert re.search(message, str(info.value)) and "\n" not in str(info.value)
    assert str(info.value).startswith("recforge: ")
    assert not (REPO / "data" / "fullsize-refused").exists()


@pytest.mark.parametrize("dataset,fraction", [
    ("ml-20m", 0.002), ("amzn-books", 0.0002), ("criteo-kaggle", 0.0001), ("criteo-day", 0.00002),
])
def test_cli_last_line_names_the_directory_and_rows_of_every_dataset(dataset, fraction, tmp_path, capsys):
    # benchmarks/scale.py reads "rows" from this line and the printed summary reads "out"
    out = tmp_path / dataset
    assert cli().main([dataset, "--out", str(out), "--fraction", str(fraction)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["out"] == str(out.resolve()) and lines[0].startswith(f"{out.resolve()}: ")
    assert summary["rows"] > 0 and summary["dataset"] == dataset

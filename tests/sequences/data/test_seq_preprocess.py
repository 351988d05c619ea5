"""Raw ratings -> prepared histories (recforge.data.sequences.preprocess).

Expected values are worked out by hand next to each input, or by a naive pure-Python reference
(group by user with plain dicts, Python's stable sort) that shares no code with the module.
"""
from __future__ import annotations

import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from processes import run_child

import recforge.data.sequences.prepared as prepared_module
from recforge.data.sequences.prepared import (
    MARKER_FILE,
    PreparedDataError,
    load_prepared,
    read_marker,
)
from recforge.data.sequences.preprocess import RatingsDataError, main, prepare
from recforge.errors import UserInputError


def write(path: Path, lines: list[str], newline: str = "\n", encoding: str = "utf-8") -> Path:
    data = "".join(line + newline for line in lines).encode(encoding)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def naive(rows, numeric: bool, extra_items=(), k: int = 0):
    """rows: (user, item, rating, timestamp) strings in file order -> what the files must hold."""
    key = int if numeric else str
    if k:
        item_count = Counter(r[1] for r in rows)
        user_count = Counter(r[0] for r in rows)
        rows = [r for r in rows if item_count[r[1]] >= k and user_count[r[0]] >= k]
        catalogue = {key(r[1]) for r in rows}
    else:
        catalogue = {key(r[1]) for r in rows} | {key(i) for i in extra_items}
    item_ids = sorted(catalogue)
    index = {item: j for j, item in enumerate(item_ids)}
    per_user = defaultdict(list)
    for user, item, rating, ts in rows:
        per_user[key(user)].append((index[key(item)], int(ts), float(rating)))
    users = sorted(u for u, events in per_user.items() if len(events) >= k)
    histories = {u: sorted(per_user[u], key=lambda e: e[1]) for u in users}  # stable
    counts = Counter(j for u in users for j, _, _ in histories[u])
    return {
        "users": [str(u) for u in users],
        "items": [[e[0] for e in histories[u]] for u in users],
        "timestamps": [[e[1] for e in histories[u]] for u in users],
        "ratings": [[e[2] for e in histories[u]] for u in users],
        "item_ids": [str(i) for i in item_ids],
        "counts": [counts.get(j, 0) for j in range(len(item_ids))],
    }


def files_content(out: Path):
    h = pq.read_table(out / "histories.parquet").to_pydict()
    items = pq.read_table(out / "items.parquet").to_pydict()
    assert items["item"] == list(range(len(items["item"])))
    return {
        "users": h["user"],
        "items": h["items"],
        "timestamps": h["timestamps"],
        "ratings": h["ratings"],
        "item_ids": items["item_id"],
        "counts": items["count"],
    }


def test_schema_is_the_documented_one(tmp_path):
    raw = write(tmp_path / "ratings.dat", ["1::5::3::10", "1::6::4::11"])
    out = prepare("ml-1m", raw, tmp_path / "out")
    schema = pq.read_schema(out / "histories.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        ("user", "string"), ("items", "list<element: int32>"),
        ("timestamps", "list<element: int64>"), ("ratings", "list<element: float>"),
    ]
    schema = pq.read_schema(out / "items.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        ("item", "int32"), ("item_id", "string"), ("count", "int64")]


# ---------------------------------------------------------------------------- MovieLens
ML1M_RATINGS = [
    "10::3::4::100",
    "9::2::5::50",
    "10::1::3::90",
    "10::20::2::100",  # same second as movie 3: stays after it (file order)
    "9::3::1::40",
]
ML1M_MOVIES = ["1::Toy Story (1995)::Animation", "2::Jumanji (1995)::Adventure",
               "3::Grumpier Old Men (1995)::Comedy", "7::Sabrina (1995)::Comedy|Romance",
               "20::Money Train (1995)::Action"]


@pytest.mark.parametrize("gz", [False, True])
def test_ml1m_by_hand(tmp_path, gz):
    ratings = write(tmp_path / ("ratings.dat.gz" if gz else "ratings.dat"), ML1M_RATINGS, "\r\n")
    movies = write(tmp_path / "movies.dat", ML1M_MOVIES, encoding="latin-1")
    out = prepare("ml-1m", [ratings, movies], tmp_path / "out", chunksize=2)
    # Users in numeric order (9 before 10); catalogue = movies.dat's ids, numeric order; movie 7
    # is never rated: index 3, count 0. Movie index: 1->0, 2->1, 3->2, 7->3, 20->4.
    assert files_content(out) == {
        "users": ["9", "10"],
        "items": [[2, 1], [0, 2, 4]],
        "timestamps": [[40, 50], [90, 100, 100]],
        "ratings": [[1.0, 5.0], [3.0, 4.0, 2.0]],
        "item_ids": ["1", "2", "3", "7", "20"],
        "counts": [1, 1, 2, 0, 1],
    }
    marker = read_marker(out)
    assert marker["stats"] == {
        "users": 2, "items": 5, "rated_items": 4, "events": 5,
        "raw_events": 5, "raw_users": 2, "raw_items": 5,
    }
    assert marker["dataset"] == "ml-1m" and marker["params"] == {"min_interactions": 0}
    assert [i["path"] for i in marker["inputs"]] == [str(ratings.resolve()), str(movies.resolve())]


def test_gzip_is_told_by_its_bytes_not_its_name(tmp_path):
    plain = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    expected = files_content(prepare("ml-1m", plain, tmp_path / "plain"))
    plain_named_gz = tmp_path / "renamed" / "ratings.dat.gz"
    plain_named_gz.parent.mkdir()
    plain_named_gz.write_bytes(plain.read_bytes())
    gzip_named_plain = tmp_path / "packed" / "ratings.dat"
    gzip_named_plain.parent.mkdir()
    gzip_named_plain.write_bytes(gzip.compress(plain.read_bytes()))
    assert expected["users"] == ["9", "10"]
    for path in (plain_named_gz, gzip_named_plain):
        assert files_content(prepare("ml-1m", path, path.parent / "out")) == expected


def test_ml1m_without_movies_file_keeps_rated_items_only(tmp_path, caplog):
    ratings = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    out = prepare("ml-1m", ratings, tmp_path / "out")
    assert files_content(out)["item_ids"] == ["1", "2", "3", "20"]
    assert "no items file given" in caplog.text


def test_ml1m_ratings_file_alone_takes_the_movies_file_beside_it(tmp_path, caplog):
    ratings = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    write(tmp_path / "movies.dat", ML1M_MOVIES)
    with caplog.at_level("INFO"):
        out = prepare("ml-1m", ratings, tmp_path / "out")
    assert files_content(out)["item_ids"] == ["1", "2", "3", "7", "20"]  # 7: never rated
    assert "found beside the ratings file" in caplog.text


def test_ml1m_directory_finds_public_names(tmp_path):
    write(tmp_path / "ratings.dat", ML1M_RATINGS)
    write(tmp_path / "movies.dat", ML1M_MOVIES)
    out = prepare("ml-1m", tmp_path, tmp_path / "out")
    assert files_content(out)["item_ids"] == ["1", "2", "3", "7", "20"]
    with pytest.raises(RatingsDataError, match=r"no ml-20m ratings file there; expected ratings\.csv"):
        prepare("ml-20m", tmp_path, tmp_path / "out2")


def test_ml20m_by_hand(tmp_path):
    ratings = write(tmp_path / "ratings.csv", [
        "userId,movieId,rating,timestamp", "2,10,4.5,1200", "1,10,3.0,1100", "2,5,0.5,1000"])
    movies = write(tmp_path / "movies.csv", [
        "movieId,title,genres", '5,"American President, The (1995)",Comedy',
        "10,GoldenEye (1995)|Action", '131262,"Innocence, ""the"" (2014)",Adventure'])
    out = prepare("ml-20m", [ratings, movies], tmp_path / "out")
    assert files_content(out) == {
        "users": ["1", "2"],
        "items": [[1], [0, 1]],
        "timestamps": [[1100], [1000, 1200]],
        "ratings": [[3.0], [0.5, 4.5]],
        "item_ids": ["5", "10", "131262"],
        "counts": [1, 2, 0],
    }


# ---------------------------------------------------------------------------- Amazon
# min_interactions=2. Raw item counts: b1 3, b2 2, b3 2, b4 2, bx 2, b5 1, b7 1; users: A 3, B 2,
# C 1, D 2, E 3, F 2. One pass drops C (1 rating), b5 and b7; D and F are left with [bx] only and
# go afterwards, but bx stays in the catalogue (the pass fixed it) with no interaction. An
# iterated k-core would have dropped bx too.
AMAZON = [
    ("A", "b1", "5.0", "10"), ("A", "b2", "4.0", "30"), ("A", "b3", "3.0", "20"),
    ("B", "b2", "2.0", "5"), ("B", "b1", "1.0", "5"),  # a tie: file order
    ("C", "b4", "5.0", "1"),
    ("D", "bx", "5.0", "7"), ("D", "b5", "5.0", "8"),
    ("E", "b4", "4.0", "3"), ("E", "b1", "4.0", "2"), ("E", "b3", "4.0", "4"),
    ("F", "bx", "3.0", "9"), ("F", "b7", "3.0", "9"),
]
AMAZON_EXPECTED = {
    "users": ["A", "B", "E"],
    "items": [[0, 2, 1], [1, 0], [0, 3, 2]],
    "timestamps": [[10, 20, 30], [5, 5], [2, 3, 4]],
    "ratings": [[5.0, 3.0, 4.0], [2.0, 1.0], [4.0, 4.0, 4.0]],
    "item_ids": ["b1", "b2", "b3", "b4", "bx"],
    "counts": [3, 2, 2, 1, 0],
}


def test_amazon_one_pass_filter_by_hand(tmp_path):
    raw = write(tmp_path / "ratings_Books.csv", [",".join(r) for r in AMAZON])
    out = prepare("amzn-books", raw, tmp_path / "out", min_interactions=2)
    assert files_content(out) == AMAZON_EXPECTED
    assert files_content(out) == naive(AMAZON, numeric=False, k=2)
    stats = read_marker(out)["stats"]
    assert (stats["users"], stats["items"], stats["events"]) == (3, 5, 8)
    assert (stats["raw_users"], stats["raw_items"], stats["raw_events"]) == (6, 7, 13)


def test_amazon_2018_column_order(tmp_path):
    raw = write(tmp_path / "mags.csv", [f"{i},{u},{r},{t}" for u, i, r, t in AMAZON], "\r\n")
    out = prepare("amzn-books", raw, tmp_path / "out", min_interactions=2,
                  columns=["item", "user", "rating", "timestamp"])
    assert files_content(out) == AMAZON_EXPECTED


def test_amazon_default_needs_five(tmp_path):
    raw = write(tmp_path / "ratings_Books.csv", [",".join(r) for r in AMAZON])
    with pytest.raises(RatingsDataError, match="no user is left after keeping users and items with at least 5"):
        prepare("amzn-books", raw, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("columns", [["user", "item", "rating"], ["user", "item", "rating", "ts"]])
def test_amazon_bad_columns_parameter(tmp_path, columns):
    raw = write(tmp_path / "r.csv", ["a,b,5,1"])
    with pytest.raises(UserInputError, match=r"columns=.*expected the four names"):
        prepare("amzn-books", raw, tmp_path / "out", columns=columns)


# ---------------------------------------------------------------------------- real samples
def test_real_ml1m_prefix_matches_the_naive_reference(shared_data_dir, tmp_path):
    folder = shared_data_dir / "ml-1m"
    ratings, movies = folder / "ratings.partial.dat.gz", folder / "movies.dat"
    if not ratings.is_file() or not movies.is_file():
        pytest.skip(f"ml-1m sample not found in {folder}")
    out = prepare("ml-1m", [ratings, movies], tmp_path / "ml-1m", chunksize=100_000)
    stats = read_marker(out)["stats"]
    # shared/data/README.md: 2,999 users, 3,615 rated movies, 3,883 in movies.dat, 487,650 ratings.
    assert (stats["users"], stats["rated_items"], stats["items"], stats["events"]) == \
        (2999, 3615, 3883, 487650)
    with gzip.open(ratings, "rt") as f:
        rows = [tuple(line.rstrip("\n").split("::")) for line in f]
    with open(movies, encoding="latin-1") as f:
        movie_ids = [line.split("::")[0] for line in f]
    expected = naive(rows, numeric=True, extra_items=movie_ids)
    got = files_content(out)
    for key in expected:
        assert got[key] == expected[key], key
    h = load_prepared(out)
    assert h.item_ids[0] == "1" and h.item_ids[-1] == "3952"


def test_real_amazon_sample(shared_data_dir, tmp_path):
    path = shared_data_dir / "amazon" / "Magazine_Subscriptions.sample.csv"
    if not path.is_file():
        pytest.skip(f"Amazon sample not found at {path}")
    order = ["item", "user", "rating", "timestamp"]
    # A 546-row head: nobody has 5 ratings, so the spec's filter leaves no one.
    with pytest.raises(RatingsDataError, match="no user is left"):
        prepare("amzn-books", path, tmp_path / "five", columns=order)
    out = prepare("amzn-books", path, tmp_path / "all", columns=order, min_interactions=0)
    with open(path, newline="") as f:
        rows = [tuple(line.rstrip("\r\n").split(",")) for line in f]
    rows = [(u, i, r, t) for i, u, r, t in rows]
    assert files_content(out) == naive(rows, numeric=False)
    assert read_marker(out)["stats"]["events"] == 546
    # With the 2014 order the same file reads items as users: the first line's item id appears
    # among the users.
    swapped = prepare("amzn-books", path, tmp_path / "swapped", min_interactions=0)
    assert "B00005N7P0" in load_prepared(swapped).users


# ---------------------------------------------------------------------------- bad input
BAD_INPUTS = [
    # (dataset, file name, lines, expected in the message)
    ("ml-1m", "ratings.dat", ["1,1193,5,978300760"],
     "line 1: expected at least 4 fields separated by '::' (UserID::MovieID::Rating::Timestamp, "
     "no header)"),
    ("ml-1m", "ratings.dat", ["1::1193::5::978300760", "1::661::3::978302109", "u2::3408::4::978298413"],
     "line 3, column 1 (UserID): expected an integer user id, got 'u2'"),
    ("ml-1m", "ratings.dat", ["1::1193::5::978300760", "1::m661::3::978302109"],
     "line 2, column 2 (MovieID): expected an integer movie id, got 'm661'"),
    ("ml-1m", "ratings.dat", ["1::1193::5::978300760", "1::661::3::2000-12-31"],
     "line 2, column 4 (Timestamp): expected an integer timestamp (Unix seconds), got '2000-12-31'"),
    ("ml-1m", "ratings.dat", ["1::1193::five::978300760"],
     "line 1, column 3 (Rating): expected a rating (a finite number), got 'five'"),
    ("ml-20m", "ratings.csv", ["userId,movieId,rating", "1,2,3.5"],
     "line 1 (header): missing column(s) ['timestamp']"),
    ("ml-20m", "ratings.csv", ["userId\tmovieId\trating\ttimestamp", "1\t2\t3.5\t4"],
     "(the file must be separated by ',')"),
    ("ml-20m", "ratings.csv", ["userId,movieId,rating,timestamp", "1,2,3.5,4", "1,2,3.5,"],
     "line 3, column 4 (timestamp): expected an integer timestamp (Unix seconds), got an empty"),
    ("amzn-books", "ratings_Books.csv", ["A1,B1,5.0,100", "A2,B1,4.0,1e9x"],
     "line 2, column 4 (timestamp): expected an integer timestamp (Unix seconds), got '1e9x'"),
    ("amzn-books", "ratings_Books.csv", ["A1,B1,5.0,100", ",B1,4.0,100"],
     "line 2, column 1 (user): expected a non-empty user id, got an empty or missing field"),
    ("amzn-books", "ratings_Books.csv", ["A1;B1;5.0;100"],
     "line 1: expected at least 4 fields separated by ','"),
    ("amzn-books", "ratings_Books.csv", [], "line 1: the file is empty"),
    ("ml-20m", "ratings.csv", ["userId,movieId,rating,timestamp"], ": no data rows"),
    # a negative time is a placeholder: HSTU's time bias would bucket it without a sign
    ("ml-1m", "ratings.dat", ["1::1193::5::978300760", "1::661::3::-1"],
     "line 2, column 4 (Timestamp): expected an integer timestamp (Unix seconds) >= 0, got -1"),
    ("ml-20m", "ratings.csv", ["userId,movieId,rating,timestamp", "1,2,3.5,4", "", "1,3,3.5,-86400"],
     "line 4, column 4 (timestamp): expected an integer timestamp (Unix seconds) >= 0, got -86400"),
]


@pytest.mark.parametrize("dataset,name,lines,expected", BAD_INPUTS)
def test_bad_input_names_file_line_and_expectation(tmp_path, dataset, name, lines, expected):
    raw = write(tmp_path / name, lines)
    out = tmp_path / "out"
    with pytest.raises(RatingsDataError) as info:
        prepare(dataset, raw, out, chunksize=2)
    message = str(info.value)
    assert message.startswith(str(raw)) and expected in message
    assert "\n" not in message
    assert isinstance(info.value, UserInputError)
    assert not out.exists()  # nothing half-written


def test_bad_movies_file(tmp_path):
    ratings = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    movies = write(tmp_path / "movies.dat", ["1::Toy Story (1995)::Animation", "two::Jumanji::X"])
    with pytest.raises(RatingsDataError, match=r"movies\.dat, line 2, column 1 \(MovieID\): expected an integer movie id, got 'two'"):
        prepare("ml-1m", [ratings, movies], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_input_leaves_an_existing_preparation_alone(tmp_path):
    good = write(tmp_path / "good.dat", ML1M_RATINGS)
    out = prepare("ml-1m", good, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = write(tmp_path / "bad.dat", ["1::2::3::x"])
    with pytest.raises(RatingsDataError):
        prepare("ml-1m", bad, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_argument_errors(tmp_path):
    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    with pytest.raises(UserInputError, match="unknown dataset 'ml-100k'"):
        prepare("ml-100k", raw, tmp_path / "o")
    with pytest.raises(UserInputError, match=r"unknown parameter\(s\) \['columns'\]"):
        prepare("ml-1m", raw, tmp_path / "o", columns=["user"])
    with pytest.raises(UserInputError, match="min_interactions must be an integer >= 0"):
        prepare("ml-1m", raw, tmp_path / "o", min_interactions=-1)
    with pytest.raises(UserInputError, match="amzn-books takes the ratings file"):
        prepare("amzn-books", [raw, raw], tmp_path / "o")
    with pytest.raises(RatingsDataError, match="missing.dat does not exist"):
        prepare("ml-1m", tmp_path / "missing.dat", tmp_path / "o")


# ---------------------------------------------------------------------------- marker and reuse
def test_reused_while_inputs_and_parameters_are_unchanged(tmp_path, monkeypatch):
    import recforge.data.sequences.preprocess as pp

    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    out = tmp_path / "out"
    calls = []
    original = pp.write_prepared

    def spy(directory, histories, **kwargs):
        calls.append(kwargs["params"])
        return original(directory, histories, **kwargs)

    write_parquet = prepared_module.pq.write_table

    def parquet_spy(table, path, **kwargs):
        assert not (out / MARKER_FILE).exists(), "marker present while writing"
        return write_parquet(table, path, **kwargs)

    monkeypatch.setattr(pp, "write_prepared", spy)
    monkeypatch.setattr(prepared_module.pq, "write_table", parquet_spy)
    prepare("ml-1m", raw, out)
    prepare("ml-1m", raw, out)
    assert len(calls) == 1
    prepare("ml-1m", raw, out, min_interactions=1)  # other parameters: redone
    assert len(calls) == 2
    raw.write_text(raw.read_text() + "11::1::4::5\n")  # other input: redone
    prepare("ml-1m", raw, out, min_interactions=1)
    assert len(calls) == 3 and load_prepared(out).users.tolist() == ["9", "10", "11"]
    prepare("ml-1m", raw, out, min_interactions=1, force=True)
    assert len(calls) == 4
    marker_time = (out / MARKER_FILE).stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= marker_time for p in out.iterdir())


def test_crash_while_writing_leaves_no_marker_and_no_temporary(tmp_path, monkeypatch):
    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    out = prepare("ml-1m", raw, tmp_path / "out")
    original = prepared_module.pq.write_table

    def crash_on_items(table, where, **kwargs):
        if "items.parquet" in str(where):
            Path(where).write_bytes(b"partial")
            raise OSError("disk full")
        return original(table, where, **kwargs)

    monkeypatch.setattr(prepared_module.pq, "write_table", crash_on_items)
    with pytest.raises(PreparedDataError, match=rf"^{out}: writing the prepared histories failed \(disk full\)"):
        prepare("ml-1m", raw, out, force=True)
    assert read_marker(out) is None
    assert sorted(p.name for p in out.iterdir()) == ["histories.parquet", "items.parquet"]
    monkeypatch.undo()
    with pytest.raises(UserInputError, match="has no done.json"):
        load_prepared(out)


def test_marker_of_another_format_is_refused(tmp_path):
    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    out = prepare("ml-1m", raw, tmp_path / "out")
    marker = json.loads((out / MARKER_FILE).read_text())
    marker["version"] = 99
    (out / MARKER_FILE).write_text(json.dumps(marker))
    with pytest.raises(UserInputError, match="version 99; expected 'recforge-histories' version 1"):
        load_prepared(out, "data.prepared_dir")


# ---------------------------------------------------------------------------- command line
def test_cli(tmp_path, capsys):
    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    movies = write(tmp_path / "movies.dat", ML1M_MOVIES)
    out = tmp_path / "out"
    assert main(["ml-1m", "--raw", str(raw), str(movies), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [
        str(out), "users=2", "items=5", "rated_items=4", "events=5"]
    with pytest.raises(SystemExit, match=r"^recforge: .*nope\.dat does not exist"):
        main(["ml-1m", "--raw", str(tmp_path / "nope.dat"), "--out", str(out)])
    books = write(tmp_path / "mags.csv", [f"{i},{u},{r},{t}" for u, i, r, t in AMAZON])
    assert main(["amzn-books", "--raw", str(books), "--out", str(tmp_path / "b"),
                 "--columns", "item,user,rating,timestamp", "--min-interactions", "2"]) == 0
    assert "events=8" in capsys.readouterr().out


def test_module_runs_as_a_script(tmp_path):
    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    result = run_child(
        [sys.executable, "-m", "recforge.data.sequences.preprocess", "ml-1m", "--raw", str(raw),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "users=2" in result.stdout
    assert np.array_equal(load_prepared(tmp_path / "out").offsets, [0, 2, 5])


def test_a_directory_prepared_before_the_toolkit_is_read_as_it_is(tmp_path, monkeypatch, caplog):
    import recforge.data.sequences.preprocess as pp

    raw = write(tmp_path / "ratings.dat", ML1M_RATINGS)
    out = prepare("ml-1m", raw, tmp_path / "out")
    expected = files_content(out)
    st = raw.stat()
    # done.json exactly as sequences/prepared.py wrote it before prepared_dir existed
    old_marker = {
        "created": "2026-11-30T08:00:00+00:00",
        "dataset": "ml-1m",
        "files": {"histories": "histories.parquet", "items": "items.parquet"},
        "format": "recforge-histories",
        "inputs": [{"mtime_ns": st.st_mtime_ns, "path": str(raw.resolve()), "size": st.st_size}],
        "params": {"min_interactions": 0},
        "stats": {"events": 5, "items": 4, "rated_items": 4, "users": 2},
        "version": 1,
    }
    (out / MARKER_FILE).write_text(json.dumps(old_marker, indent=2, sort_keys=True) + "\n")

    def refuse(*args, **kwargs):
        raise AssertionError("an up-to-date directory was written again")

    monkeypatch.setattr(pp, "write_prepared", refuse)
    caplog.clear()
    with caplog.at_level("INFO", logger="recforge"):
        assert prepare("ml-1m", raw, out) == out
    assert [r.getMessage() for r in caplog.records] == [f"{out} is up to date"]
    assert files_content(out) == expected and read_marker(out) == old_marker

"""The shared delimited-text reader (recforge.data.delimited): layouts, encodings and the errors
that name file, line and field. Each input is written here by hand; expected values are read off
the text."""
from __future__ import annotations

import csv
import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import recforge.data.delimited as delimited
from recforge.data.delimited import Col, DelimitedFileError, Table, iter_chunks, read_table
from recforge.errors import UserInputError

RATINGS = Table(
    description="ratings (user::item::rating::time, no header)",
    sep="::",
    has_header=False,
    cols=(
        Col("user", "int", ("UserID",), position=0),
        Col("item", "text", ("MovieID",), position=1),
        Col("rating", "float", ("Rating",), position=2),
        Col("time", "int", ("Timestamp",), position=3, expected="an integer timestamp"),
    ),
    quoting=csv.QUOTE_NONE,
)
HEADED = Table(
    description="ratings.csv",
    sep=",",
    has_header=True,
    cols=(
        Col("user", "int", ("userId",)),
        Col("item", "int", ("movieId", "itemId")),
        Col("time", "int", ("timestamp",)),
    ),
)


def write(path: Path, text: str, *, gz: bool = False, encoding: str = "utf-8") -> Path:
    data = text.encode(encoding)
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def rows(frame: pd.DataFrame, keys: list[str]) -> list[tuple]:
    return [tuple(r) for r in frame[keys].itertuples(index=False)]


ML_TEXT = "1::1193::5::978300760\n1::661::3.5::978302109\n2::3408::4::978298413\n"
ML_ROWS = [(1, "1193", 5.0, 978300760), (1, "661", 3.5, 978302109), (2, "3408", 4.0, 978298413)]


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_double_colon_gzip_and_crlf(tmp_path, gz, newline):
    path = write(tmp_path / ("r.dat.gz" if gz else "r.dat"), ML_TEXT.replace("\n", newline), gz=gz)
    frame = read_table(path, RATINGS)
    assert rows(frame, ["user", "item", "rating", "time"]) == ML_ROWS
    assert frame["user"].dtype == np.int64 and frame["time"].dtype == np.int64
    assert frame["rating"].dtype == np.float64


def test_separator_cut_by_a_block_boundary(tmp_path, monkeypatch):
    # Blocks of 1 to 7 bytes cut '::' (and ':::' below) at every possible place.
    text = "10::a:b::1::5\n11::x:::2::6\n12::::3::7\n"
    path = write(tmp_path / "cut.dat", text)
    expected = [
        [f.replace("::", "\x00") for f in line.split("::")] for line in text.splitlines()
    ]
    table = Table("t", "::", False, tuple(
        Col(f"c{i}", "text", (f"C{i}",), position=i, nonempty=False) for i in range(4)
    ), quoting=csv.QUOTE_NONE)
    for block in range(1, 8):
        monkeypatch.setattr(delimited, "_BLOCK", block)
        frame = read_table(path, table)
        got = [list(r) for r in frame[["c0", "c1", "c2", "c3"]].itertuples(index=False)]
        assert got == [[v.replace("\x00", "::") for v in row] for row in expected], block


def test_chunks_cover_the_file_in_order(tmp_path):
    lines = [f"{u}::{100 + u}::{u % 5 + 1}::{1000 + u}" for u in range(23)]
    path = write(tmp_path / "r.dat", "\n".join(lines) + "\n")
    chunks = list(iter_chunks(path, RATINGS, chunksize=5))
    assert [len(c) for c in chunks] == [5, 5, 5, 5, 3]
    assert pd.concat(chunks)["user"].tolist() == list(range(23))


def test_header_by_name_any_order_bom_and_extra_columns(tmp_path):
    path = write(tmp_path / "r.csv", "\ufefftimestamp,extra,itemId,userId\r\n7,q,30,1\r\n8,r,40,2\r\n")
    frame = read_table(path, HEADED)
    assert rows(frame, ["user", "item", "time"]) == [(1, 30, 7), (2, 40, 8)]


def test_quoted_fields_with_commas(tmp_path):
    table = Table("movies.csv", ",", True, (Col("item", "int", ("movieId",)),
                                            Col("title", "text", ("title",))))
    path = write(tmp_path / "m.csv", 'movieId,title,genres\n1,"Toy Story (1995)",A|B\n'
                 '11,"American President, The (1995)",Comedy\n')
    frame = read_table(path, table)
    assert rows(frame, ["item", "title"]) == [(1, "Toy Story (1995)"),
                                              (11, "American President, The (1995)")]


def test_latin1_text(tmp_path):
    table = Table("movies", "::", False, (Col("item", "int", ("MovieID",), position=0),
                                          Col("title", "text", ("Title",), position=1)),
                  encoding="latin-1", quoting=csv.QUOTE_NONE)
    path = write(tmp_path / "m.dat", '1::Misérables, Les "quoted" (1995)::Drama\n',
                 encoding="latin-1")
    assert read_table(path, table)["title"].tolist() == ['Misérables, Les "quoted" (1995)']


def test_ids_that_look_like_missing_values_stay_text(tmp_path):
    path = write(tmp_path / "r.dat", "1::NA::5::10\n1::null::4::11\n1::007::3::12\n")
    assert read_table(path, RATINGS)["item"].tolist() == ["NA", "null", "007"]


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("text", "line", "column", "field", "expected", "got"),
    [
        ("1::a::5::10\nx::b::4::11\n", 2, 1, "UserID", "an integer", "'x'"),
        ("1::a::5::10\n2::b::4::soon\n", 2, 4, "Timestamp", "an integer timestamp", "'soon'"),
        ("1::a::5::10\n2::b::good::11\n", 2, 3, "Rating", "a finite number", "'good'"),
        ("1::a::5::10\n2::b::inf::11\n", 2, 3, "Rating", "a finite number", "'inf'"),
        ("1::a::5::10\n2::::4::11\n", 2, 2, "MovieID", "a non-empty value", "an empty or missing field"),
        ("1::a::5::10\n2::b::4\n", 2, 4, "Timestamp", "an integer timestamp", "an empty or missing field"),
        ("1::a::5::10\n\n\n3::c::4::1.5\n", 4, 4, "Timestamp", "an integer timestamp", "'1.5'"),
        ("99999999999999999999::a::5::10\n", 1, 1, "UserID", "an integer that fits in int64",
         "99999999999999999999"),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_bad_value_names_file_line_field_and_expectation(
    tmp_path, text, line, column, field, expected, got, gz
):
    path = write(tmp_path / ("bad.dat.gz" if gz else "bad.dat"), text.replace("\n", "\r\n"), gz=gz)
    with pytest.raises(DelimitedFileError) as info:
        list(iter_chunks(path, RATINGS, chunksize=1))
    error = info.value
    assert str(error).startswith(f"{path}, line {line}, column {column} ({field}): expected {expected}, got {got}")
    assert "\n" not in str(error)
    assert (error.line, error.field) == (line, field)
    assert isinstance(error, UserInputError)


def test_the_first_bad_line_wins_across_chunks_and_columns(tmp_path):
    body = "".join(f"{u}::i::5::{u}\n" for u in range(1, 9))
    body += "9::i::5::late\nten::i::5::10\n"
    path = write(tmp_path / "r.dat", body)
    with pytest.raises(DelimitedFileError, match=r"r\.dat, line 9, column 4 \(Timestamp\)"):
        list(iter_chunks(path, RATINGS, chunksize=3))


def test_a_header_in_a_headerless_format_is_named(tmp_path):
    path = write(tmp_path / "h.dat", "UserID::MovieID::Rating::Timestamp\n1::2::3::4\n")
    with pytest.raises(DelimitedFileError, match=r"h\.dat, line 1, column 1 \(UserID\).*no header line"):
        read_table(path, RATINGS)


def test_wrong_separator_headerless(tmp_path):
    path = write(tmp_path / "commas.dat", "1,1193,5,978300760\n")
    with pytest.raises(DelimitedFileError) as info:
        read_table(path, RATINGS)
    message = str(info.value)
    assert message.startswith(f"{path}, line 1: expected at least 4 fields separated by '::'")
    assert "UserID::MovieID::Rating::Timestamp, no header" in message
    assert "the file must be separated by '::'" in message


def test_wrong_separator_with_header(tmp_path):
    path = write(tmp_path / "semi.csv", "userId;movieId;timestamp\n1;2;3\n")
    with pytest.raises(DelimitedFileError) as info:
        read_table(path, HEADED)
    message = str(info.value)
    assert f"{path}, line 1 (header): missing column(s)" in message
    assert "'movieId or itemId'" in message and "the file must be separated by ','" in message


def test_missing_column_lists_what_was_found(tmp_path):
    path = write(tmp_path / "r.csv", "userId,movie,timestamp\n1,2,3\n")
    with pytest.raises(DelimitedFileError) as info:
        read_table(path, HEADED)
    assert "missing column(s) ['movieId or itemId']" in str(info.value)
    assert "found ['userId', 'movie', 'timestamp']" in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("empty.csv", "", r"empty\.csv, line 1: the file is empty"),
        ("header_only.csv", "userId,movieId,timestamp\n", r"header_only\.csv: no data rows after the header"),
    ],
)
def test_empty_files(tmp_path, name, text, match):
    with pytest.raises(DelimitedFileError, match=match):
        read_table(write(tmp_path / name, text), HEADED)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DelimitedFileError, match=r"ratings\.csv file .*nope\.csv does not exist"):
        read_table(tmp_path / "nope.csv", HEADED)
    with pytest.raises(DelimitedFileError, match="is a directory"):
        read_table(tmp_path, HEADED)


def test_gzip_is_told_by_its_bytes_not_its_name(tmp_path):
    plain_named_gz = write(tmp_path / "plain.dat.gz", ML_TEXT)
    gzip_named_plain = write(tmp_path / "packed.dat", ML_TEXT, gz=True)
    for path in (plain_named_gz, gzip_named_plain):
        assert rows(read_table(path, RATINGS), ["user", "item", "rating", "time"]) == ML_ROWS
    cut = tmp_path / "cut.dat"
    whole = gzip.compress((ML_TEXT * 500).encode())
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DelimitedFileError, match=r"cut\.dat: cannot be read as gzip-compressed text"):
        read_table(cut, RATINGS)


def test_invalid_utf8(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("userId,movieId,timestamp\n1,2,3\n".encode() + "é,2,3\n".encode("latin-1"))
    with pytest.raises(DelimitedFileError, match=r"latin\.csv: not valid utf-8 text"):
        read_table(path, HEADED)


def test_stand_in_character_in_a_double_colon_file_is_refused(tmp_path):
    path = write(tmp_path / "ctl.dat", "1::a\x1fb::5::10\n")
    with pytest.raises(DelimitedFileError, match=r"ctl\.dat: contains the control character"):
        read_table(path, RATINGS)


def test_error_class_is_the_callers(tmp_path):
    class MyError(DelimitedFileError):
        pass

    with pytest.raises(MyError):
        read_table(write(tmp_path / "bad.dat", "x::a::5::10\n"), RATINGS, error=MyError)

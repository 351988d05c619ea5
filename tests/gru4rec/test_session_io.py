"""Tests for the GRU4Rec session text format (recforge.data.sessions.io)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recforge.data.sessions.io import SessionFileError, read_session_file, write_session_file

HEADER = "SessionId\tItemId\tTime\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "SessionId": np.array([1, 1, 2, 2, 2, 7], dtype=np.int64),
            # Leading zeros and "NA" must survive as ids, not become numbers or missing values.
            "ItemId": pd.Series(["00123", "b", "x y", "NA", "b", "42"], dtype=object).astype(str),
            "Time": [1396437466.94, 1396437467.1 + 1e-6, 1e-7, 0.1 + 0.2, 3.0, 1396437499.1234567],
        }
    )


def test_round_trip_is_exact(tmp_path: Path) -> None:
    df = _frame()
    path = write_session_file(df, tmp_path / "nested" / "dir" / "sessions.txt")
    assert path.read_text().startswith(HEADER)
    back = read_session_file(path)
    assert list(back.columns) == ["SessionId", "ItemId", "Time"]
    assert back["SessionId"].dtype == np.int64
    assert back["Time"].dtype == np.float64
    assert pd.api.types.is_string_dtype(back["ItemId"])
    pd.testing.assert_frame_equal(back, df)
    # Bit-exact times, not merely close ones.
    assert back["Time"].to_numpy().tobytes() == df["Time"].to_numpy().tobytes()


def test_extra_columns_are_ignored_and_custom_keys_renamed(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.txt", "Extra\tSid\tTs\tIid\nq\t5\t2.5\ta\nr\t5\t1.5\tb\n")
    df = read_session_file(path, session_key="Sid", item_key="Iid", time_key="Ts")
    assert list(df.columns) == ["SessionId", "ItemId", "Time"]
    assert df["ItemId"].tolist() == ["b", "a"]
    assert df["Time"].tolist() == [1.5, 2.5]


def test_unsorted_file_comes_back_sorted_and_stable(tmp_path: Path) -> None:
    rows = [
        (3, "c1", 10.0),
        (1, "a2", 5.0),
        (3, "c0", 9.0),
        (1, "a1", 4.0),
        (1, "tie_first", 7.0),
        (2, "b", 1.0),
        (1, "tie_second", 7.0),
        (1, "tie_third", 7.0),
    ]
    text = HEADER + "".join(f"{s}\t{i}\t{t}\n" for s, i, t in rows)
    df = read_session_file(_write(tmp_path / "unsorted.txt", text))
    assert df["SessionId"].tolist() == [1, 1, 1, 1, 1, 2, 3, 3]
    expected = ["a1", "a2", "tie_first", "tie_second", "tie_third", "b", "c0", "c1"]
    assert df["ItemId"].tolist() == expected
    assert df.index.tolist() == list(range(8))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "no_such_file.txt"
    with pytest.raises(SessionFileError, match="no_such_file.txt.*does not exist"):
        read_session_file(path)


def test_empty_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "empty.txt", "")
    with pytest.raises(SessionFileError, match=r"empty\.txt.*empty"):
        read_session_file(path)


def test_header_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "header_only.txt", HEADER)
    with pytest.raises(SessionFileError, match=r"header_only\.txt.*no data rows"):
        read_session_file(path)


def test_missing_column_lists_header(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad_header.txt", "SessionId\tItem\tTime\n1\ta\t1.0\n")
    with pytest.raises(SessionFileError) as info:
        read_session_file(path)
    msg = str(info.value)
    assert "bad_header.txt" in msg and "line 1" in msg
    assert "'ItemId'" in msg and "['SessionId', 'Item', 'Time']" in msg


def test_comma_separated_file_gets_a_hint(tmp_path: Path) -> None:
    path = _write(tmp_path / "commas.txt", "SessionId,ItemId,Time\n1,a,1.0\n")
    with pytest.raises(SessionFileError, match="tab-separated"):
        read_session_file(path)


@pytest.mark.parametrize(
    ("body", "line", "column"),
    [
        ("1\ta\t1.0\n1\tb\t2.0\nx7\tc\t3.0\n", 4, "SessionId"),
        ("1\ta\t1.0\n2.5\tb\t2.0\n", 3, "SessionId"),
        ("99999999999999999999\ta\t1.0\n", 2, "SessionId"),
        ("1\ta\t1.0\n2\tb\tnoon\n3\tc\tlater\n", 3, "Time"),
        ("1\ta\t1.0\n2\tb\tinf\n", 3, "Time"),
        ("1\ta\t1.0\n2\tb\n", 3, "Time"),  # a short line: Time is missing
        ("1\ta\t1.0\n2\t\t2.0\n", 3, "ItemId"),
        # Blank lines still count, so the reported number matches an editor's.
        ("1\ta\t1.0\n\n\n2\tb\tbad\n", 5, "Time"),
        # The first offending line wins, whichever column it is in.
        ("1\ta\t1.0\n2\tb\tbad\nzz\tc\t3.0\n", 3, "Time"),
    ],
)
def test_bad_values_name_file_line_and_column(
    tmp_path: Path, body: str, line: int, column: str
) -> None:
    path = _write(tmp_path / "bad_values.txt", HEADER + body)
    with pytest.raises(SessionFileError) as info:
        read_session_file(path)
    msg = str(info.value)
    assert "bad_values.txt" in msg
    assert f"line {line}:" in msg
    assert repr(column) in msg


def test_session_file_error_is_value_error() -> None:
    assert issubclass(SessionFileError, ValueError)


def test_write_rejects_frame_without_columns(tmp_path: Path) -> None:
    with pytest.raises(SessionFileError, match="ItemId"):
        write_session_file(pd.DataFrame({"SessionId": [1], "Time": [1.0]}), tmp_path / "x.txt")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_leaves_nothing_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_write(self: pd.DataFrame, handle, *args, **kwargs) -> None:
        handle.write(HEADER + "1\ta\t")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_csv", half_write)
    target = tmp_path / "out" / "sessions.txt"
    with pytest.raises(OSError, match="disk full"):
        write_session_file(_frame(), target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_failed_overwrite_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = write_session_file(_frame(), tmp_path / "sessions.txt")
    before = target.read_bytes()

    def broken(self: pd.DataFrame, handle, *args, **kwargs) -> None:
        handle.write("garbage")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pd.DataFrame, "to_csv", broken)
    with pytest.raises(RuntimeError):
        write_session_file(_frame().iloc[:2], target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["sessions.txt"]


# (file name, rows, sessions, items) from shared/data/README.md
YOOCHOOSE_SAMPLES = [
    ("yoochoose-clicks-100k_test.txt", 13568, 3416, 1771),
    ("yoochoose-clicks-100k_train_tr.txt", 53254, 13629, 2873),
]


@pytest.mark.parametrize(("name", "rows", "sessions", "items"), YOOCHOOSE_SAMPLES)
def test_real_yoochoose_sample(
    shared_data_dir: Path, name: str, rows: int, sessions: int, items: int
) -> None:
    path = shared_data_dir / "yoochoose" / name
    if not path.is_file():
        pytest.skip(f"real YooChoose sample not found at {path} (set RECFORGE_SHARED_DATA)")
    df = read_session_file(path)
    assert len(df) == rows
    assert df["SessionId"].nunique() == sessions
    assert df["ItemId"].nunique() == items
    assert df["SessionId"].is_monotonic_increasing
    assert (df.groupby("SessionId")["Time"].diff().dropna() >= 0).all()
    # ItemIds are kept as strings, exactly as written.
    first_line = path.read_text().splitlines()[1].split("\t")
    assert df["ItemId"].iloc[0] == first_line[1]


@pytest.mark.parametrize("gzipped", [False, True])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("item_last", [False, True])
def test_gzipped_and_crlf_files_read_like_plain_ones(
    tmp_path: Path, gzipped: bool, newline: str, item_last: bool
) -> None:
    import gzip

    frame = _frame()
    columns = ["SessionId", "Time", "ItemId"] if item_last else ["SessionId", "ItemId", "Time"]
    text = frame[columns].to_csv(sep="\t", index=False, lineterminator=newline)
    path = tmp_path / ("s.txt.gz" if gzipped else "s.txt")
    if gzipped:
        with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
            f.write(text)
    else:
        path.write_bytes(text.encode())
    read = read_session_file(path)
    expected = read_session_file(write_session_file(frame, tmp_path / "plain.txt"))
    pd.testing.assert_frame_equal(read, expected)  # no '\r' left on the last column's values


def test_gzip_is_told_by_its_bytes_not_its_name(tmp_path: Path) -> None:
    import gzip

    frame = _frame()
    plain = write_session_file(frame, tmp_path / "plain.txt")
    plain_named_gz = tmp_path / "plain.txt.gz"
    plain_named_gz.write_bytes(plain.read_bytes())
    gzip_named_plain = tmp_path / "packed.txt"
    gzip_named_plain.write_bytes(gzip.compress(plain.read_bytes()))
    expected = read_session_file(plain)
    pd.testing.assert_frame_equal(read_session_file(plain_named_gz), expected)
    pd.testing.assert_frame_equal(read_session_file(gzip_named_plain), expected)


def test_gzipped_crlf_file_names_the_line_of_a_bad_value(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "bad.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
        f.write("SessionId\tItemId\tTime\r\n1\ta\t1.0\r\n1\tb\tsoon\r\n")
    with pytest.raises(SessionFileError, match=r"bad\.txt\.gz, line 3: column 'Time': expected a finite number, got 'soon'"):
        read_session_file(path)

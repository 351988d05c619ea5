"""Preprocessing of raw public datasets into the GRU4Rec format (spec §1.9).

Every expected frame below is worked out by hand from the hand-made input next to it; the comments
say why each row is (or is not) there.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from processes import run_child

import recforge.data.sessions.preprocess as pp
from recforge.data.sessions.io import read_session_file
from recforge.data.sessions.preprocess import (
    DATASETS,
    MARKER_FILE,
    OUTPUT_FILES,
    RawDataError,
    filter_support,
    prepare,
    read_marker,
    remove_consecutive_duplicates,
    rsc15_filter,
    rsc15_split,
    sessionize,
    time_split,
    train_test_valid,
)

Row = tuple[int, str, float]


def frame(rows: list[tuple], extra: str | None = None) -> pd.DataFrame:
    """(SessionId, ItemId, Time) rows; with ``extra``, a leading column of that name."""
    if extra is None:
        return pd.DataFrame(
            {
                "SessionId": pd.Series([r[0] for r in rows], dtype="int64"),
                "ItemId": pd.Series([r[1] for r in rows], dtype=object),
                "Time": pd.Series([r[2] for r in rows], dtype="float64"),
            }
        )
    return pd.DataFrame(
        {
            extra: [r[0] for r in rows],
            "ItemId": pd.Series([r[1] for r in rows], dtype=object),
            "Time": pd.Series([r[2] for r in rows], dtype="float64"),
        }
    )


def rows_of(df: pd.DataFrame) -> list[Row]:
    return [
        (int(s), str(i), float(t))
        for s, i, t in zip(df["SessionId"], df["ItemId"].astype(str), df["Time"])
    ]


def sorted_rows(df: pd.DataFrame) -> list[Row]:
    return sorted(rows_of(df), key=lambda r: (r[0], r[2]))


def file_rows(path: Path) -> list[Row]:
    return rows_of(read_session_file(path, sort=False))


def check_outputs(paths: dict[str, Path], expected: dict[str, list[Row]]) -> None:
    assert set(paths) == {"train_full", "test", "train_tr", "train_valid"}
    for name, want in expected.items():
        assert paths[name].is_file(), name
        assert paths[name].read_text().splitlines()[0] == "SessionId\tItemId\tTime"
        assert file_rows(paths[name]) == want, name
    marker = read_marker(paths["train_full"].parent)
    assert marker is not None
    for name, want in expected.items():
        assert marker["stats"][name] == {
            "events": len(want),
            "sessions": len({r[0] for r in want}),
            "items": len({r[1] for r in want}),
        }


# ================================================================ pure steps


def test_consecutive_duplicates_are_dropped_but_returns_are_kept():
    df = frame(
        [
            (2, "B", 1.0),
            (1, "A", 1.0),
            (1, "A", 2.0),  # repeats the previous item: dropped
            (1, "B", 3.0),
            (2, "A", 2.0),
            (2, "B", 3.0),  # (B, A, B): a return, kept
            # Equal timestamps sort by item, so B, A, B at t=5 becomes A, B, B -> A, B.
            (3, "B", 5.0),
            (3, "A", 5.0),
            (3, "B", 5.0),
        ]
    )
    out = remove_consecutive_duplicates(df)
    # Session 2 starts with B right after session 1 ends with B: different sessions, kept.
    assert rows_of(out) == [
        (1, "A", 1.0),
        (1, "B", 3.0),
        (2, "B", 1.0),
        (2, "A", 2.0),
        (2, "B", 3.0),
        (3, "A", 5.0),
        (3, "B", 5.0),
    ]


def test_sessionize_gap_exactly_one_hour_stays_more_splits_seconds():
    df = frame(
        [
            ("u2", "X", 100.0),
            ("u1", "A", 0.0),
            ("u1", "B", 3600.0),  # exactly 1 h after: same session
            ("u1", "C", 7201.0),  # 1 h + 1 s after: new session
            ("u1", "D", 7300.0),
        ],
        extra="User",
    )
    out = sessionize(df, "User", time_unit="s")
    assert list(out["User"]) == ["u1", "u1", "u1", "u1", "u2"]
    assert rows_of(out) == [
        (0, "A", 0.0),
        (0, "B", 3600.0),
        (1, "C", 7201.0),
        (1, "D", 7300.0),
        (2, "X", 100.0),  # another user always starts a new session
    ]


def test_sessionize_milliseconds_and_custom_gap():
    df = frame(
        [(7, "A", 0.0), (7, "B", 3_600_000.0), (7, "C", 7_200_001.0)], extra="User"
    )
    assert list(sessionize(df, "User", time_unit="ms")["SessionId"]) == [0, 0, 1]
    # Read as seconds, every gap is far over an hour.
    assert list(sessionize(df, "User", time_unit="s")["SessionId"]) == [0, 1, 2]
    half_hour = sessionize(df, "User", time_unit="ms", gap_seconds=1800)
    assert list(half_hour["SessionId"]) == [0, 1, 2]
    with pytest.raises(ValueError, match="time_unit"):
        sessionize(df, "User", time_unit="us")


# Support 2: P and S are rare (round 1), which shortens s1 and s3 to one event; they go in round
# 2, which leaves Q and R with one event each, so they go too and s2 empties. s5, s6 survive.
CASCADE = [
    (1, "P", 1.0), (1, "Q", 2.0),
    (2, "Q", 3.0), (2, "R", 4.0),
    (3, "R", 5.0), (3, "S", 6.0),
    (4, "S", 7.0),
    (5, "T", 8.0), (5, "U", 9.0),
    (6, "T", 10.0), (6, "U", 11.0),
]


def test_filter_support_iterates_until_stable():
    out = filter_support(frame(CASCADE), min_item_support=2)
    assert rows_of(out) == [(5, "T", 8.0), (5, "U", 9.0), (6, "T", 10.0), (6, "U", 11.0)]


def test_filter_support_default_is_five():
    # B has exactly 5 events (kept), C 4 (dropped). Dropping C leaves sessions 6..9 as [A], which
    # go next round; A falls from 9 to 5 events and is still kept.
    rows = []
    for s in range(1, 6):
        rows += [(s, "A", float(10 * s)), (s, "B", float(10 * s + 1))]
    for s in range(6, 10):
        rows += [(s, "A", float(10 * s)), (s, "C", float(10 * s + 1))]
    out = filter_support(frame(rows))
    assert rows_of(out) == rows[:10]
    # With support 4, C survives and so do sessions 6..9.
    assert len(filter_support(frame(rows), min_item_support=4)) == 18


def test_rsc15_filter_is_a_single_pass():
    # Same data as the cascade: one pass leaves s2 = [Q, R] although Q and R now have support 1.
    out = rsc15_filter(frame(CASCADE), min_item_support=2)
    assert rows_of(out) == [
        (2, "Q", 3.0), (2, "R", 4.0),
        (5, "T", 8.0), (5, "U", 9.0),
        (6, "T", 10.0), (6, "U", 11.0),
    ]
    # Default support 5: nothing here reaches it.
    assert rsc15_filter(frame(CASCADE)).empty


# tsplit 100, tday 10: the test boundary is 90, the validation boundary 80.
SPLIT_INPUT = [
    (0, "A", 50.0), (0, "B", 60.0),  # train_tr
    (6, "A", 75.0), (6, "B", 82.0),  # crosses 80: [A] in train_tr, dropped; not in train_valid
    (1, "A", 80.0), (1, "B", 85.0),  # starts exactly at 80: train_valid
    (2, "A", 85.0), (2, "B", 89.0), (2, "C", 95.0),  # crosses 90: truncated to A, B; not in test
    (3, "B", 90.0), (3, "A", 92.0),  # starts exactly at 90: test
    (4, "A", 88.0), (4, "B", 91.0),  # crosses 90: [A] is length 1, dropped; not in test
    (5, "Z", 95.0), (5, "A", 100.0),  # test, with Z never seen in train: kept
]


def test_time_split_boundaries():
    train, test = time_split(frame(SPLIT_INPUT), tsplit=100.0, tday=10.0)
    assert sorted_rows(train) == [
        (0, "A", 50.0), (0, "B", 60.0),
        (1, "A", 80.0), (1, "B", 85.0),
        (2, "A", 85.0), (2, "B", 89.0),
        (6, "A", 75.0), (6, "B", 82.0),
    ]
    assert sorted_rows(test) == [
        (3, "B", 90.0), (3, "A", 92.0),
        (5, "Z", 95.0), (5, "A", 100.0),
    ]


def test_train_test_valid_splits_train_full_at_twice_tday():
    splits = train_test_valid(frame(SPLIT_INPUT), tsplit=100.0, tday=10.0)
    assert sorted_rows(splits["train_tr"]) == [(0, "A", 50.0), (0, "B", 60.0)]
    assert sorted_rows(splits["train_valid"]) == [
        (1, "A", 80.0), (1, "B", 85.0),
        (2, "A", 85.0), (2, "B", 89.0),  # the truncated train_full session
    ]
    assert len(splits["train_full"]) == 8 and len(splits["test"]) == 4


def test_rsc15_split_uses_last_event_and_train_items():
    # Max time 100, tday 10: sessions *ending* at or after 90 are test.
    df = frame(
        [
            (1, "A", 10.0), (1, "B", 20.0),
            (2, "B", 30.0), (2, "C", 40.0),
            (3, "A", 85.0), (3, "C", 95.0),  # starts before 90 but ends after: test, whole
            (4, "A", 92.0), (4, "Z", 94.0),  # Z unknown to train -> [A] -> too short: dropped
            (5, "B", 96.0), (5, "B", 100.0),  # repeated item: no dedup in RSC15
        ]
    )
    train, test = rsc15_split(df, tday=10.0)
    assert rows_of(train) == [(1, "A", 10.0), (1, "B", 20.0), (2, "B", 30.0), (2, "C", 40.0)]
    assert rows_of(test) == [(3, "A", 85.0), (3, "C", 95.0), (5, "B", 96.0), (5, "B", 100.0)]


# ================================================================ end to end, per raw format


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


RSC15_CLICKS = [
    "1,2014-03-30T10:00:00.000Z,100,0",
    "1,2014-03-30T10:00:05.500Z,100,0",  # consecutive repeat: RSC15 keeps it
    "1,2014-03-30T10:01:00.000Z,200,0",
    "2,2014-03-30T11:00:00.000Z,200,0",
    "2,2014-03-30T11:00:30.250Z,300,0",
    "3,2014-04-01T09:00:00.000Z,300,0",
    "3,2014-04-01T09:10:00.000Z,100,0",
    "7,2014-04-01T08:00:00.000Z,200,0",
    "7,2014-04-01T08:30:00.000Z,600,0",
    "7,2014-04-01T08:40:00.000Z,600,0",
    "4,2014-04-01T09:30:00.000Z,999,S",  # one click: dropped
    "5,2014-04-03T12:00:00.000Z,100,0",
    "5,2014-04-03T12:05:00.000Z,300,0",  # the last kept event: tmax
    "6,2014-04-03T12:10:00.000Z,200,0",
    "6,2014-04-03T12:20:00.000Z,400,0",  # 400 has support 1 -> session 6 too short: dropped
    "8,2014-04-02T11:00:00.000Z,300,0",  # starts before the boundary (04-02 12:05) ...
    "8,2014-04-02T13:00:00.000Z,100,0",  # ... but ends after it: test
]
# The second split uses train_full's own last event (04-01 09:10): sessions 3 and 7 end after
# 03-31 09:10 and are validation; 7's item 600 is unknown to train_tr, which leaves [200]: dropped.
RSC15_EXPECTED = {
    "train_full": [
        (1, "100", 1396173600.0), (1, "100", 1396173605.5), (1, "200", 1396173660.0),
        (2, "200", 1396177200.0), (2, "300", 1396177230.25),
        (3, "300", 1396342800.0), (3, "100", 1396343400.0),
        (7, "200", 1396339200.0), (7, "600", 1396341000.0), (7, "600", 1396341600.0),
    ],
    "test": [
        (5, "100", 1396526400.0), (5, "300", 1396526700.0),
        (8, "300", 1396436400.0), (8, "100", 1396443600.0),
    ],
    "train_tr": [
        (1, "100", 1396173600.0), (1, "100", 1396173605.5), (1, "200", 1396173660.0),
        (2, "200", 1396177200.0), (2, "300", 1396177230.25),
    ],
    "train_valid": [(3, "300", 1396342800.0), (3, "100", 1396343400.0)],
}


def test_rsc15_end_to_end(tmp_path):
    raw = write(tmp_path / "yoochoose-clicks.dat", RSC15_CLICKS)
    paths = prepare("rsc15", raw, tmp_path / "out", min_item_support=2, chunksize=4)
    check_outputs(paths, RSC15_EXPECTED)
    assert read_marker(tmp_path / "out")["params"] == {"min_item_support": 2, "test_days": 1.0}


def test_yoochoose_end_to_end(tmp_path):
    clicks = write(
        tmp_path / "yoochoose-clicks.dat",
        [
            "9,2014-03-31T09:00:00.000Z,100,0",
            "9,2014-03-31T09:30:00.000Z,300,0",
            # Floored to the same second, then ordered by item id: 100, 200, 200 -> dedup.
            "1,2014-04-01T10:00:00.900Z,100,0",
            "1,2014-04-01T10:00:00.100Z,200,0",
            "1,2014-04-01T10:00:01.000Z,200,0",
            "2,2014-04-01T12:00:00.000Z,200,0",
            "2,2014-04-01T12:00:10.000Z,100,0",
            "2,2014-04-01T12:00:20.000Z,200,0",  # a return, kept
            "5,2014-04-01T13:00:00.000Z,900,0",  # support 1 -> session 5 too short
            "5,2014-04-01T13:01:00.000Z,100,0",
            "3,2014-04-02T10:00:00.000Z,100,0",
            "3,2014-04-02T10:04:00.000Z,200,0",
            "3,2014-04-02T10:06:00.000Z,300,0",  # crosses the boundary: truncated
            "4,2014-04-02T10:05:00.000Z,300,0",  # starts exactly at tmax - 1 day: test
            "4,2014-04-02T10:07:00.000Z,700,0",
        ],
    )
    test_file = write(
        tmp_path / "yoochoose-test.dat",
        ["10,2014-04-03T10:00:00.000Z,700,0", "10,2014-04-03T10:05:00.000Z,100,0"],
    )
    paths = prepare("yoochoose", [clicks, test_file], tmp_path / "out", min_item_support=2)
    # 700 is in no training session, yet test keeps it (the evaluator skips unknown items).
    check_outputs(
        paths,
        {
            "train_full": [
                (1, "100", 1396346400.0), (1, "200", 1396346400.0),
                (2, "200", 1396353600.0), (2, "100", 1396353610.0), (2, "200", 1396353620.0),
                (3, "100", 1396432800.0), (3, "200", 1396433040.0),
                (9, "100", 1396256400.0), (9, "300", 1396258200.0),
            ],
            "test": [
                (4, "300", 1396433100.0), (4, "700", 1396433220.0),
                (10, "700", 1396519200.0), (10, "100", 1396519500.0),
            ],
            # Validation boundary: tmax - 2 days = 04-01 10:05.
            "train_tr": [
                (1, "100", 1396346400.0), (1, "200", 1396346400.0),
                (9, "100", 1396256400.0), (9, "300", 1396258200.0),
            ],
            "train_valid": [
                (2, "200", 1396353600.0), (2, "100", 1396353610.0), (2, "200", 1396353620.0),
                (3, "100", 1396432800.0), (3, "200", 1396433040.0),
            ],
        },
    )
    # The same directory given instead of the two files finds them by their public names.
    again = prepare("yoochoose", tmp_path, tmp_path / "out2", min_item_support=2)
    assert file_rows(again["test"]) == file_rows(paths["test"])


def test_retailrocket_end_to_end(tmp_path):
    # Default tsplit 1442545200000 and 7 test days: the boundary B is 1441940400000.
    raw = write(
        tmp_path / "events.csv",
        [
            "timestamp,visitorid,event,itemid,transactionid",
            "1441940400000,3,view,10,",  # visitor 3 starts exactly at B: test
            "1441941000000,3,view,30,",
            "1441941120000,3,transaction,30,4242",
            "1441904400000,1,view,10,",
            "1441905000000,1,view,99,",  # support 1
            "1441906200000,1,addtocart,10,",  # keeps the session open: views are 80 min apart
            "1441909200000,1,view,20,",
            "1441912800000,1,view,30,",  # exactly 1 h later: same session
            "1441916400001,1,view,10,",  # 1 h + 1 ms later: new session
            "1441917000000,1,view,20,",
            "1441939200000,2,view,30,",
            "1441939800000,2,view,10,",
            "1441940700000,2,view,20,",  # crosses B: truncated, not in test
            "1441249200000,5,view,10,",  # 8 days before B: before the validation boundary
            "1441249260000,5,view,20,",
        ],
    )
    paths = prepare("retailrocket", raw, tmp_path / "out", min_item_support=2)
    # Sessions are numbered in (visitor, time) order: visitor 1 -> 0, 1; 2 -> 2; 3 -> 3; 5 -> 4.
    valid = [
        (0, "10", 1441904400000.0), (0, "20", 1441909200000.0), (0, "30", 1441912800000.0),
        (1, "10", 1441916400001.0), (1, "20", 1441917000000.0),
        (2, "30", 1441939200000.0), (2, "10", 1441939800000.0),
    ]
    check_outputs(
        paths,
        {
            "train_full": valid + [(4, "10", 1441249200000.0), (4, "20", 1441249260000.0)],
            "test": [(3, "10", 1441940400000.0), (3, "30", 1441941000000.0)],
            "train_tr": [(4, "10", 1441249200000.0), (4, "20", 1441249260000.0)],
            "train_valid": valid,
        },
    )


def test_diginetica_end_to_end(tmp_path):
    raw = write(
        tmp_path / "train-item-views.csv",
        [
            "sessionId;userId;itemId;timeframe;eventdate",
            "1;;10;1000;2016-05-01",
            "1;;20;5000;2016-05-01",
            "1;;20;6000;2016-05-01",  # consecutive repeat: dropped
            "2;17;20;100;2016-05-02",
            "2;17;10;90000000;2016-05-03",  # time = the session's first date (05-02) + timeframe
            "3;;10;0;2016-05-20",
            "3;;20;2000;2016-05-20",  # tmax; the test boundary is 7 days earlier, 05-13 00:00:02
            "4;;20;2000;2016-05-13",  # exactly at the boundary: test
            "4;;10;3000;2016-05-13",
            "5;;10;86399000;2016-05-12",
            "5;;20;86402000;2016-05-13",  # 05-12 + 86402 s = the boundary: train keeps only [10]
            "6;;20;0;2016-05-08",
            "6;;10;1000;2016-05-08",
            "6;;77;2000;2016-05-08",  # support 1
        ],
    )
    paths = prepare("diginetica", raw, tmp_path / "out", min_item_support=2)
    check_outputs(
        paths,
        {
            "train_full": [
                (1, "10", 1462060801000.0), (1, "20", 1462060805000.0),
                (2, "20", 1462147200100.0), (2, "10", 1462237200000.0),
                (6, "20", 1462665600000.0), (6, "10", 1462665601000.0),
            ],
            "test": [
                (3, "10", 1463702400000.0), (3, "20", 1463702402000.0),
                (4, "20", 1463097602000.0), (4, "10", 1463097603000.0),
            ],
            # Validation boundary: tmax - 14 days = 05-06 00:00:02.
            "train_tr": [
                (1, "10", 1462060801000.0), (1, "20", 1462060805000.0),
                (2, "20", 1462147200100.0), (2, "10", 1462237200000.0),
            ],
            "train_valid": [(6, "20", 1462665600000.0), (6, "10", 1462665601000.0)],
        },
    )


def test_coveo_end_to_end(tmp_path):
    raw = write(
        tmp_path / "browsing_train.csv",
        [
            "session_id_hash,event_type,product_action,product_sku_hash,"
            "server_timestamp_epoch_ms,hashed_url",
            "sa,pageview,,,1599568060000,u1",
            "sa,event,detail,pa,1599568120000,u2",
            "sa,pageview,,,1599571060000,u3",  # keeps the session open: details are 99 min apart
            "sa,event,detail,pb,1599574060000,u4",
            "sa,event,detail,pb,1599574120000,u4",  # consecutive repeat: dropped
            "sa,event,add,pa,1599574180000,",  # not a detail view
            "sb,event,detail,pa,1599870460000,",
            "sb,event,detail,pb,1599870520000,",
            "sb,event,detail,pb,1599874180000,",  # 61 min idle: a new session of the same hash
            "sb,event,detail,pa,1599874240000,",
            "sd,event,detail,pb,1599913600000,",  # crosses tmax - 1 day: truncated to 1, dropped
            "sd,event,detail,pa,1599913720000,",
            "sc,event,detail,pz,1599999970000,",  # support 1
            "sc,event,detail,pa,1600000000000,",
            "sc,event,detail,pb,1600000060000,",  # tmax
        ],
    )
    paths = prepare("coveo", raw, tmp_path / "out", min_item_support=2)
    valid = [
        (1, "pa", 1599870460000.0), (1, "pb", 1599870520000.0),
        (2, "pb", 1599874180000.0), (2, "pa", 1599874240000.0),
    ]
    train_tr = [(0, "pa", 1599568120000.0), (0, "pb", 1599574060000.0)]
    check_outputs(
        paths,
        {
            "train_full": train_tr + valid,
            "test": [(4, "pa", 1600000000000.0), (4, "pb", 1600000060000.0)],
            "train_tr": train_tr,
            "train_valid": valid,
        },
    )


REES46_HEADER = (
    "event_time,event_type,product_id,category_id,category_code,brand,price,user_id,user_session"
)


def rees46_line(time: str, event: str, product: str, user: int) -> str:
    return f"{time} UTC,{event},{product},2053013555631882655,,brand,1.50,{user},x-{user}"


def test_rees46_end_to_end(tmp_path):
    october = write(
        tmp_path / "2019-Oct.csv",
        [
            REES46_HEADER,
            # Not a view, but the first appearance of 222: it ranks 222 before 111 in ties.
            rees46_line("2019-10-01 00:00:00", "cart", "222", 9),
            rees46_line("2019-10-05 10:00:00", "view", "111", 1),
            rees46_line("2019-10-05 10:30:00", "view", "222", 1),
            rees46_line("2019-10-05 10:30:00", "cart", "333", 1),
            rees46_line("2019-10-05 11:30:00", "view", "333", 1),  # exactly 1 h: same session
            rees46_line("2019-10-05 12:30:01", "view", "111", 1),  # 1 h + 1 s: new session
            rees46_line("2019-10-05 12:31:00", "view", "222", 1),
        ],
    )
    november = write(
        tmp_path / "2019-Nov.csv",
        [
            REES46_HEADER,
            # Same second: 222 before 111 by first appearance, then 111 again is a repeat.
            rees46_line("2019-11-29 10:00:00", "view", "111", 4),
            rees46_line("2019-11-29 10:00:00", "view", "222", 4),
            rees46_line("2019-11-29 10:01:00", "view", "111", 4),
            rees46_line("2019-11-29 23:59:00", "view", "222", 2),  # crosses 11-30 00:00
            rees46_line("2019-11-30 00:01:00", "view", "111", 2),
            rees46_line("2019-11-30 00:00:00", "view", "333", 3),  # exactly at the boundary
            rees46_line("2019-11-30 00:05:00", "view", "111", 3),
            rees46_line("2019-11-30 00:06:00", "view", "999", 3),  # support 1
        ],
    )
    paths = prepare("rees46", [october, november], tmp_path / "out", min_item_support=2)
    train_tr = [
        (0, "111", 1570269600.0), (0, "222", 1570271400.0), (0, "333", 1570275000.0),
        (1, "111", 1570278601.0), (1, "222", 1570278660.0),
    ]
    valid = [(4, "222", 1575021600.0), (4, "111", 1575021600.0)]
    check_outputs(
        paths,
        {
            "train_full": train_tr + valid,
            "test": [(3, "333", 1575072000.0), (3, "111", 1575072300.0)],
            "train_tr": train_tr,
            "train_valid": valid,
        },
    )


# ================================================================ marker, reuse, errors, CLI


def test_marker_is_written_last_and_outputs_are_reused(tmp_path, monkeypatch):
    raw = write(tmp_path / "clicks.dat", RSC15_CLICKS)
    out = tmp_path / "out"
    written = []
    original = pp.write_session_file

    def spy(df, path):
        assert not (out / MARKER_FILE).exists(), "marker present before all files are written"
        written.append(Path(path).name)
        return original(df, path)

    monkeypatch.setattr(pp, "write_session_file", spy)
    prepare("rsc15", raw, out, min_item_support=2)
    assert sorted(written) == ["test.txt", "train_full.txt", "train_tr.txt", "train_valid.txt"]
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["dataset"] == "rsc15"
    assert marker["inputs"][0]["size"] == raw.stat().st_size
    assert marker["inputs"][0]["mtime_ns"] == raw.stat().st_mtime_ns
    marker_mtime = (out / MARKER_FILE).stat().st_mtime_ns
    assert all((out / name).stat().st_mtime_ns <= marker_mtime for name in written)

    written.clear()
    prepare("rsc15", raw, out, min_item_support=2)  # same inputs and parameters: reused
    assert written == []
    prepare("rsc15", raw, out, min_item_support=3)  # other parameters: redone
    assert len(written) == 4


def test_crash_leaves_no_marker(tmp_path, monkeypatch):
    raw = write(tmp_path / "clicks.dat", RSC15_CLICKS)
    out = tmp_path / "out"
    prepare("rsc15", raw, out, min_item_support=2)
    assert (out / MARKER_FILE).exists()
    original = pp.write_session_file
    calls = []

    def crash_on_third(df, path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(df, path)

    monkeypatch.setattr(pp, "write_session_file", crash_on_third)
    with pytest.raises(OSError, match="disk full"):
        prepare("rsc15", raw, out, force=True, min_item_support=2)
    # The old marker must not vouch for a half-rewritten set.
    assert not (out / MARKER_FILE).exists()
    assert read_marker(out) is None


BAD_HEADERS = [
    ("retailrocket", "events.csv", "time,visitor,event,itemid\n1,2,view,3\n", "'timestamp'"),
    (
        "diginetica",
        "train-item-views.csv",
        "sessionId,userId,itemId,timeframe,eventdate\n1,,2,0,2016-05-01\n",
        "must be separated by ';'",
    ),
    (
        "coveo",
        "browsing_train.csv",
        "session_id_hash,product_action,ts\nx,detail,1\n",
        "product_sku_hash or product_skus_hash",
    ),
    ("rees46", "2019-Oct.csv", "event_time,event_type,product_id\nx,view,1\n", "'user_id'"),
]


@pytest.mark.parametrize("dataset,name,content,missing", BAD_HEADERS)
def test_bad_header_names_file_and_column(tmp_path, dataset, name, content, missing):
    raw = tmp_path / name
    raw.write_text(content)
    with pytest.raises(RawDataError) as info:
        prepare(dataset, raw, tmp_path / "out")
    message = str(info.value)
    assert str(raw) in message and "line 1 (header)" in message and missing in message
    assert not (tmp_path / "out" / MARKER_FILE).exists()


def test_rsc15_header_line_and_bad_values_give_line_and_column(tmp_path):
    with_header = write(tmp_path / "a.dat", ["SessionID,Timestamp,ItemID,Category"] + RSC15_CLICKS)
    with pytest.raises(RawDataError, match=r"a\.dat, line 1, column 1 \(SessionID\).*no header"):
        prepare("rsc15", with_header, tmp_path / "out")
    bad_time = list(RSC15_CLICKS)
    bad_time[5] = "3,2014-04-01 nine o'clock,300,0"
    with pytest.raises(RawDataError, match=r"b\.dat, line 6, column 2 \(Timestamp\)"):
        prepare("rsc15", write(tmp_path / "b.dat", bad_time), tmp_path / "out", chunksize=2)
    bad_item = list(RSC15_CLICKS)
    bad_item[8] = "7,2014-04-01T08:30:00.000Z,abc,0"
    with pytest.raises(RawDataError, match=r"c\.dat, line 9, column 3 \(ItemID\).*'abc'"):
        prepare("rsc15", write(tmp_path / "c.dat", bad_item), tmp_path / "out", chunksize=4)
    too_few = write(tmp_path / "d.dat", ["1;2014-04-01T08:30:00.000Z;5"])
    with pytest.raises(RawDataError, match=r"d\.dat, line 1: expected at least 3"):
        prepare("rsc15", too_few, tmp_path / "out")


def test_bad_value_in_a_header_file_names_line_and_column(tmp_path):
    raw = write(
        tmp_path / "events.csv",
        ["timestamp,visitorid,event,itemid,transactionid", "1,1,view,10,", "2,x1,view,10,"],
    )
    with pytest.raises(RawDataError, match=r"events\.csv, line 3, column 2 \(visitorid\).*'x1'"):
        prepare("retailrocket", raw, tmp_path / "out")


def test_argument_errors(tmp_path):
    raw = write(tmp_path / "clicks.dat", RSC15_CLICKS)
    with pytest.raises(ValueError, match="unknown dataset"):
        prepare("movielens", raw, tmp_path / "out")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['tsplit'\]"):
        prepare("rsc15", raw, tmp_path / "out", tsplit=5.0)  # RSC15 always uses the last event
    with pytest.raises(ValueError, match="takes 2 raw file"):
        prepare("yoochoose", raw, tmp_path / "out")
    with pytest.raises(RawDataError, match="does not exist"):
        prepare("rsc15", tmp_path / "missing.dat", tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RawDataError, match="expected events.csv"):
        prepare("retailrocket", empty, tmp_path / "o")


def test_defaults_follow_the_spec_table():
    table = {
        "rsc15": ("s", {"test_days": 1.0, "min_item_support": 5}),
        "yoochoose": ("s", {"test_days": 1.0, "tsplit": None, "min_item_support": 5}),
        "retailrocket": ("ms", {"test_days": 7.0, "tsplit": 1442545200000.0}),
        "diginetica": ("ms", {"test_days": 7.0, "tsplit": None}),
        "coveo": ("ms", {"test_days": 1.0, "tsplit": None}),
        "rees46": ("s", {"test_days": 1.0, "tsplit": 1575158400.0}),
    }
    assert set(DATASETS) == set(table)
    for name, (unit, expected) in table.items():
        spec = DATASETS[name]
        assert spec.time_unit == unit
        assert spec.defaults["min_item_support"] == 5
        for key, value in expected.items():
            assert spec.defaults[key] == value, (name, key)
        if name in ("retailrocket", "coveo", "rees46"):
            assert spec.defaults["session_gap_seconds"] == 3600.0


def test_cli_prints_paths_and_counts(tmp_path, capsys):
    raw = write(tmp_path / "clicks.dat", RSC15_CLICKS)
    out = tmp_path / "out"
    assert pp.main(["rsc15", "--raw", str(raw), "--out", str(out), "--min-item-support", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == [
        "train_full", str(out / "train_full.txt"), "events=10", "sessions=4", "items=4"
    ]
    test_line = ["test", str(out / "test.txt"), "events=4", "sessions=2", "items=2"]
    assert printed[1].split() == test_line
    with pytest.raises(SystemExit, match=r"^recforge: .*nope\.dat does not exist"):
        pp.main(["rsc15", "--raw", str(tmp_path / "nope.dat"), "--out", str(out)])


def test_module_runs_as_a_script(tmp_path):
    raw = write(tmp_path / "clicks.dat", RSC15_CLICKS)
    out = tmp_path / "out"
    result = run_child(
        [sys.executable, "-m", "recforge.data.sessions.preprocess", "rsc15", "--raw", str(raw),
         "--out", str(out), "--min-item-support", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "train_valid" in result.stdout and "events=2" in result.stdout
    assert file_rows(out / "train_valid.txt") == RSC15_EXPECTED["train_valid"]


def test_a_directory_prepared_before_the_toolkit_is_read_as_it_is(tmp_path, monkeypatch, caplog):
    raw = write(tmp_path / "clicks.dat", RSC15_CLICKS)
    out = tmp_path / "out"
    out.mkdir()
    old_rows = "SessionId\tItemId\tTime\n1\t10\t1.0\n1\t11\t2.0\n"
    for name in OUTPUT_FILES.values():
        (out / name).write_text(old_rows)
    st = raw.stat()
    # done.json exactly as the preprocessing wrote it before prepared_dir existed
    old_marker = {
        "created": "2026-11-30T08:00:00+00:00",
        "dataset": "rsc15",
        "files": {"test": "test.txt", "train_full": "train_full.txt", "train_tr": "train_tr.txt",
                  "train_valid": "train_valid.txt"},
        "inputs": [{"mtime_ns": st.st_mtime_ns, "path": str(raw.resolve()), "size": st.st_size}],
        "params": {"min_item_support": 2, "test_days": 1.0},
        "stats": {name: {"events": 2, "items": 2, "sessions": 1} for name in OUTPUT_FILES},
        "time_unit": "s",
        "version": 1,
    }
    (out / MARKER_FILE).write_text(json.dumps(old_marker, indent=2, sort_keys=True) + "\n")

    def refuse(df, path):
        raise AssertionError("an up-to-date directory was written again")

    monkeypatch.setattr(pp, "write_session_file", refuse)
    with caplog.at_level("INFO", logger="recforge"):
        paths = prepare("rsc15", raw, out, min_item_support=2)
    assert [r.getMessage() for r in caplog.records] == [f"{out} is up to date"]
    assert all(p.read_text() == old_rows for p in paths.values())
    assert read_marker(out) == old_marker

"""Tests for the synthetic session generator (recforge.data.sessions.synthetic)."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recforge.data.sessions.io import read_session_file
from recforge.data.sessions.synthetic import (
    SyntheticSessionsConfig,
    generate_sessions,
    split_by_time,
    write_synthetic_dataset,
)

SMALL = SyntheticSessionsConfig(n_items=300, n_sessions=3000, seed=3)


@pytest.fixture(scope="module")
def default_sessions() -> pd.DataFrame:
    return generate_sessions(SyntheticSessionsConfig())


def _transitions(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    sid = df["SessionId"].to_numpy()
    items = df["ItemId"].to_numpy()
    same = sid[1:] == sid[:-1]
    return items[:-1][same], items[1:][same]


def test_format_and_ordering(default_sessions: pd.DataFrame) -> None:
    df = default_sessions
    assert list(df.columns) == ["SessionId", "ItemId", "Time"]
    assert df["SessionId"].dtype == np.int64 and df["Time"].dtype == np.float64
    assert pd.api.types.is_string_dtype(df["ItemId"])
    assert df["ItemId"].str.fullmatch(r"i\d+").all()
    assert df["SessionId"].min() == 1
    assert df["SessionId"].nunique() == 20000 == df["SessionId"].max()
    assert df["SessionId"].is_monotonic_increasing
    assert (df.groupby("SessionId")["Time"].diff().dropna() > 0).all()
    span_days = (df["Time"].max() - df["Time"].min()) / 86400
    assert 29 < span_days < 31
    # Session ids follow session start time, as in real click logs.
    assert df.groupby("SessionId")["Time"].min().is_monotonic_increasing


def test_generation_makes_no_python_call_per_session() -> None:
    # vectorised: ten times the sessions costs no more Python calls to speak of (a loop over
    # sessions would add one or more per session). Counted, not timed: a busy machine cannot fail it.
    import cProfile
    import pstats

    def calls(n_sessions: int) -> int:
        profile = cProfile.Profile()
        profile.runcall(generate_sessions, SyntheticSessionsConfig(seed=11, n_sessions=n_sessions))
        return pstats.Stats(profile).total_calls

    calls(2_000)  # first use: imports and caches
    small, large = calls(20_000), calls(200_000)
    assert large < small + 20_000, (small, large)


def test_deterministic_per_seed() -> None:
    a = generate_sessions(SMALL)
    b = generate_sessions(SMALL)
    c = generate_sessions(dataclasses.replace(SMALL, seed=4))
    pd.testing.assert_frame_equal(a, b)
    assert not a.equals(c)


def test_session_lengths(default_sessions: pd.DataFrame) -> None:
    lengths = default_sessions.groupby("SessionId").size()
    assert lengths.min() >= 2
    assert 4.5 < lengths.mean() < 5.5
    assert lengths.max() > 10  # geometric tail, not a constant length


def test_no_immediate_repeats(default_sessions: pd.DataFrame) -> None:
    prev, nxt = _transitions(default_sessions)
    assert not (prev == nxt).any()


def test_popularity_is_heavy_tailed(default_sessions: pd.DataFrame) -> None:
    counts = default_sessions["ItemId"].value_counts().to_numpy()
    top_decile = counts[: SyntheticSessionsConfig().n_items // 10].sum()
    assert top_decile / counts.sum() > 0.5
    assert counts[0] > 20 * np.median(counts)


def test_chain_beats_popularity(default_sessions: pd.DataFrame) -> None:
    train, test = split_by_time(default_sessions, 2)
    prev, nxt = _transitions(train)
    pair_counts = pd.DataFrame({"prev": prev, "next": nxt}).value_counts()
    # value_counts sorts by count, so the first row per `prev` is its most frequent successor.
    best_next = (
        pair_counts.reset_index().drop_duplicates("prev").set_index("prev")["next"]
    )
    most_popular = train["ItemId"].value_counts().index[0]

    test_prev, test_next = _transitions(test)
    assert len(test_next) > 1000
    predicted = pd.Series(test_prev).map(best_next).fillna(most_popular).to_numpy()
    chain_acc = float((predicted == test_next).mean())
    pop_acc = float((test_next == most_popular).mean())
    assert chain_acc > 2 * pop_acc
    assert chain_acc > 0.3


def test_split_keeps_sessions_whole(default_sessions: pd.DataFrame) -> None:
    df = default_sessions
    train, test = split_by_time(df, 2)
    assert len(train) + len(test) == len(df)
    assert not set(train["SessionId"]) & set(test["SessionId"])
    boundary = df["Time"].max() - 2 * 86400
    assert (test.groupby("SessionId")["Time"].min() >= boundary).all()
    assert (train.groupby("SessionId")["Time"].min() < boundary).all()
    # Roughly 2 of 30 days of sessions.
    assert 0.04 < test["SessionId"].nunique() / df["SessionId"].nunique() < 0.1


def test_split_uses_first_event_not_last() -> None:
    day = 86400.0
    df = pd.DataFrame(
        {
            "SessionId": np.array([1, 1, 2, 2], dtype=np.int64),
            "ItemId": ["a", "b", "c", "d"],
            # Session 1 starts before the boundary and ends after it: it belongs to train.
            "Time": [0.0, 9 * day, 8.5 * day, 10 * day],
        }
    )
    train, test = split_by_time(df, 2)
    assert train["SessionId"].tolist() == [1, 1]
    assert test["SessionId"].tolist() == [2, 2]


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        SyntheticSessionsConfig(mean_session_length=1.5)
    with pytest.raises(ValueError):
        SyntheticSessionsConfig(n_items=5, n_successors=5)
    with pytest.raises(ValueError):
        SyntheticSessionsConfig(days=3, test_days=2, valid_days=1)


def test_cache_key_changes_with_every_field() -> None:
    base = SyntheticSessionsConfig()
    keys = {base.cache_key()}
    for field in dataclasses.fields(base):
        value = getattr(base, field.name)
        new = value + 1 if isinstance(value, int) else value * 0.5 + 0.01  # stays valid
        changed = dataclasses.replace(base, **{field.name: new})
        keys.add(changed.cache_key())
    assert len(keys) == len(dataclasses.fields(base)) + 1
    assert base.cache_key() == SyntheticSessionsConfig().cache_key()


def test_write_dataset_splits_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = write_synthetic_dataset(SMALL, tmp_path)
    assert set(paths) == {"train_full", "test", "train_tr", "train_valid"}
    target = tmp_path / SMALL.cache_key()
    assert all(p.parent == target and p.is_file() for p in paths.values())
    # No staging directories are left behind.
    assert [p.name for p in tmp_path.iterdir()] == [target.name]

    frames = {name: read_session_file(p) for name, p in paths.items()}
    full = generate_sessions(SMALL)
    train_full, test = split_by_time(full, SMALL.test_days)
    pd.testing.assert_frame_equal(frames["train_full"], train_full)
    pd.testing.assert_frame_equal(frames["test"], test)
    pd.testing.assert_frame_equal(
        pd.concat([frames["train_tr"], frames["train_valid"]]).sort_values(
            ["SessionId", "Time"], kind="mergesort", ignore_index=True
        ),
        frames["train_full"],
    )
    assert frames["train_valid"]["SessionId"].min() > frames["train_tr"]["SessionId"].max()

    mtimes = {name: p.stat().st_mtime_ns for name, p in paths.items()}
    past = time.time_ns() - 10**10
    for p in paths.values():
        os.utime(p, ns=(past, past))
    import recforge.data.sessions.synthetic as synthetic

    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "generate_sessions", _must_not_regenerate)
        again = write_synthetic_dataset(SMALL, tmp_path)
    assert again == paths
    assert all(p.stat().st_mtime_ns == past for p in again.values()), mtimes

    other = write_synthetic_dataset(dataclasses.replace(SMALL, seed=99), tmp_path)
    assert other["test"].parent != target
    assert not read_session_file(other["test"]).equals(frames["test"])


def _must_not_regenerate(cfg: SyntheticSessionsConfig) -> pd.DataFrame:
    raise AssertionError("a complete cache must be reused, not regenerated")


def test_write_dataset_repairs_an_incomplete_cache(tmp_path: Path) -> None:
    paths = write_synthetic_dataset(SMALL, tmp_path)
    expected = paths["test"].read_bytes()
    paths["test"].unlink()
    again = write_synthetic_dataset(SMALL, tmp_path)
    assert again["test"].read_bytes() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMALL.cache_key()]


def test_write_dataset_defers_to_a_concurrent_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recforge.data.sessions.synthetic as synthetic

    real_generate = synthetic.generate_sessions
    generating, release = threading.Event(), threading.Event()
    generated_by = []

    def generate_slowly(cfg: SyntheticSessionsConfig) -> pd.DataFrame:
        generated_by.append(threading.current_thread().name)
        generating.set()
        assert release.wait(60)
        return real_generate(cfg)

    monkeypatch.setattr(synthetic, "generate_sessions", generate_slowly)
    results = {}

    def call() -> None:
        results[threading.current_thread().name] = write_synthetic_dataset(SMALL, tmp_path)

    rival = threading.Thread(target=call, name="rival")
    rival.start()
    assert generating.wait(60)
    # While the rival generates, a second caller must wait for it rather than generate too.
    ours = threading.Thread(target=call, name="ours")
    ours.start()
    ours.join(0.5)
    assert ours.is_alive()
    release.set()
    rival.join(60)
    ours.join(60)
    assert generated_by == ["rival"]
    assert results["ours"] == results["rival"]
    assert all(p.is_file() for p in results["ours"].values())
    # No staging directory or lock file is left behind.
    assert [p.name for p in tmp_path.iterdir()] == [SMALL.cache_key()]


def test_a_cache_written_before_markers_is_regenerated_with_one_line(tmp_path: Path, caplog) -> None:
    # The layout of a synthetic cache before prepared_dir: the four files and config.json, no
    # done.json (completeness was the four files being there).
    import json

    target = tmp_path / SMALL.cache_key()
    target.mkdir()
    for filename in ("train_full.txt", "test.txt", "train_tr.txt", "train_valid.txt"):
        (target / filename).write_text("SessionId\tItemId\tTime\n1\ti1\t1.0\n")
    (target / "config.json").write_text(json.dumps(dataclasses.asdict(SMALL), indent=2) + "\n")
    with caplog.at_level("INFO", logger="recforge"):
        paths = write_synthetic_dataset(SMALL, tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        f"rebuilding {target}: no readable done.json (the build did not finish, or none was made here)"
    ]
    train_full, test = split_by_time(generate_sessions(SMALL), SMALL.test_days)
    pd.testing.assert_frame_equal(read_session_file(paths["test"]), test)
    pd.testing.assert_frame_equal(read_session_file(paths["train_full"]), train_full)
    assert json.loads((target / "done.json").read_text())["generator"]["seed"] == SMALL.seed

"""The synthetic user-history generator: shape, determinism, cache, and that it is learnable
(a numpy oracle that ranks by transition counts from the last item beats popularity)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from recforge.data.sequences.datamodule import SyntheticHistoryDataModule
from recforge.data.sequences.prepared import load_prepared
from recforge.data.sequences.splits import protocol_splits
from recforge.data.sequences.synthetic import (
    SyntheticHistoriesConfig,
    generate_histories,
    write_synthetic_histories,
)
from recforge.errors import UserInputError

SMALL = SyntheticHistoriesConfig(n_users=400, n_items=300, min_length=10, max_length=60, seed=3)


def test_shape_and_properties():
    h = generate_histories(SMALL)
    assert h.n_users == 400 and h.n_items == 300
    lengths = h.lengths
    assert lengths.min() >= 10 and lengths.max() <= 60
    assert len(np.unique(lengths)) > 20  # lengths spread over the range
    assert h.items.min() >= 0 and h.items.max() < 300
    assert h.item_counts.tolist() == np.bincount(h.items, minlength=300).tolist()
    user_of = np.repeat(np.arange(h.n_users), lengths)
    same_user = user_of[1:] == user_of[:-1]
    assert (np.diff(h.timestamps)[same_user] > 0).all()  # strictly increasing per user
    assert set(np.unique(h.ratings)) <= {1.0, 2.0, 3.0, 4.0, 5.0}
    # Power-law popularity: the 10% most popular items take far more than 10% of the events.
    top = np.sort(h.item_counts)[::-1][:30].sum()
    assert top > 0.3 * h.n_events


def test_deterministic_per_config():
    a, b = generate_histories(SMALL), generate_histories(SMALL)
    assert np.array_equal(a.items, b.items) and np.array_equal(a.timestamps, b.timestamps)
    c = generate_histories(dataclasses.replace(SMALL, seed=4))
    assert not np.array_equal(a.offsets, c.offsets) or not np.array_equal(a.items, c.items)


def test_cache_is_keyed_by_every_parameter(tmp_path):
    first = write_synthetic_histories(SMALL, tmp_path)
    mtime = (first / "histories.parquet").stat().st_mtime_ns
    assert write_synthetic_histories(SMALL, tmp_path) == first
    assert (first / "histories.parquet").stat().st_mtime_ns == mtime  # reused, not rewritten
    other = write_synthetic_histories(dataclasses.replace(SMALL, taste_prob=0.3), tmp_path)
    assert other != first
    loaded = load_prepared(first)
    assert np.array_equal(loaded.items, generate_histories(SMALL).items)
    # An interrupted write (no marker) is redone.
    (first / "done.json").unlink()
    write_synthetic_histories(SMALL, tmp_path)
    assert (first / "done.json").is_file()


def test_last_item_beats_popularity():
    h = generate_histories(SyntheticHistoriesConfig(n_users=1500, n_items=800, seed=1))
    splits, _ = protocol_splits(h, "loo")
    test = splits["test"]
    n = h.n_items
    # Counts from every event before the test targets: popularity, and transitions a -> b.
    before = np.concatenate([np.arange(s, t) for s, t in zip(test.starts, test.targets)])
    popularity = np.bincount(h.items[before], minlength=n)
    pairs = before[np.isin(before + 1, before)]
    transitions = np.zeros((n, n))
    np.add.at(transitions, (h.items[pairs], h.items[pairs + 1]), 1)
    targets = h.items[test.targets]
    last = h.items[test.targets - 1]
    top_popular = np.argsort(-popularity, kind="stable")[:10]
    hr_pop = np.isin(targets, top_popular).mean()
    # Ties among transition counts broken by popularity.
    scores = transitions[last] + 1e-6 * popularity[None, :]
    top_next = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    hr_next = (top_next == targets[:, None]).any(axis=1).mean()
    assert hr_next > 2 * hr_pop and hr_next - hr_pop > 0.2, (hr_next, hr_pop)


def test_datamodule_runs_without_files(tmp_path):
    dm = SyntheticHistoryDataModule(
        cache_dir=str(tmp_path), generator=dataclasses.asdict(SMALL), max_seq_len=20, batch_size=64
    )
    dm.setup()
    assert dm.task_inputs()["n_items"] == 300
    assert len(dm.splits["train"]) == 400  # every user has >= 10 events
    batch = next(iter(dm.train_dataloader()))
    assert batch.size == 64 and batch.lengths.max() <= 20


def test_bad_generator_value_is_a_user_error(tmp_path):
    with pytest.raises(UserInputError, match=r"data\.generator: need 1 <= min_length <= max_length"):
        SyntheticHistoryDataModule(cache_dir=str(tmp_path), generator={"min_length": 50, "max_length": 20})
    with pytest.raises(UserInputError, match=r"data\.generator: .*n_sessions"):
        SyntheticHistoryDataModule(cache_dir=str(tmp_path), generator={"n_sessions": 5})

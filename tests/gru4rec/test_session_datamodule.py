"""SessionDataModule: item map, splits, rank partitioning, checkpoint consistency."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from recforge.data.sessions.datamodule import SessionDataModule, SyntheticSessionDataModule
from recforge.data.sessions.io import write_session_file
from recforge.errors import UserInputError


def _write(path, rows):
    frame = pd.DataFrame(rows, columns=["SessionId", "ItemId", "Time"])
    write_session_file(frame, path)
    return path


@pytest.fixture
def files(tmp_path):
    # Not sorted by session: the item map must follow the file's order of first appearance.
    train = _write(tmp_path / "train.txt", [
        (2, "b", 10.0), (2, "a", 11.0), (1, "c", 5.0), (1, "b", 6.0), (1, "a", 7.0), (3, "d", 1.0),
        (3, "a", 2.0),
    ])
    test = _write(tmp_path / "test.txt", [
        (7, "a", 20.0), (7, "zzz", 21.0), (7, "b", 22.0),  # unknown item deleted, session spliced
        (8, "zzz", 30.0), (8, "c", 31.0),                   # one known event left: no target
        (9, "yyy", 40.0),                                    # nothing known: the session vanishes
    ])
    return train, test


def test_item_map_popularity_and_test_splicing(files):
    train, test = files
    dm = SessionDataModule(str(train), str(test))
    assert list(dm.catalog.item_ids) == ["b", "a", "c", "d"]
    assert dm.catalog.popularity.tolist() == [2, 3, 1, 1]
    arrays = dm.split("train")
    # sessions sorted by id, visited by first event time: 3 (t=1), 1 (t=5), 2 (t=10)
    assert arrays.offsets.tolist() == [0, 3, 5, 7]
    assert arrays.order.tolist() == [2, 0, 1]
    t = dm.split("test")
    assert t.items.tolist() == [1, 0, 2]  # a, b | c
    assert t.offsets.tolist() == [0, 2, 3]
    assert t.n_targets == 1
    assert not dm.has_validation and dm.val_dataloader() == []


def test_loaders_partition_sessions_by_rank(files):
    train, test = files
    dm = SessionDataModule(str(train), str(test), batch_size=1)
    module = SimpleNamespace(min_batch_rows=1)
    seen = []
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2, lightning_module=module)
        loader = dm.train_dataloader()
        steps = list(loader)
        assert len(steps) == len(loader)  # both ranks padded to the longer one
        seen.append([(int(s.inputs[0]), int(s.targets[0])) for s in steps if s.size])
    everything = SessionDataModule(str(train), str(test), batch_size=1)
    everything.trainer = SimpleNamespace(global_rank=0, world_size=1, lightning_module=module)
    single = [(int(s.inputs[0]), int(s.targets[0])) for s in everything.train_dataloader()]
    assert sorted(seen[0] + seen[1]) == sorted(single)
    assert seen[0] and seen[1]


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_steps_are_the_same_steps_in_order(files, world):
    train, test = files
    module = SimpleNamespace(min_batch_rows=1)

    def loader(rank, per_batch):
        dm = SessionDataModule(str(train), str(test), batch_size=1, steps_per_batch=per_batch)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world, lightning_module=module)
        return dm.train_dataloader()

    for rank in range(world):
        plain = list(loader(rank, 1))
        grouped_loader = loader(rank, 3)
        groups = list(grouped_loader)
        assert len(groups) == len(grouped_loader) == -(-len(plain) // 3)
        assert [g.n_steps for g in groups[:-1]] == [3] * (len(groups) - 1)
        flat = [step for g in groups for step in g.steps]
        assert len(flat) == len(plain)
        for a, b in zip(flat, plain):
            assert a.inputs.tolist() == b.inputs.tolist() and a.targets.tolist() == b.targets.tolist()
            assert a.reset.tolist() == b.reset.tolist()
        assert sum(g.size for g in groups) == sum(s.size for s in plain)


def test_steps_per_batch_must_be_a_positive_integer(files):
    train, test = files
    with pytest.raises(UserInputError, match="data.steps_per_batch"):
        SessionDataModule(str(train), str(test), steps_per_batch=0)


def test_checkpoint_from_another_item_map_is_refused(files, tmp_path):
    train, test = files
    state = SessionDataModule(str(train), str(test)).state_dict()
    other = _write(tmp_path / "other.txt", [(1, "x", 1.0), (1, "y", 2.0)])
    dm = SessionDataModule(str(other), str(test))
    with pytest.raises(ValueError, match=r"another item map .*data\.train_path=.*other\.txt"):
        dm.load_state_dict(state)
    same = SessionDataModule(str(train), str(test))
    same.load_state_dict(state)  # no error
    assert same.catalog.n_items == 4


def test_missing_path_names_the_config_key(files):
    _, test = files
    with pytest.raises(ValueError, match="data.train_path is not set"):
        SessionDataModule(None, str(test)).catalog


def test_synthetic_module_uses_the_tuning_protocol(tmp_path):
    dm = SyntheticSessionDataModule(cache_dir=str(tmp_path), generator={"n_items": 50, "n_sessions": 400})
    assert dm.train_path.endswith("train_tr.txt")
    assert dm.valid_path.endswith("train_valid.txt")
    assert dm.test_path.endswith("test.txt")
    train_sessions = set(np.unique(pd.read_csv(dm.train_path, sep="\t")["SessionId"]))
    valid_sessions = set(np.unique(pd.read_csv(dm.valid_path, sep="\t")["SessionId"]))
    assert not train_sessions & valid_sessions


@pytest.mark.slow
def test_raw_dataset_is_preprocessed_and_trained_from_config(tmp_path, make_cfg):
    """data=retailrocket data.raw_path=events.csv: preprocess once, then train and test on it."""
    from recforge.data.sessions.synthetic import SyntheticSessionsConfig, generate_sessions
    from recforge.pipeline import train

    sessions = generate_sessions(SyntheticSessionsConfig(n_items=60, n_sessions=600, days=20, seed=5))
    raw = pd.DataFrame({
        "timestamp": (sessions["Time"] * 1000).round().astype("int64"),
        "visitorid": sessions["SessionId"],
        "event": "view",
        "itemid": sessions["ItemId"].str.slice(1).astype("int64"),
        "transactionid": "",
    })
    events = tmp_path / "events.csv"
    raw.to_csv(events, index=False)
    cfg = make_cfg(
        "data=retailrocket", f"data.raw_path={events}", f"data.prepared_dir={tmp_path / 'rr'}",
        "+data.preprocess.tsplit=null", "data.protocol=tuning", "trainer.max_epochs=1",
    )
    metrics = train(cfg)
    assert (tmp_path / "rr" / "done.json").exists()
    assert metrics["val/recall@20"] > 0 and metrics["test/recall@20"] > 0
    # a second build reuses the prepared files (the marker is not rewritten)
    stamp = (tmp_path / "rr" / "done.json").stat().st_mtime_ns
    SessionDataModule(dataset="retailrocket", raw_path=str(events), prepared_dir=str(tmp_path / "rr"),
                      train_path=None, test_path=None, preprocess={"tsplit": None})
    assert (tmp_path / "rr" / "done.json").stat().st_mtime_ns == stamp

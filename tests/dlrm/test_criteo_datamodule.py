"""CriteoDataModule / CriteoStream: every row of a split exactly once per epoch (against a direct
pyarrow read of the files), batch shapes and dtypes, shuffling per (seed, epoch), file order,
disjoint worker and DDP shares with equal training batch counts, errors in one line, the raw
path, and the epoch as a real Trainer sees it (also across a resume).

The small prepared directory below makes each row identifiable (C1 and I1 hold its id) and has
uneven row groups (100 rows, the last of each file shorter) over several files.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import recforge.data.criteo.datamodule as dm_module
from recforge.data.batches import CTRBatch
from recforge.data.criteo.datamodule import CriteoDataModule, CriteoStream, SyntheticCriteoDataModule
from recforge.data.criteo.prepared import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    SPARSE_COLUMNS,
    PreparedDataError,
    PreparedWriter,
    split_files,
)
from recforge.errors import UserInputError

SIZES = {"train": 1003, "valid": 257, "test": 131}
CARDS = [5000] + [7] * 25


def write_prepared(path: Path, sizes=SIZES, cards=CARDS, row_group_size=100, rows_per_part=400) -> str:
    rng = np.random.default_rng(1)
    with PreparedWriter(path, rows_per_part=rows_per_part, row_group_size=row_group_size) as writer:
        first = 0
        for split, n in sizes.items():
            ids = np.arange(first, first + n)
            first += n
            dense = rng.random((n, 13)).astype(np.float32)
            sparse = rng.integers(0, 7, size=(n, 26))
            dense[:, 0] = ids
            sparse[:, 0] = ids
            writer.write(split, rng.integers(0, 2, size=n), dense, sparse)
        writer.finish(cards, split={"mode": "test"}, source={}, categorical={}, malformed={})
    return str(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(tmp_path_factory.mktemp("criteo") / "prepared")


def file_rows(prepared: str, split: str) -> np.ndarray:
    """``[n, 40]`` rows of ``split`` straight from its files, in file order (label, I, C)."""
    table = pq.read_table([str(p) for p in split_files(prepared, split)])
    names = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
    return np.column_stack([table.column(c).to_numpy().astype(np.float64) for c in names])


def batch_rows(batches) -> np.ndarray:
    batches = list(batches)
    if not batches:
        return np.empty((0, 40))
    return np.concatenate([
        np.column_stack([b.labels.numpy().astype(np.float64), b.dense.numpy(), b.sparse.numpy()]) for b in batches
    ])


def multiset(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def ids(batches) -> list[int]:
    return [i for b in batches for i in b.sparse[:, 0].tolist()]


def as_worker(monkeypatch, stream: CriteoStream, worker: int, workers: int) -> list[CTRBatch]:
    """What DataLoader worker ``worker`` of ``workers`` yields."""
    info = types.SimpleNamespace(id=worker, num_workers=workers)
    monkeypatch.setattr(dm_module, "get_worker_info", lambda: info)
    try:
        return list(stream)
    finally:
        monkeypatch.setattr(dm_module, "get_worker_info", lambda: None)


def stream(prepared, split="train", batch_size=64, **kwargs) -> CriteoStream:
    dm = CriteoDataModule(prepared_dir=prepared, batch_size=batch_size, eval_batch_size=batch_size,
                          **{k: kwargs.pop(k) for k in ("shuffle", "shuffle_buffer", "drop_last") if k in kwargs})
    # group=1 (one batch per item) unless a test asks for more
    return dm.stream(split, **kwargs)


# ---------------------------------------------------------------- rows, batches
@pytest.mark.parametrize("split", ["train", "valid", "test"])
@pytest.mark.parametrize("batch_size", [1, 64, 100, 5000])
def test_every_row_once_per_epoch(prepared, split, batch_size):
    expected = multiset(file_rows(prepared, split))
    s = stream(prepared, split, batch_size, shuffle_buffer=150)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s) == -(-SIZES[split] // batch_size)
        np.testing.assert_array_equal(multiset(batch_rows(batches)), expected)


def test_batches_shapes_dtypes_and_values_in_file_order(prepared):
    for split in ("valid", "test", "train"):
        batches = list(stream(prepared, split, 64, shuffle=False))
        for b in batches:
            assert isinstance(b, CTRBatch)
            assert b.dense.dtype == torch.float32 and b.dense.shape == (b.size, 13)
            assert b.sparse.dtype == torch.int64 and b.sparse.shape == (b.size, 26)
            assert b.labels.dtype == torch.float32 and b.labels.shape == (b.size,)
        assert [b.size for b in batches[:-1]] == [64] * (len(batches) - 1)
        assert batches[-1].size == SIZES[split] - 64 * (len(batches) - 1)
        np.testing.assert_array_equal(batch_rows(batches), file_rows(prepared, split))


def test_shuffling_differs_between_epochs_and_is_reproducible(prepared, monkeypatch):
    s = stream(prepared, "train", 64, shuffle_buffer=300)
    orders = {}
    for epoch in (0, 1, 0):
        s.set_epoch(epoch)
        orders.setdefault(epoch, []).append(ids(s))
    assert orders[0][0] == orders[0][1]
    assert orders[0][0] != orders[1][0]
    assert orders[0][0] != sorted(orders[0][0])
    again = stream(prepared, "train", 64, shuffle_buffer=300)
    assert ids(again) == orders[0][0]
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    assert ids(stream(prepared, "train", 64, shuffle_buffer=300)) != orders[0][0]


def test_shuffle_false_keeps_file_order(prepared):
    s = stream(prepared, "train", 64, shuffle=False)
    s.set_epoch(3)
    assert ids(s) == list(range(SIZES["train"]))


def test_shuffle_buffer_mixes_chunks(tmp_path):
    # Row groups of exactly 100 rows: ids // 100 names a row's row group.
    path = write_prepared(tmp_path / "even", sizes={"train": 1000})
    for b in stream(path, "train", 50, shuffle_buffer=0):
        assert len(set((b.sparse[:, 0] // 100).tolist())) == 1  # a window of one row group
    first = next(iter(stream(path, "train", 50, shuffle_buffer=10_000)))
    assert len(set((first.sparse[:, 0] // 100).tolist())) >= 5


def test_drop_last_drops_the_partial_batch(prepared):
    s = stream(prepared, "train", 100, drop_last=True)
    batches = list(s)
    assert len(batches) == len(s) == 10 and {b.size for b in batches} == {100}
    assert s.left_out == 3 and len(set(ids(batches))) == 1000


# ---------------------------------------------------------------- workers and ranks
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("split,shuffle", [("train", True), ("train", False), ("test", False)])
def test_workers_read_disjoint_shares(prepared, monkeypatch, workers, group, split, shuffle):
    s = stream(prepared, split, 32, shuffle=shuffle, group=group)
    items = [as_worker(monkeypatch, s, w, workers) for w in range(workers)]
    everything = [i for share in items for i in ids(share)]
    assert len(everything) == len(set(everything)) == SIZES[split]
    if -(-len(s) // group) >= workers:  # enough items to go round: nobody idles
        assert all(items)
    sizes = [item.size for share in items for item in share]
    assert max(sizes) <= 32 * group and sum(size % 32 != 0 for size in sizes) <= 1
    if not shuffle:
        # DataLoader takes one item from each worker in turn: that must be file order.
        turns = [items[k % workers][k // workers] for k in range(sum(map(len, items)))]
        np.testing.assert_array_equal(batch_rows(turns), file_rows(prepared, split))


def batch_count(items, batch_size) -> int:
    """Batches the loader cuts from a worker's items."""
    return sum(-(-item.size // batch_size) for item in items)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("workers,group", [(1, 1), (2, 1), (2, 4)])
def test_training_ranks_get_equal_batches_and_disjoint_rows(prepared, monkeypatch, world, workers, group):
    per_rank = []
    for rank in range(world):
        s = stream(prepared, "train", 64, rank=rank, world_size=world, shuffle_buffer=200, group=group)
        s.set_epoch(2)
        items = [item for w in range(workers) for item in as_worker(monkeypatch, s, w, workers)]
        assert batch_count(items, 64) == len(s)
        per_rank.append(items)
    assert len({batch_count(items, 64) for items in per_rank}) == 1  # no all-reduce deadlock
    seen = [i for items in per_rank for i in ids(items)]
    assert len(seen) == len(set(seen)) == SIZES["train"] // world * world
    assert set(seen) <= set(range(SIZES["train"]))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_evaluation_ranks_cover_every_row_once_in_file_order(prepared, world):
    per_rank = [list(stream(prepared, "valid", 16, rank=r, world_size=world)) for r in range(world)]
    rows = batch_rows([b for batches in per_rank for b in batches])
    np.testing.assert_array_equal(rows, file_rows(prepared, "valid"))  # no padding, no repeat
    sizes = [sum(b.size for b in batches) for batches in per_rank]
    assert max(sizes) - min(sizes) <= 1


def test_equal_training_batch_counts_over_many_shapes(tmp_path, monkeypatch):
    for n, size in ((37, 5), (64, 16), (203, 7)):
        path = write_prepared(tmp_path / f"p{n}", sizes={"train": n}, row_group_size=size, rows_per_part=50)
        for world, batch, workers, group in ((2, 4, 3, 1), (3, 8, 2, 2), (4, 1, 2, 5), (5, 16, 1, 1)):
            counts, seen = set(), []
            for rank in range(world):
                s = stream(path, "train", batch, rank=rank, world_size=world, shuffle_buffer=9, group=group)
                items = [item for w in range(workers) for item in as_worker(monkeypatch, s, w, workers)]
                counts.add(batch_count(items, batch))
                seen += ids(items)
            assert len(counts) == 1, (n, world, batch, workers)
            assert len(seen) == len(set(seen)) == n // world * world


def test_real_worker_processes(prepared, monkeypatch):
    monkeypatch.setattr(dm_module, "ITEM_ROWS", 100)  # items of two batches: several per worker
    dm = CriteoDataModule(prepared_dir=prepared, batch_size=50, eval_batch_size=40, num_workers=2)
    single = CriteoDataModule(prepared_dir=prepared, batch_size=50, eval_batch_size=40)
    test = list(dm.test_dataloader())
    assert [b.size for b in test] == [40, 40, 40, 11]
    np.testing.assert_array_equal(batch_rows(test), file_rows(prepared, "test"))
    np.testing.assert_array_equal(batch_rows(test), batch_rows(single.test_dataloader()))
    loader = dm.train_dataloader()
    first, second = list(loader), list(loader)
    assert len(first) == len(loader) == 21 and [b.size for b in first].count(50) == 20
    assert sorted(ids(first)) == list(range(SIZES["train"])) and ids(first) == ids(second)


# ---------------------------------------------------------------- the module
def test_task_inputs_and_validation_flag(prepared, tmp_path):
    dm = CriteoDataModule(prepared_dir=prepared)
    assert dm.task_inputs() == {"cardinalities": CARDS, "n_dense": 13}
    assert dm.has_validation
    no_valid = write_prepared(tmp_path / "nv", sizes={"train": 50, "test": 20})
    dm = CriteoDataModule(prepared_dir=no_valid)
    dm.setup("fit")
    assert not dm.has_validation and dm.val_dataloader() == []


def test_errors_are_one_line(prepared, tmp_path):
    cases = []
    with pytest.raises(PreparedDataError) as error:
        CriteoDataModule(prepared_dir=str(tmp_path / "absent")).setup("fit")
    cases.append((error, "no such directory"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreparedDataError) as error:
        CriteoDataModule(prepared_dir=str(tmp_path / "empty")).task_inputs()
    cases.append((error, "no metadata.json"))
    no_test = write_prepared(tmp_path / "nt", sizes={"train": 50, "valid": 20})
    dm = CriteoDataModule(prepared_dir=no_test)
    dm.setup("fit")
    with pytest.raises(UserInputError) as error:
        dm.setup("test")
    cases.append((error, f"data.prepared_dir={no_test}: no 'test' split (it has train, valid)"))
    for kwargs, message in (
        ({}, "data.prepared_dir is not set"),
        ({"prepared_dir": prepared, "raw_path": "x.txt", "cache_dir": "c"}, "not both"),
        ({"raw_path": "x.txt"}, "data.raw_path needs data.cache_dir"),
        ({"prepared_dir": prepared, "batch_size": 0}, "data.batch_size=0: expected an integer >= 1"),
        ({"prepared_dir": prepared, "num_workers": -1}, "data.num_workers=-1"),
    ):
        with pytest.raises(UserInputError) as error:
            CriteoDataModule(**kwargs)
        cases.append((error, message))
    for error, message in cases:
        assert message in str(error.value)
        assert "\n" not in str(error.value)


def test_index_outside_its_table_is_refused_before_training(tmp_path):
    path = write_prepared(tmp_path / "bad", sizes={"train": 30}, cards=[5000] + [7] * 24 + [3])
    with pytest.raises(PreparedDataError, match=r"column C26 holds values in \[\d, \d\]; indices must lie in \[0, 3\)"):
        CriteoDataModule(prepared_dir=path).setup("fit")


def test_raw_path_is_prepared_once_by_ensure_prepared(tmp_path, prepared, monkeypatch):
    calls = []

    def ensure_prepared(raw, cache_root, **params):
        calls.append((raw, cache_root, params))
        return Path(prepared)

    stand_in = types.ModuleType("recforge.data.criteo.prepare")
    stand_in.ensure_prepared = ensure_prepared
    monkeypatch.setitem(sys.modules, "recforge.data.criteo.prepare", stand_in)
    dm = CriteoDataModule(raw_path=["a.txt", "b.txt"], cache_dir=str(tmp_path), prepare={"split": "kaggle7"})
    assert calls == [(["a.txt", "b.txt"], str(tmp_path), {"split": "kaggle7"})]
    assert dm.prepared_dir == prepared and dm.task_inputs()["cardinalities"] == CARDS
    CriteoDataModule(raw_path="a.txt", cache_dir=str(tmp_path))
    assert calls[-1] == ("a.txt", str(tmp_path), {})
    # A config keeps its conversion settings while pointing at a prepared directory.
    kept = CriteoDataModule(prepared_dir=prepared, cache_dir=str(tmp_path), prepare={"split": "kaggle7"})
    assert kept.prepared_dir == prepared and len(calls) == 2

    def strict(raw, cache_root, *, split="kaggle7"):
        return Path(prepared)

    stand_in.ensure_prepared = strict
    with pytest.raises(UserInputError, match="^data.prepare: .*'colour'"):
        CriteoDataModule(raw_path="a.txt", cache_dir=str(tmp_path), prepare={"colour": 1})


def test_raw_tiny_criteo_file_end_to_end(tmp_path, shared_data_dir):
    raw = shared_data_dir / "criteo" / "train.tiny.txt"
    dm = CriteoDataModule(raw_path=str(raw), cache_dir=str(tmp_path),
                          prepare={"categorical": "vocab", "split": "random_7_2_1"}, batch_size=256)
    dm.setup("fit")
    dm.setup("test")
    total = sum(b.size for split in ("train", "valid", "test") for b in dm.stream(split))
    assert total == sum(info["rows"] for info in dm.metadata["splits"].values()) > 1900
    cards = torch.tensor(dm.task_inputs()["cardinalities"])
    for b in dm.stream("train"):
        assert bool((b.sparse >= 0).all()) and bool((b.sparse < cards).all())


def test_checkpoint_state_checks_the_tables(prepared, tmp_path):
    dm = CriteoDataModule(prepared_dir=prepared)
    state = dm.state_dict()
    assert state == {"cardinalities": CARDS, "rows": SIZES}
    CriteoDataModule(prepared_dir=prepared).load_state_dict(state)
    other = write_prepared(tmp_path / "other", sizes={"train": 40}, cards=[5000] + [7] * 24 + [9])
    fresh = CriteoDataModule(prepared_dir=other)
    fresh.load_state_dict(state)
    with pytest.raises(UserInputError, match=r"^the checkpoint was trained on other tables .*C26: 7 vs 9"):
        fresh.task_inputs()


def test_config_values_are_checked_against_the_annotations(prepared):
    from omegaconf import OmegaConf

    from recforge.config_values import ConfigValueError, check_config_values

    for key, value in (("batch_size", 0), ("shuffle_buffer", -1), ("num_workers", -2)):
        cfg = OmegaConf.create({"data": {"_target_": "recforge.data.criteo.datamodule.CriteoDataModule",
                                         "prepared_dir": prepared, key: value}})
        with pytest.raises(ConfigValueError, match=f"data.{key}={value}"):
            check_config_values(cfg)


# ---------------------------------------------------------------- with a Trainer
class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.train_ids: dict[int, list[int]] = {}
        self.val_ids: dict[int, list[int]] = {}

    def training_step(self, batch: CTRBatch, _):
        self.train_ids.setdefault(self.current_epoch, []).extend(batch.sparse[:, 0].tolist())
        return (self.weight * batch.labels).sum()

    def validation_step(self, batch: CTRBatch, _):
        if not self.trainer.sanity_checking:
            self.val_ids.setdefault(self.current_epoch, []).extend(batch.sparse[:, 0].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(tmp_path: Path, epochs: int, callbacks=()) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0,
                     enable_checkpointing=bool(callbacks), callbacks=list(callbacks))


# Our __len__ is exact per rank whatever the workers: each reads its own share.
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # the resume's own
def test_trainer_epochs_follow_seed_and_epoch_also_after_resume(prepared, tmp_path):
    L.seed_everything(11)
    whole = _Recorder()
    _trainer(tmp_path, 3).fit(whole, datamodule=CriteoDataModule(prepared_dir=prepared, batch_size=100,
                                                                  shuffle_buffer=250))
    assert sorted(whole.train_ids) == [0, 1, 2]
    for epoch, seen in whole.train_ids.items():
        assert sorted(seen) == list(range(SIZES["train"]))
        reference = stream(prepared, "train", 100, shuffle_buffer=250)
        reference.set_epoch(epoch)
        assert seen == ids(reference)
        assert whole.val_ids[epoch] == list(range(SIZES["train"], SIZES["train"] + SIZES["valid"]))
    assert whole.train_ids[0] != whole.train_ids[1]

    # A checkpoint saved at the end of the training epoch, and one saved after its validation.
    for on_train_epoch_end in (True, False):
        folder = tmp_path / f"ckpt-{on_train_epoch_end}"

        def checkpoints():
            return L.pytorch.callbacks.ModelCheckpoint(dirpath=str(folder), save_last=True,
                                                       save_on_train_epoch_end=on_train_epoch_end)

        L.seed_everything(11)
        _trainer(tmp_path, 2, callbacks=[checkpoints()]).fit(
            _Recorder(), datamodule=CriteoDataModule(prepared_dir=prepared, batch_size=100, shuffle_buffer=250))
        L.seed_everything(11)
        resumed = _Recorder()
        _trainer(tmp_path, 3, callbacks=[checkpoints()]).fit(resumed, datamodule=CriteoDataModule(prepared_dir=prepared, batch_size=100,
                                                                        shuffle_buffer=250),
                                  ckpt_path=str(folder / "last.ckpt"))
        assert list(resumed.train_ids) == [2]
        assert resumed.train_ids[2] == whole.train_ids[2]


def test_synthetic_data_module_generates_once_and_streams(tmp_path, caplog):
    caplog.set_level("INFO")
    generator = {"n_rows": 5000, "seed": 3}
    dm = SyntheticCriteoDataModule(cache_dir=str(tmp_path), generator=generator, batch_size=512)
    assert caplog.text.count("generating 5000 synthetic Criteo rows") == 1
    dm.setup("fit")
    dm.setup("test")
    assert dm.has_validation
    assert dm.task_inputs()["cardinalities"] == list(dm.generator.cardinalities)
    rows = {s: sum(b.size for b in dm.stream(s)) for s in ("train", "valid", "test")}
    assert rows == {"train": 3500, "valid": 1000, "test": 500}
    again = SyntheticCriteoDataModule(cache_dir=str(tmp_path), generator=generator)
    assert again.prepared_dir == dm.prepared_dir
    assert caplog.text.count("generating 5000 synthetic Criteo rows") == 1
    no_valid = SyntheticCriteoDataModule(cache_dir=str(tmp_path), generator=generator, split=[0.8, 0.0, 0.2])
    assert no_valid.prepared_dir != dm.prepared_dir and not no_valid.has_validation
    for kwargs, message in (({"generator": {"n_rows": 0}}, "data.generator: n_rows must be an integer >= 1"),
                            ({"generator": {"colour": 1}}, "data.generator: "),
                            ({"split": [0.5, 0.2, 0.2]}, "data.split: split must be 3 fractions"),
                            ({"prepared_dir": "x"}, "not for synthetic data")):
        with pytest.raises(UserInputError, match=message) as error:
            SyntheticCriteoDataModule(cache_dir=str(tmp_path), **kwargs)
        assert "\n" not in str(error.value)

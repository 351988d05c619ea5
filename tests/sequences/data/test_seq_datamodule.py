"""HistoryDataModule: protocols, truncation, exclusion, jagged batches, shuffling, DDP and worker
shares and a mid-epoch resume (also at ml-20m's user count), config files. Expected rows are
worked out by hand from the tiny histories below, or checked against plain Python slicing of each
user's list."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from recforge.data.batches import HistoryBatch
from recforge.data.sequences.datamodule import HistoryDataModule, _EvalShard
from recforge.data.sequences.prepared import Histories, write_prepared
from recforge.errors import UserInputError

# u0: 6 events, u1: 4 (a repeated item), u2: 3, u3: 2, u4: 1. Item 6 is never seen.
USERS = {
    "u0": [0, 1, 2, 3, 4, 5],
    "u1": [5, 5, 1, 2],
    "u2": [3, 4, 0],
    "u3": [1, 2],
    "u4": [0],
}
N_ITEMS = 7


def histories_of(users: dict[str, list[int]], n_items: int) -> Histories:
    lengths = [len(v) for v in users.values()]
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    items = np.array([i for v in users.values() for i in v], dtype=np.int32)
    # Distinct, increasing times: 100 * user + position.
    timestamps = np.array([100 * u + p for u, n in enumerate(lengths) for p in range(n)], np.int64)
    return Histories(
        users=np.array(list(users), dtype=object), offsets=offsets, items=items,
        timestamps=timestamps, ratings=np.ones(len(items), np.float32),
        item_ids=np.array([f"m{j}" for j in range(n_items)], dtype=object),
        item_counts=np.bincount(items, minlength=n_items).astype(np.int64),
    )


def write_dir(path: Path, users=USERS, n_items=N_ITEMS) -> str:
    write_prepared(path, histories_of(users, n_items), dataset="test", inputs=[], params={})
    return str(path)


@pytest.fixture
def prepared(tmp_path) -> str:
    return write_dir(tmp_path / "prepared")


def rows_of(batch: HistoryBatch) -> list[tuple]:
    """(user, history, history times, target, target time, excluded) per row."""
    out = []
    for b in range(batch.size):
        lo, hi = batch.offsets[b].item(), batch.offsets[b + 1].item()
        excluded = None
        if batch.exclude_items is not None:
            e0, e1 = batch.exclude_offsets[b].item(), batch.exclude_offsets[b + 1].item()
            excluded = batch.exclude_items[e0:e1].tolist()
        out.append((batch.users[b].item(), batch.items[lo:hi].tolist(),
                    batch.timestamps[lo:hi].tolist(), batch.targets[b].item(),
                    batch.target_timestamps[b].item(), excluded))
    return out


def batch_of(dm: HistoryDataModule, split: str) -> HistoryBatch:
    dataset = dm.dataset(split)
    return dataset.collate(list(range(len(dataset))))


def test_loo_rows_by_hand(prepared, caplog):
    caplog.set_level("INFO")
    dm = HistoryDataModule(prepared_dir=prepared, max_seq_len=200)
    dm.setup("fit")
    assert "3 of 5 users dropped (fewer than 4 events)" in caplog.text
    # u0 = user 0, u1 = user 1 (time 100 + position).
    assert rows_of(batch_of(dm, "train")) == [
        (0, [0, 1, 2], [0, 1, 2], 3, 3, None),
        (1, [5], [100], 5, 101, None),
    ]
    assert rows_of(batch_of(dm, "val")) == [
        (0, [0, 1, 2, 3], [0, 1, 2, 3], 4, 4, [0, 1, 2, 3]),
        (1, [5, 5], [100, 101], 1, 102, [5]),
    ]
    assert rows_of(batch_of(dm, "test")) == [
        (0, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 5, 5, [0, 1, 2, 3, 4]),
        (1, [5, 5, 1], [100, 101, 102], 2, 103, [1, 5]),
    ]
    assert dm.has_validation


def test_truncation_and_exclusion_policies(prepared):
    dm = HistoryDataModule(prepared_dir=prepared, max_seq_len=2, exclude="history")
    assert rows_of(batch_of(dm, "test")) == [
        (0, [3, 4], [3, 4], 5, 5, [3, 4]),
        (1, [5, 1], [101, 102], 2, 103, [1, 5]),
    ]
    dm = HistoryDataModule(prepared_dir=prepared, max_seq_len=2, exclude="all_seen")
    assert [r[5] for r in rows_of(batch_of(dm, "test"))] == [[0, 1, 2, 3, 4], [1, 5]]
    assert [r[5] for r in rows_of(batch_of(dm, "val"))] == [[0, 1, 2, 3], [5]]
    dm = HistoryDataModule(prepared_dir=prepared, max_seq_len=2, exclude="none")
    batch = batch_of(dm, "test")
    assert batch.exclude_items is None and batch.exclude_offsets is None
    # Training rows never carry exclusions.
    assert HistoryDataModule(prepared_dir=prepared).dataset("train").exclude is None


def test_reference_protocol_by_hand(prepared, caplog):
    caplog.set_level("INFO")
    dm = HistoryDataModule(prepared_dir=prepared, protocol="reference", max_seq_len=3)
    dm.setup()
    assert "2 of 5 users dropped (fewer than 3 events)" in caplog.text
    assert not dm.has_validation and dm.val_dataloader() == []
    assert set(dm.splits) == {"train", "test"}
    assert rows_of(batch_of(dm, "train")) == [
        (0, [1, 2, 3], [1, 2, 3], 4, 4, None),
        (1, [5, 5], [100, 101], 1, 102, None),
        (2, [3], [200], 4, 201, None),
    ]
    assert rows_of(batch_of(dm, "test")) == [
        (0, [2, 3, 4], [2, 3, 4], 5, 5, [2, 3, 4]),
        (1, [5, 5, 1], [100, 101, 102], 2, 103, [1, 5]),
        (2, [3, 4], [200, 201], 0, 202, [3, 4]),
    ]
    with pytest.raises(UserInputError, match="data.protocol=reference has no 'val' split"):
        dm.dataset("val")


def test_task_inputs(prepared):
    dm = HistoryDataModule(prepared_dir=prepared, max_seq_len=50)
    inputs = dm.task_inputs()
    assert set(inputs) == {"n_items", "item_popularity", "max_seq_len"}
    assert inputs["n_items"] == N_ITEMS and inputs["max_seq_len"] == 50
    # Training spans only (history and target): u0 [0, 1, 2, 3], u1 [5, 5]; never a held-out item.
    popularity = inputs["item_popularity"]
    assert popularity.dtype == np.int64 and popularity.tolist() == [1, 1, 1, 1, 0, 2, 0]
    assert HistoryDataModule.batch_type is HistoryBatch


def random_users(rng, n_users, n_items, longest):
    return {f"u{u}": rng.integers(0, n_items, rng.integers(1, longest + 1)).tolist()
            for u in range(n_users)}


@pytest.mark.parametrize("protocol", ["loo", "reference"])
@pytest.mark.parametrize("max_seq_len", [1, 3, 1000])
@pytest.mark.parametrize("exclude", ["history", "all_seen"])
def test_batches_match_python_slicing(tmp_path, protocol, max_seq_len, exclude):
    rng = np.random.default_rng(max_seq_len)
    users = random_users(rng, 40, 30, 12)
    dm = HistoryDataModule(prepared_dir=write_dir(tmp_path / "p", users, 30), protocol=protocol,
                           max_seq_len=max_seq_len, exclude=exclude)
    lists = list(users.values())
    need = 4 if protocol == "loo" else 3
    kept = [u for u, seq in enumerate(lists) if len(seq) >= need]
    back = {"loo": {"train": 3, "val": 2, "test": 1}, "reference": {"train": 2, "test": 1}}[protocol]
    for split, k in back.items():
        dataset = dm.dataset(split)
        rows = []
        for chunk in np.array_split(np.arange(len(dataset)), 3):  # several batches
            rows += rows_of(dataset.collate(chunk.tolist()))
        assert [r[0] for r in rows] == kept
        for user, history, times, target, target_time, excluded in rows:
            seq = lists[user]
            t = len(seq) - k
            assert history == seq[:t][-max_seq_len:]  # the most recent ones, oldest first
            assert 1 <= len(history) <= max_seq_len
            assert target == seq[t]
            assert times == sorted(times) and target_time > max(times)
            if split != "train":
                seen = seq[:t] if exclude == "all_seen" else seq[:t][-max_seq_len:]
                assert excluded == sorted(set(seen))
    if protocol == "loo" and max_seq_len == 1000:
        # Every event of a kept user is in exactly one place: a training span, or a target.
        train, val, test = (dm.dataset(s).collate(list(range(len(kept)))) for s in
                            ("train", "val", "test"))
        for r, user in enumerate(kept):
            lo, hi = train.offsets[r].item(), train.offsets[r + 1].item()
            covered = train.items[lo:hi].tolist() + [train.targets[r].item(), val.targets[r].item(),
                                                       test.targets[r].item()]
            assert covered == lists[user]


def test_batch_dtypes_and_offsets(prepared):
    batch = batch_of(HistoryDataModule(prepared_dir=prepared), "test")
    for name in ("items", "timestamps", "offsets", "targets", "target_timestamps", "users",
                 "exclude_items", "exclude_offsets"):
        assert getattr(batch, name).dtype == torch.int64, name
    assert batch.offsets[0] == 0 and batch.offsets[-1] == batch.items.numel()
    assert batch.lengths.tolist() == [5, 3]


def test_no_user_left_is_a_clear_error(tmp_path):
    path = write_dir(tmp_path / "short", {"a": [0, 1, 2], "b": [1]}, 3)
    dm = HistoryDataModule(prepared_dir=path)
    with pytest.raises(UserInputError, match=r"no user has the 4 events data\.protocol=loo needs \(2 users, the longest history has 3\)"):
        dm.setup()
    HistoryDataModule(prepared_dir=path, protocol="reference").setup()  # 3 events are enough


def test_truncated_histories_are_counted_in_the_log(prepared, caplog):
    caplog.set_level("INFO")
    HistoryDataModule(prepared_dir=prepared, protocol="reference", max_seq_len=2).setup()
    # reference rows: u0 train 4 / test 5 events before the target, u1 2 / 3, u2 1 / 2
    assert "data.max_seq_len=2: histories cut to their most recent 2 items: train 1 of 3, test 2 of 3" \
        in caplog.text


@pytest.mark.parametrize("times,message", [
    ([0, 1, 5, 3], r"user 'a' has timestamp 3 at event 3 after 5; expected each user's events in time order"),
    ([0, 1, 2, -3], r"user 'a' has timestamp -3 at event 3; expected Unix seconds >= 0"),
])
def test_times_out_of_order_or_negative_are_refused_when_written_and_when_read(
        tmp_path, monkeypatch, times, message):
    """Such times would reach HSTU's time bias as wrong buckets, without a sign."""
    from recforge.data.sequences import prepared as prepared_module
    from recforge.data.sequences.prepared import PreparedDataError

    histories = histories_of({"a": [0, 1, 2, 3], "b": [1, 2, 3]}, 4)
    # the second user starting earlier than the first one ended is no disorder
    broken = Histories(**{**histories.__dict__, "timestamps": np.array([*times, 0, 1, 2], np.int64)})
    with pytest.raises(ValueError, match=message):
        write_prepared(tmp_path / "p", broken, dataset="test", inputs=[], params={})
    # a directory written without the check (another tool, an older version) is refused on load
    monkeypatch.setattr(prepared_module, "_check_times", lambda h: None)
    write_prepared(tmp_path / "p", broken, dataset="test", inputs=[], params={})
    monkeypatch.undo()
    with pytest.raises(PreparedDataError, match=r"^data\.prepared_dir=.*: histories: " + message):
        HistoryDataModule(prepared_dir=str(tmp_path / "p")).setup()


# ---------------------------------------------------------------------------- loaders
def order_of(loader) -> list[int]:
    return [u for batch in loader for u in batch.users.tolist()]


def test_training_order_is_a_function_of_seed_and_epoch(tmp_path, monkeypatch):
    """Shuffled per epoch, and the same (seed, epoch) gives the same order in a fresh loader: a
    resumed run trains in the order an uninterrupted one would."""
    rng = np.random.default_rng(0)
    path = write_dir(tmp_path / "p", random_users(rng, 60, 20, 8) | {f"long{i}": [1, 2, 3, 4]
                                                                       for i in range(40)}, 20)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")

    def epoch_order(loader, epoch):
        loader.sampler.set_epoch(epoch)  # what Lightning does before every epoch
        return order_of(loader)

    loader = HistoryDataModule(prepared_dir=path, batch_size=16).train_dataloader()
    first, second = epoch_order(loader, 0), epoch_order(loader, 1)
    assert sorted(first) == sorted(second) and len(set(first)) == len(first)
    assert first != second
    resumed = HistoryDataModule(prepared_dir=path, batch_size=16).train_dataloader()
    assert epoch_order(resumed, 1) == second and epoch_order(resumed, 0) == first
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")
    assert epoch_order(HistoryDataModule(prepared_dir=path, batch_size=16).train_dataloader(), 0) != first


def test_distributed_sampler_gives_each_user_once_per_epoch(tmp_path):
    users = {f"x{i}": [i % 7, 2, 3, 4, 5][: 4 + i % 2] for i in range(30)} | {"short": [1, 2]}
    dm = HistoryDataModule(prepared_dir=write_dir(tmp_path / "p", users, 20), batch_size=4)
    dataset = dm.dataset("train")
    assert len(dataset) == 30
    orders = []
    for epoch in (0, 1):
        shares = []
        for rank in (0, 1):
            # What Lightning injects under DDP (use_distributed_sampler), set to the epoch.
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=42)
            sampler.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler,
                                                 collate_fn=dataset.collate)
            shares.append(order_of(loader))
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == dataset.rows.users.tolist()
        orders.append(shares[0])
    assert orders[0] != orders[1]


# ---------------------------------------------------------------- at ml-20m's user count
# 150,000 users (ml-20m has 138,493) of 2-5 events each: the loader's shares and its resume at a
# real user count, with histories tiny enough to build in well under a second.
FULL_USERS = 150_000


@pytest.fixture(scope="module")
def many_users(tmp_path_factory) -> str:
    rng = np.random.default_rng(17)
    lengths = rng.integers(2, 6, FULL_USERS)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    n_items = 1000
    items = rng.integers(0, n_items, offsets[-1]).astype(np.int32)
    histories = Histories(
        users=np.array([f"u{u}" for u in range(FULL_USERS)], dtype=object), offsets=offsets, items=items,
        timestamps=np.arange(offsets[-1], dtype=np.int64),  # rising overall, so within each user
        ratings=np.ones(offsets[-1], np.float32),
        item_ids=np.array([f"m{j}" for j in range(n_items)], dtype=object),
        item_counts=np.bincount(items, minlength=n_items).astype(np.int64),
    )
    path = tmp_path_factory.mktemp("many") / "prepared"
    write_prepared(path, histories, dataset="test", inputs=[], params={})
    return str(path)


def rank_module(path: str, rank: int, world: int, **kwargs) -> HistoryDataModule:
    dm = HistoryDataModule(prepared_dir=path, **kwargs)
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)  # what DDP's trainer says
    return dm


def at_progress(dm: HistoryDataModule, epoch: int, batches: int) -> HistoryDataModule:
    """``dm`` as a fit at (epoch, batches trained in it) sees it: what Lightning's loop counts and
    a restored checkpoint restores."""
    dm.fit_progress = lambda: (epoch, batches, 0)
    return dm


def same_batches(a: list[HistoryBatch], b: list[HistoryBatch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(getattr(x, name), getattr(y, name)) for x, y in zip(a, b)
        for name in ("items", "timestamps", "offsets", "targets", "target_timestamps", "users"))


def test_ranks_and_workers_share_every_training_user_at_full_user_count(many_users):
    """World 2 x 2 workers over 150,000 users: each rank's loader (the module's own sampler, its
    rank from the trainer) gives its share in batches built by 2 worker processes, the same
    batches as without workers; the shares are disjoint and cover every training user once,
    apart from the rows DistributedSampler repeats so that both ranks take as many steps (fewer
    than the world); the next epoch reorders them."""
    dm = rank_module(many_users, 0, 1)
    train_users = dm.dataset("train").rows.users
    assert 70_000 < len(train_users) < 80_000  # loo keeps the users of 4-5 events, about 2 in 5
    lengths = dm.histories.lengths
    assert np.all(lengths[train_users] >= 4) and np.count_nonzero(lengths >= 4) == len(train_users)
    world, firsts = 2, []
    for epoch in (0, 1):
        shares = []
        for rank in range(world):
            plain = list(at_progress(rank_module(many_users, rank, world, batch_size=1000), epoch, 0)
                         .train_dataloader())
            workers = list(at_progress(rank_module(many_users, rank, world, batch_size=1000, num_workers=2),
                                       epoch, 0).train_dataloader())
            assert same_batches(plain, workers)
            shares.append(np.concatenate([b.users.numpy() for b in workers]))
        assert len(shares[0]) == len(shares[1]) == -(-len(train_users) // world)
        every = np.concatenate(shares)
        assert np.array_equal(np.unique(every), train_users)
        repeated = len(every) - len(train_users)
        assert repeated == (-len(train_users)) % world  # the padding, nothing more
        overlap = np.intersect1d(shares[0], shares[1])
        assert len(overlap) <= repeated
        firsts.append(shares[0][:1000])
    assert not np.array_equal(firsts[0], firsts[1])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_resume_gives_the_rest_of_the_uninterrupted_epoch_at_full_user_count(many_users, workers):
    """On each of 2 ranks: a run stopped after k batches of epoch 1 saves the loader's state; a
    fresh module (a resumed process) loading it yields exactly the batches the uninterrupted epoch
    had after the k-th, and the pass after it the whole of the next epoch."""
    world, epoch = 2, 1
    for rank, k in ((0, 7), (1, 30)):
        def loader(progress: list):
            dm = rank_module(many_users, rank, world, batch_size=1000, num_workers=workers)
            dm.fit_progress = lambda: progress[0]  # the fit's loop, as Lightning counts it
            return dm.train_dataloader()

        whole, after = list(loader([(epoch, 0)])), list(loader([(epoch + 1, 0)]))
        share = -(-len(rank_module(many_users, 0, 1).dataset("train")) // world)
        assert sum(b.size for b in whole) == share and len(whole) == -(-share // 1000) > k
        progress = [(epoch, 0, 0)]
        stopped, seen = loader(progress), []
        for batch in stopped:  # the fit stops after k batches: the checkpoint holds the loader's state
            seen.append(batch)
            progress[0] = (epoch, len(seen), 0)
            if len(seen) == k:
                break
        state = stopped.state_dict()
        assert state == {"epoch": epoch, "batches": k, "updates": 0}
        progress = [(epoch, k, 0)]  # what the restored checkpoint tells the fresh process's loop
        resumed = loader(progress)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert same_batches(seen + rest, whole) and same_batches(rest, whole[k:])
        progress[0] = (epoch + 1, 0, 0)  # the next epoch is whole again
        assert same_batches(list(resumed), after)


@pytest.mark.parametrize("world", [2, 3])
def test_evaluation_shards_split_users_without_repeats(tmp_path, world):
    path = write_dir(tmp_path / "p", {f"u{i}": [1, 2, 3, 4, 5] for i in range(11)}, 20)
    dm = HistoryDataModule(prepared_dir=path, eval_batch_size=3)
    seen = []
    for rank in range(world):
        dm.trainer = type("T", (), {"global_rank": rank, "world_size": world})()
        loader = dm.test_dataloader()
        assert isinstance(loader.sampler, DistributedSampler)  # so Lightning keeps it
        seen += order_of(loader)
    assert sorted(seen) == list(range(11))
    assert isinstance(_EvalShard(dm.dataset("test"), 1, 0), DistributedSampler)


def test_workers_give_the_same_batches(prepared):
    plain = HistoryDataModule(prepared_dir=prepared, eval_batch_size=1)
    workers = HistoryDataModule(prepared_dir=prepared, eval_batch_size=1, num_workers=1)
    a = [rows_of(b) for b in plain.test_dataloader()]
    b = [rows_of(b) for b in workers.test_dataloader()]
    assert a == b and len(a) == 2


def test_a_worker_hands_batches_over_as_bytes_not_shared_memory(prepared):
    """What a worker process sends (torch's multiprocessing pickler) comes back equal, as tensors
    over the unpickled bytes rather than one new shared-memory segment per tensor; a tensor that
    cannot be a numpy array (one in autograd) still travels as torch pickles it."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions, as a worker has them

    dm = HistoryDataModule(prepared_dir=prepared)
    for split in ("train", "test"):
        batch = batch_of(dm, split)
        back = pickle.loads(ForkingPickler.dumps(batch))
        assert type(back) is HistoryBatch and rows_of(back) == rows_of(batch)
        for name in ("items", "timestamps", "offsets", "targets", "target_timestamps", "users",
                     "exclude_items", "exclude_offsets"):
            value = getattr(back, name)
            assert (value is None) == (getattr(batch, name) is None) == (split == "train" and "exclude" in name)
            assert value is None or (value.dtype == torch.int64 and not value.is_shared()), name
    odd = batch_of(dm, "test")
    odd.targets = odd.targets.double().requires_grad_()
    back = pickle.loads(ForkingPickler.dumps(odd))
    assert back.targets.requires_grad and torch.equal(back.targets, odd.targets) and back.targets.is_shared()


def test_lightning_fit_and_test_with_history_batches(tmp_path):
    import lightning as L

    rng = np.random.default_rng(3)
    path = write_dir(tmp_path / "p", random_users(rng, 30, 15, 10), 15)
    dm = HistoryDataModule(prepared_dir=path, batch_size=8, eval_batch_size=8, max_seq_len=4)

    class Mean(L.LightningModule):
        def __init__(self, n_items):
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(n_items, 8, mode="mean")
            self.out = torch.nn.Linear(8, n_items)
            self.seen = []

        def forward(self, batch):
            return self.out(self.emb(batch.items, batch.offsets[:-1]))

        def training_step(self, batch, _):
            assert isinstance(batch, HistoryBatch) and batch.lengths.max() <= 4
            return torch.nn.functional.cross_entropy(self(batch), batch.targets)

        def validation_step(self, batch, _):
            self.seen += batch.users.tolist()

        def test_step(self, batch, _):
            assert batch.exclude_items is not None
            self.seen += batch.users.tolist()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Mean(**{k: v for k, v in dm.task_inputs().items() if k == "n_items"})
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    n = len(dm.splits["val"])
    assert sorted(module.seen) == sorted(dm.splits["val"].users.tolist()) and n > 0
    module.seen = []
    trainer.test(module, datamodule=dm, verbose=False)
    assert sorted(module.seen) == sorted(dm.splits["test"].users.tolist())


# ---------------------------------------------------------------------------- arguments
ML1M = ["1::10::5::100", "1::20::4::101", "1::30::3::102", "1::40::2::103", "2::10::1::50"]


def test_raw_ratings_are_prepared_once(tmp_path, caplog):
    import logging

    raw = tmp_path / "ratings.dat"
    raw.write_text("\n".join(ML1M) + "\n")
    movies = tmp_path / "movies.dat"
    movies.write_text("10::A (1995)::X\n20::B::X\n30::C::X\n40::D::X\n50::E::X\n")
    kwargs = dict(ratings_path=str(raw), items_path=str(movies), dataset="ml-1m",
                  prepared_dir=str(tmp_path / "prep"))
    dm = HistoryDataModule(**kwargs)
    assert dm.n_items == 5 and dm.histories.users.tolist() == ["1", "2"]
    with caplog.at_level(logging.INFO):
        HistoryDataModule(**kwargs)
    assert "up to date" in caplog.text
    # And the prepared directory alone, later.
    assert HistoryDataModule(prepared_dir=str(tmp_path / "prep")).task_inputs()["n_items"] == 5


def test_argument_errors(tmp_path, prepared):
    raw = tmp_path / "ratings.dat"
    raw.write_text("1::10::5::100\n1::x::4::101\n")
    with pytest.raises(UserInputError, match=rf"^data\.ratings_path: {raw}, line 2, column 2 \(MovieID\): expected an integer movie id, got 'x'$"):
        HistoryDataModule(ratings_path=str(raw), dataset="ml-1m", prepared_dir=str(tmp_path / "o"))
    with pytest.raises(UserInputError, match="data.ratings_path needs data.dataset"):
        HistoryDataModule(ratings_path=str(raw), prepared_dir=str(tmp_path / "o"))
    with pytest.raises(UserInputError, match=r"data\.preprocess: ml-1m: unknown parameter"):
        HistoryDataModule(ratings_path=str(raw), dataset="ml-1m", prepared_dir=str(tmp_path / "o"),
                          preprocess={"colums": []})
    with pytest.raises(UserInputError, match="data.items_path needs data.ratings_path"):
        HistoryDataModule(prepared_dir=prepared, items_path="movies.dat")
    with pytest.raises(UserInputError, match="data.prepared_dir is not set"):
        HistoryDataModule()
    with pytest.raises(UserInputError, match=r"data\.prepared_dir=.*nowhere: does not exist"):
        HistoryDataModule(prepared_dir=str(tmp_path / "nowhere")).setup()
    with pytest.raises(UserInputError, match=r"data\.max_seq_len=0: expected an integer >= 1"):
        HistoryDataModule(prepared_dir=prepared, max_seq_len=0)
    with pytest.raises(UserInputError, match=r"data\.exclude='seen'"):
        HistoryDataModule(prepared_dir=prepared, exclude="seen")
    with pytest.raises(UserInputError, match=r"data\.protocol='tuning'"):
        HistoryDataModule(prepared_dir=prepared, protocol="tuning")


def test_checkpoint_state_checks_the_catalogue(tmp_path, prepared):
    state = HistoryDataModule(prepared_dir=prepared).state_dict()
    HistoryDataModule(prepared_dir=prepared).load_state_dict(state)
    other = write_dir(tmp_path / "other", USERS, N_ITEMS + 1)
    with pytest.raises(UserInputError, match="another catalogue"):
        HistoryDataModule(prepared_dir=other).load_state_dict(state)


# ---------------------------------------------------------------------------- config files
@pytest.mark.parametrize("name,max_seq_len", [("ml-1m", 200), ("ml-20m", 200), ("amzn-books", 50),
                                              ("synthetic_histories", 200)])
def test_config_files_build(name, max_seq_len, tmp_path, prepared):
    from conftest import compose_config
    from hydra.utils import instantiate

    from recforge.config_values import check_config_values

    overrides = [f"data={name}"]
    if name == "synthetic_histories":
        overrides += ["data.generator.n_users=100", "data.generator.n_items=50",
                      "data.generator.max_length=30"]
    else:
        overrides += [f"data.prepared_dir={prepared}"]
    cfg = compose_config("train", overrides, tmp_path / "run", tmp_path / "data")
    assert cfg.data.max_seq_len == max_seq_len and cfg.data.batch_size == 128
    check_config_values(cfg)
    dm = instantiate(cfg.data)
    assert dm.task_inputs()["max_seq_len"] == max_seq_len
    dm.setup()
    assert len(dm.splits["test"]) > 0


@pytest.mark.parametrize("override,message", [
    ("data.max_seq_len=0", "data.max_seq_len=0: expected an integer >= 1"),
    ("data.exclude=seen", "data.exclude=seen: expected one of history, all_seen, none"),
    ("data.protocol=final", "data.protocol=final: expected one of loo, reference"),
    ("data.num_workers=-1", "data.num_workers=-1: expected an integer >= 0"),
])
def test_config_values_are_checked_in_one_line(override, message, tmp_path, prepared):
    from conftest import compose_config

    from recforge.config_values import ConfigValueError, check_config_values

    cfg = compose_config("train", ["data=ml-1m", f"data.prepared_dir={prepared}", override],
                         tmp_path / "run", tmp_path / "data")
    with pytest.raises(ConfigValueError) as info:
        check_config_values(cfg)
    assert str(info.value) == message

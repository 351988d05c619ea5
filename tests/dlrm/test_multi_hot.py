"""Multi-hot bags: the jagged SparseBags batch (against naive per-bag lists), MLPerf's synthetic
multi-hot expansion (first id kept, ids in range, the same bag for the same value anywhere,
uniform and Pareto draws), the sum-pooled lookup (against a naive loop over bags, forward and
backward, and bit-equal to the one-hot path for bags of one), the data module's bag batches, and
a DLRM training on them."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recforge.data.batches import CTRBatch, SparseBags
from recforge.data.criteo.datamodule import CriteoDataModule
from recforge.data.criteo.multi_hot import MLPERF_BAG_SIZES, MultiHot
from recforge.errors import UserInputError
from recforge.models.dlrm import DLRM, SparseArch

from test_criteo_datamodule import SIZES, write_prepared


def random_bags(rng: np.random.Generator, batch: int, cards: list[int], max_len: int = 4):
    """(SparseBags, naive ``bags[f][b]`` id lists) with empty bags among them."""
    naive = [[list(rng.integers(0, c, size=rng.integers(0, max_len + 1))) for _ in range(batch)] for c in cards]
    lengths = [len(bag) for feature in naive for bag in feature]
    values = [v for feature in naive for bag in feature for v in bag]
    offsets = np.r_[0, np.cumsum(lengths)]
    return SparseBags(torch.tensor(values, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64), batch), naive


def as_lists(bags: SparseBags) -> list[list[list[int]]]:
    o, v = bags.offsets.tolist(), bags.values.tolist()
    b = bags.batch_size
    return [[v[o[f * b + r]:o[f * b + r + 1]] for r in range(b)] for f in range(bags.n_features)]


# ---------------------------------------------------------------- SparseBags
def test_one_hot_rows_are_bags_of_one_feature_major():
    sparse = torch.tensor([[1, 2, 3], [4, 5, 6]])
    bags = SparseBags.from_one_hot(sparse)
    assert (bags.batch_size, bags.n_features) == (2, 3)
    assert as_lists(bags) == [[[1], [4]], [[2], [5]], [[3], [6]]]
    assert bags.lengths.tolist() == [[1, 1]] * 3


@pytest.mark.parametrize(("lo", "hi"), [(0, 7), (0, 1), (3, 5), (6, 7), (2, 100)])
def test_rows_equal_the_naive_slice(lo, hi):
    bags, naive = random_bags(np.random.default_rng(0), 7, [5, 9, 3])
    got = bags.rows(lo, hi)
    assert as_lists(got) == [feature[lo:hi] for feature in naive]
    assert got.batch_size == min(hi, 7) - lo
    batch = CTRBatch(torch.zeros(7, 13), bags, torch.arange(7.0))
    part = batch.rows(lo, hi)
    assert part.labels.tolist() == list(range(lo, min(hi, 7))) and as_lists(part.sparse) == as_lists(got)


def test_bags_that_do_not_tile_features_by_rows_are_refused():
    with pytest.raises(ValueError, match="not n_features x batch_size=2"):
        SparseBags(torch.zeros(3, dtype=torch.int64), torch.arange(4), 2)
    bags, _ = random_bags(np.random.default_rng(0), 4, [5])
    with pytest.raises(ValueError, match="expected 0 <= lo < hi"):
        bags.rows(2, 2)


# ---------------------------------------------------------------- MultiHot
CARDS = [1000, 7, 3, 50_000, 1]


def test_a_bag_starts_with_its_value_and_stays_in_its_table():
    hot = MultiHot((3, 8, 1, 100, 4), tuple(CARDS))
    rng = np.random.default_rng(0)
    for f, c in enumerate(CARDS):
        ids = rng.integers(0, c, size=500)
        bag = hot.bag(f, ids)
        assert bag.shape == (500, hot.sizes[f]) and bag.dtype == np.int64
        np.testing.assert_array_equal(bag[:, 0], ids)
        assert bag.min() >= 0 and bag.max() < c


def test_the_same_value_gets_the_same_bag_anywhere_and_seeds_differ():
    hot = MultiHot((5,) * 5, tuple(CARDS))
    ids = np.array([3, 17, 3, 999, 17])
    bag = hot.bag(0, ids)
    np.testing.assert_array_equal(bag[0], bag[2])
    np.testing.assert_array_equal(bag[1], bag[4])
    np.testing.assert_array_equal(hot.bag(0, ids[::-1]), bag[::-1])  # a row's bag is not a function of its batch
    assert not np.array_equal(bag[0], bag[1])
    assert not np.array_equal(MultiHot((5,) * 5, tuple(CARDS), seed=1).bag(0, ids), bag)
    assert not np.array_equal(hot.bag(3, ids)[:, 1:], hot.bag(0, ids)[:, 1:])  # features draw apart


def test_uniform_draws_cover_the_table_evenly():
    hot = MultiHot((101,) * 5, tuple(CARDS))
    extra = hot.bag(0, np.arange(1000))[:, 1:].ravel()  # 100,000 draws over 1000 rows
    counts = np.bincount(extra, minlength=1000)
    # chi-square with 999 degrees of freedom: mean 999, sd ~45; a bad hash lands far away
    chi2 = ((counts - 100.0) ** 2 / 100.0).sum()
    assert 800 < chi2 < 1200, chi2


def test_pareto_draws_favour_small_ids():
    hot = MultiHot((101,) * 5, tuple(CARDS), distribution="pareto")
    extra = hot.bag(3, np.arange(1000))[:, 1:].ravel()
    # Lomax(0.25): P(X < 1) = 1 - 2^-0.25 = 0.159, P(X < 10) = 1 - 11^-0.25 = 0.451
    assert np.mean(extra < 1) == pytest.approx(1 - 2**-0.25, abs=0.01)
    assert np.mean(extra < 10) == pytest.approx(1 - 11**-0.25, abs=0.01)
    assert extra.max() < CARDS[3]


def test_expand_is_every_feature_bags_feature_major():
    hot = MultiHot((3, 1, 2, 4, 1), tuple(CARDS))
    rng = np.random.default_rng(2)
    sparse = np.column_stack([rng.integers(0, c, size=6) for c in CARDS])
    bags = hot.expand(sparse)
    assert (bags.batch_size, bags.n_features) == (6, 5)
    assert as_lists(bags) == [hot.bag(f, sparse[:, f]).tolist() for f in range(5)]


def test_config_errors_name_the_key():
    cards = list(range(1, 27))
    assert MultiHot.from_config({"sizes": list(MLPERF_BAG_SIZES)}, cards).distribution == "uniform"
    cases = [
        ({"sizes": [1, 2]}, "data.multi_hot.sizes: expected 26 integers >= 1"),
        ({"sizes": [0] * 26}, "data.multi_hot.sizes"),
        ({"sizes": [1] * 26, "distribution": "zipf"}, "data.multi_hot.distribution: expected one of uniform, pareto"),
        ({"sizes": [1] * 26, "seed": -1}, "data.multi_hot.seed"),
        ({"sizes": [1] * 26, "size": 3}, "unknown key"),
    ]
    for config, message in cases:
        with pytest.raises(UserInputError, match=message):
            MultiHot.from_config(config, cards)


# ---------------------------------------------------------------- the sum-pooled lookup
def naive_pooled(arch: SparseArch, naive) -> torch.Tensor:
    """``[B, F, d]``: per row and feature, the sum of that feature's table rows, one by one."""
    d = arch.embedding_dim
    rows = []
    for b in range(len(naive[0])):
        per_feature = []
        for f, feature in enumerate(naive):
            total = torch.zeros(d)
            for v in feature[b]:
                total = total + arch.table(f)[v]
            per_feature.append(total)
        rows.append(torch.stack(per_feature))
    return torch.stack(rows)


@pytest.mark.parametrize("sparse_gradients", [True, False])
def test_pooled_bags_equal_a_naive_loop_forward_and_backward(sparse_gradients):
    torch.manual_seed(0)
    cards = [11, 5, 30, 2]
    arch = SparseArch(cards, 6, sparse_gradients=sparse_gradients)
    bags, naive = random_bags(np.random.default_rng(3), 9, cards)
    assert any(len(bag) == 0 for feature in naive for bag in feature)
    weight = torch.randn(9, len(cards), 6)
    (arch(bags) * weight).sum().backward()
    got = arch.embedding.weight.grad
    got = got.to_dense() if got.is_sparse else got
    arch.embedding.weight.grad = None
    want = naive_pooled(arch, naive)
    (want * weight).sum().backward()
    torch.testing.assert_close(arch(bags), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, arch.embedding.weight.grad, rtol=1e-6, atol=1e-6)


def test_bags_of_one_are_the_one_hot_lookup_exactly():
    torch.manual_seed(1)
    cards = [40, 3, 17]
    sparse = torch.stack([torch.randint(0, c, (12,)) for c in cards], 1)
    arch = SparseArch(cards, 8)
    one_hot = arch(sparse)
    bags = arch(SparseBags.from_one_hot(sparse))
    assert torch.equal(one_hot, bags)
    one_hot.pow(2).sum().backward()
    g1 = arch.embedding.weight.grad.coalesce()
    arch.embedding.weight.grad = None
    bags.pow(2).sum().backward()
    g2 = arch.embedding.weight.grad.coalesce()
    assert torch.equal(g1.indices(), g2.indices()) and torch.equal(g1.values(), g2.values())


def test_a_bag_id_outside_its_table_names_the_feature():
    arch = SparseArch([5, 3], 4)
    bags = SparseBags(torch.tensor([1, 4, 3]), torch.tensor([0, 2, 3]), 1)  # feature 1 holds 3 >= 3
    with pytest.raises(ValueError, match="value 3 of feature 1 is outside its table"):
        arch(bags)


def test_dlrm_on_bags_is_its_dense_path_over_naive_pooling():
    torch.manual_seed(2)
    cards = [13, 7, 5]
    for interaction in ("dot", "cat", "dcnv2"):
        model = DLRM(cards, dense_arch=[8], over_arch=[8], embedding_dim=4, interaction=interaction, dcn_rank=3)
        bags, naive = random_bags(np.random.default_rng(4), 6, cards)
        dense = torch.rand(6, 13)
        want = model._dense_path(dense, naive_pooled(model.sparse_arch, naive))
        torch.testing.assert_close(model(dense, bags), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="n_sparse = 3 features for B = 5 rows"):
        model(torch.rand(5, 13), bags)


# ---------------------------------------------------------------- the data module
def test_the_data_module_yields_bags_of_the_one_hot_rows(tmp_path, monkeypatch):
    import recforge.data.criteo.datamodule as dm_module

    monkeypatch.setattr(dm_module, "ITEM_ROWS", 128)  # items of two batches, cut by the loader
    prepared = write_prepared(tmp_path / "prepared")
    sizes = [3, 1] + [2] * 24
    plain = CriteoDataModule(prepared_dir=prepared, batch_size=64, eval_batch_size=50)
    multi = CriteoDataModule(prepared_dir=prepared, batch_size=64, eval_batch_size=50,
                             multi_hot={"sizes": sizes, "distribution": "uniform", "seed": 0})
    hot = multi.multi_hot
    assert hot.sizes == tuple(sizes) and list(hot.cardinalities) == plain.cardinalities
    for loader_a, loader_b in ((plain.test_dataloader(), multi.test_dataloader()),
                               (plain.train_dataloader(), multi.train_dataloader())):
        pairs = list(zip(loader_a, loader_b, strict=True))
        assert sum(b.size for b, _ in pairs) in (SIZES["test"], SIZES["train"])
        for one, bags in pairs:
            assert isinstance(bags.sparse, SparseBags) and bags.sparse.batch_size == one.size
            torch.testing.assert_close(bags.dense, one.dense)
            want = hot.expand(one.sparse.numpy())
            assert torch.equal(bags.sparse.values, want.values) and torch.equal(bags.sparse.offsets, want.offsets)
    with pytest.raises(UserInputError, match="data.multi_hot: expected null, mlperf"):
        CriteoDataModule(prepared_dir=prepared, multi_hot="mlperf2")
    assert CriteoDataModule(prepared_dir=prepared, multi_hot="mlperf").multi_hot.sizes == MLPERF_BAG_SIZES


@pytest.mark.slow
def test_dlrm_trains_on_mlperf_bags(make_cfg):
    from recforge.pipeline import build, train

    cfg = make_cfg("model=dlrm", "data.generator.n_rows=6000", "data.batch_size=128", "data.multi_hot=mlperf",
                   "model.dense_arch=[32,16]", "model.over_arch=[32]", "model.embedding_dim=8",
                   "optimizer=adam_rowwise_adagrad", "trainer.max_epochs=1")
    metrics = train(cfg)
    assert all(math.isfinite(metrics[f"test/{name}"]) for name in ("auc", "logloss", "accuracy"))
    datamodule, _ = build(cfg)
    batch = next(iter(datamodule.train_dataloader()))
    assert isinstance(batch.sparse, SparseBags)
    assert batch.sparse.values.numel() == 128 * sum(MLPERF_BAG_SIZES)

"""The synthetic Criteo generator: Criteo-shaped columns, exact split sizes, determinism that
does not depend on the chunk size, oracle metrics checked against independent computations
(scikit-learn, a naive pair count), calibrated labels, component scales, a learnable click
model, and the on-disk cache."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from sklearn_peer import sklearn_peer

from recforge.data.criteo.prepared import DENSE_COLUMNS, LABEL_COLUMN, SPARSE_COLUMNS, read_metadata, split_files
from recforge.data.criteo.synthetic import (
    BLOCK_ROWS,
    DEFAULT_CARDINALITIES,
    SyntheticClickModel,
    SyntheticCriteoConfig,
    ensure_synthetic_criteo,
    exact_auc,
    logloss,
    synthetic_criteo_key,
    write_synthetic_criteo,
)

N = 40_000  # not a multiple of BLOCK_ROWS, so the last block is partial


def read_split(path, split):
    """labels [n], dense [n, 13], sparse [n, 26] of ``split`` straight from its files."""
    table = pq.read_table([str(p) for p in split_files(path, split)])
    labels = table.column(LABEL_COLUMN).to_numpy()
    dense = np.column_stack([table.column(c).to_numpy() for c in DENSE_COLUMNS])
    sparse = np.column_stack([table.column(c).to_numpy() for c in SPARSE_COLUMNS])
    return labels, dense, sparse


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    config = SyntheticCriteoConfig(n_rows=N, seed=4)
    path = write_synthetic_criteo(config, tmp_path_factory.mktemp("synthetic") / "data")
    return config, path


def test_columns_look_like_criteo(generated):
    config, path = generated
    meta = read_metadata(path)
    assert meta["cardinalities"] == list(DEFAULT_CARDINALITIES)
    assert {s: meta["splits"][s]["rows"] for s in ("train", "valid", "test")} == {
        "train": 28_000, "valid": 8_000, "test": 4_000}
    labels, dense, sparse = (np.concatenate(c) for c in zip(*(read_split(path, s) for s in ("train", "valid", "test"))))
    assert labels.dtype == np.int8 and dense.dtype == np.float32 and sparse.dtype == np.int32
    assert set(np.unique(labels)) == {0, 1}
    assert abs(labels.mean() - config.base_ctr) < 0.015
    # Dense: log(1 + an integer count), zero when missing or zero, heavy tails (I5 in the millions).
    counts = np.expm1(dense.astype(np.float64))
    assert dense.min() >= 0 and np.allclose(counts, np.round(counts), rtol=1e-4, atol=1e-3)
    zero_share = (dense == 0).mean(axis=0)
    assert np.all(zero_share >= np.array(config.dense_missing) - 0.02)
    assert counts[:, 4].max() > 1e5 and np.median(counts[:, 4][counts[:, 4] > 0]) > 500
    # Sparse: indices inside their tables, index 0 as often as the missing rate says.
    assert sparse.min() >= 0 and np.all(sparse.max(axis=0) < np.array(DEFAULT_CARDINALITIES))
    np.testing.assert_allclose((sparse == 0).mean(axis=0), config.sparse_missing, atol=0.015)
    # Zipf-like: in the 100,000-value table the most common value is far above uniform's share.
    values = sparse[:, 2][sparse[:, 2] > 0]
    assert np.bincount(values).max() / len(values) > 100 / 100_000
    assert set(np.unique(sparse[:, 8]).tolist()) == {1, 2}  # C9: both values, never missing


def test_deterministic_and_independent_of_chunk_size(generated, tmp_path):
    config, path = generated
    other = write_synthetic_criteo(config, tmp_path / "chunked", chunk_rows=BLOCK_ROWS + 1)
    smallest = write_synthetic_criteo(config, tmp_path / "blocks", chunk_rows=1)
    for split in ("train", "valid", "test"):
        expected = read_split(path, split)
        for directory in (other, smallest):
            for a, b in zip(expected, read_split(directory, split)):
                np.testing.assert_array_equal(a, b)
            groups = [pq.ParquetFile(f).metadata.num_row_groups for f in split_files(directory, split)]
            assert groups == [pq.ParquetFile(f).metadata.num_row_groups for f in split_files(path, split)]
    assert read_metadata(other)["oracle"] == read_metadata(path)["oracle"]
    reseeded = write_synthetic_criteo(SyntheticCriteoConfig(n_rows=N, seed=5), tmp_path / "reseeded")
    assert not np.array_equal(read_split(reseeded, "test")[2], read_split(path, "test")[2])


def test_rows_do_not_depend_on_n_rows():
    # One click model for every size: a shorter run is a prefix of a longer one.
    short = SyntheticClickModel(SyntheticCriteoConfig(n_rows=1000)).rows(0, 1000)
    long = SyntheticClickModel(SyntheticCriteoConfig(n_rows=50_000)).rows(0, 3 * BLOCK_ROWS)
    for a, b in zip(short, long):
        np.testing.assert_array_equal(a, b[:1000])


def test_oracle_metrics_match_sklearn_on_the_stored_rows(generated):
    config, path = generated
    meta = read_metadata(path)
    model = SyntheticClickModel(config)
    for split in ("valid", "test"):
        labels, dense, sparse = read_split(path, split)
        # The click model reads only what is stored, so the files give back its probabilities.
        prob = model.probabilities(dense, sparse)
        want_auc = sklearn_peer("roc_auc", labels=labels, scores=prob)
        want_logloss = sklearn_peer("log_loss", labels=labels, probabilities=prob)
        assert meta["oracle"][split]["auc"] == pytest.approx(want_auc, abs=1e-12)
        assert meta["oracle"][split]["logloss"] == pytest.approx(want_logloss, abs=1e-9)
    assert meta["oracle_auc"] == meta["oracle"]["test"]["auc"]
    assert meta["oracle_logloss"] == meta["oracle"]["test"]["logloss"]
    assert 0.75 < meta["oracle_auc"] < 0.85  # Criteo-like difficulty (BARS' best is 0.8154)
    assert meta["generator"] == config.params()


def test_exact_auc_against_a_naive_pair_count():
    rng = np.random.default_rng(0)
    for n, levels in ((300, 5), (200, 1000), (50, 1)):
        scores = rng.integers(0, levels, size=n) / levels  # many ties
        labels = rng.random(n) < 0.3
        pos, neg = scores[labels], scores[~labels]
        pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
        assert exact_auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-12)
    assert np.isnan(exact_auc(np.ones(4), np.zeros(4)))
    p = np.array([0.1, 0.8, 0.5])
    y = np.array([0, 1, 0])
    assert logloss(p, y) == pytest.approx(-np.mean(np.log([0.9, 0.8, 0.5])))


def test_labels_are_bernoulli_draws_of_the_probabilities():
    labels, _, _, prob = SyntheticClickModel(SyntheticCriteoConfig()).rows(0, 6 * BLOCK_ROWS)
    edges = np.quantile(prob, np.linspace(0, 1, 11))
    which = np.clip(np.searchsorted(edges, prob, side="right") - 1, 0, 9)
    for k in range(10):
        rows = which == k
        mean_p = prob[rows].mean()
        se = np.sqrt(mean_p * (1 - mean_p) / rows.sum())
        assert abs(labels[rows].mean() - mean_p) < 4 * se + 1e-3


def test_logit_components_have_their_configured_scales():
    config = SyntheticCriteoConfig(main_effect_std=0.7, dense_effect_std=0.3, interaction_std=1.1)
    model = SyntheticClickModel(config)
    assert len(model.pairs) == config.n_interactions and len(model.dense_pairs) == config.n_dense_interactions
    _, dense, sparse, prob = model.rows(0, 4 * BLOCK_ROWS)
    parts = [w * p for w, p in zip(model._weights, model._components(dense, sparse))]
    for part, target in zip(parts, (0.7, 0.3, 1.1)):
        assert part.std() == pytest.approx(target, rel=0.05)
    assert prob.mean() == pytest.approx(config.base_ctr, abs=0.01)


def test_a_one_hot_logistic_regression_learns_the_click_model(generated):
    config, path = generated
    meta = read_metadata(path)
    train_labels, train_dense, train_sparse = read_split(path, "train")
    test_labels, test_dense, test_sparse = read_split(path, "test")
    auc = sklearn_peer("one_hot_logistic_auc", cardinalities=np.asarray(meta["cardinalities"]), C=0.1, max_iter=30,
                       train_labels=train_labels, train_dense=train_dense, train_sparse=train_sparse,
                       test_labels=test_labels, test_dense=test_dense, test_sparse=test_sparse)
    assert 0.64 < auc < meta["oracle_auc"]


def test_cache_is_reused_and_keyed_by_every_parameter(tmp_path, monkeypatch):
    config = SyntheticCriteoConfig(n_rows=3000)
    path = ensure_synthetic_criteo(config, tmp_path)
    assert path.name == synthetic_criteo_key(config)
    import recforge.data.criteo.synthetic as synthetic

    def refuse(*args, **kwargs):
        raise AssertionError("regenerated a cached dataset")

    monkeypatch.setattr(synthetic, "write_synthetic_criteo", refuse)
    assert ensure_synthetic_criteo(SyntheticCriteoConfig(n_rows=3000), tmp_path) == path
    monkeypatch.undo()
    keys = {synthetic_criteo_key(config), synthetic_criteo_key(config, (0.8, 0.1, 0.1)),
            synthetic_criteo_key(SyntheticCriteoConfig(n_rows=3001)),
            synthetic_criteo_key(SyntheticCriteoConfig(n_rows=3000, base_ctr=0.3)),
            synthetic_criteo_key(SyntheticCriteoConfig(n_rows=3000, cardinalities=[5] * 26))}
    assert len(keys) == 5
    # An incomplete directory (its metadata gone) is generated again.
    (path / "metadata.json").unlink()
    assert ensure_synthetic_criteo(config, tmp_path) == path
    assert json.loads((path / "metadata.json").read_text())["generator"]["n_rows"] == 3000


def test_a_split_without_rows_is_left_out(tmp_path):
    path = write_synthetic_criteo(SyntheticCriteoConfig(n_rows=2000), tmp_path / "d", split=(0.8, 0.0, 0.2))
    meta = read_metadata(path)
    assert sorted(meta["splits"]) == ["test", "train"] and "valid" not in meta["oracle"]
    assert meta["splits"]["train"]["rows"] == 1600


@pytest.mark.parametrize("kwargs,message", [
    ({"n_rows": 0}, "n_rows must be an integer >= 1"),
    ({"cardinalities": [10] * 25}, "cardinalities must be 26 integers >= 2"),
    ({"cardinalities": [1] + [10] * 25}, "cardinalities must be 26 integers >= 2"),
    ({"sparse_missing": [1.0] * 26}, "sparse_missing must be 26 rates in"),
    ({"base_ctr": 1.0}, "base_ctr must be in"),
    ({"n_interactions": 400}, "n_interactions must be in"),
])
def test_bad_config_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticCriteoConfig(**kwargs)


@pytest.mark.parametrize("split", [(0.5, 0.2, 0.2), (0.0, 0.5, 0.5), (0.7, 0.3)])
def test_bad_split(split, tmp_path):
    with pytest.raises(ValueError, match="split must be 3 fractions"):
        write_synthetic_criteo(SyntheticCriteoConfig(n_rows=10), tmp_path / "x", split=split)

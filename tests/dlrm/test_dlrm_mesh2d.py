"""DLRM on a 2 x 2 mesh (issue 19): two data-parallel ranks, each splitting the tables with a
second rank, against one process on the same global batches.

Oracle: one process whose batch ``k`` is the rows that the two data-parallel ranks read as their
batch ``k``. The mesh run's prepared data is the single run's with its training rows laid out so
(rank ``r`` reads the contiguous share ``r`` of the rows, see recforge.data.criteo.datamodule):
the loss is a mean over the batch, so the mean of the two ranks' gradients is the one process's.
"""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from split_table_runs import TABLE, eval_in_one_process, train_ranks

from recforge.data.criteo.prepared import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    SPARSE_COLUMNS,
    SPLITS,
    PreparedWriter,
    read_metadata,
    split_files,
)
from recforge.data.criteo.synthetic import (
    DEFAULT_CARDINALITIES,
    SyntheticCriteoConfig,
    write_synthetic_criteo,
)
from recforge.distributed.sharded_table import row_range

BATCH, STEPS = 64, 6  # per data-parallel rank: the one process takes 2 x BATCH rows a step
MODEL = ["model=dlrm", "model.dense_arch=[16,8]", "model.over_arch=[16]", "model.embedding_dim=8",
         "model.lazy_tables=true", "optimizer=rowwise_adagrad", "optimizer.dense.lr=0.05", "optimizer.sparse.lr=0.05",
         "evaluation.metrics=[auc,logloss,accuracy,count]"]
MESH = ["hardware=model_parallel_cpu", "trainer.devices=4", "trainer.strategy.data_parallel_size=2",
        "trainer.strategy.tensor_parallel_size=2"]


def _read(prepared, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = pq.read_table(split_files(prepared, split)).to_pandas()
    return (table[LABEL_COLUMN].to_numpy(), table[list(DENSE_COLUMNS)].to_numpy(),
            table[list(SPARSE_COLUMNS)].to_numpy())


def _write(out, source, meta: dict, train_order: np.ndarray):
    """``source``'s splits into ``out``, the training rows ``train_order`` of it, in that order."""
    kept = {k: v for k, v in meta.items() if k not in ("format", "version", "splits", "cardinalities",
                                                       "dense_transform")}
    with PreparedWriter(out) as writer:
        for split in SPLITS:
            if split in meta["splits"]:
                labels, dense, sparse = _read(source, split)
                rows = train_order if split == "train" else slice(None)
                writer.write(split, labels[rows], dense[rows], sparse[rows])
        writer.finish(meta["cardinalities"], **kept)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The one process's data (``STEPS`` batches of ``2 x BATCH`` training rows) and the mesh's."""
    root = tmp_path_factory.mktemp("mesh2d")
    # tiny tables: 26 of at most 300 rows
    config = SyntheticCriteoConfig(n_rows=3000, cardinalities=tuple(min(c, 300) for c in DEFAULT_CARDINALITIES))
    generated = write_synthetic_criteo(config, root / "generated")
    meta = read_metadata(generated)
    rows = 2 * BATCH * STEPS
    single = _write(root / "single", generated, meta, np.arange(rows))
    # the one process's row i is row j of its batch k = i // (2 BATCH), which data-parallel rank
    # r = j // BATCH reads as row j % BATCH of its batch k, from its share at r x rows / 2
    i = np.arange(rows)
    k, j = i // (2 * BATCH), i % (2 * BATCH)
    place = (j // BATCH) * (rows // 2) + k * BATCH + j % BATCH
    mesh = _write(root / "mesh", single, read_metadata(single), np.argsort(place))
    return single, mesh


def _run(args: list[str], log_dir, data, checkpoints: bool = False) -> dict:
    return train_ranks(MODEL, [*args, "data=criteo_kaggle", f"data.prepared_dir={data}", "data.shuffle=false",
                               f"data.eval_batch_size={BATCH * 3}", f"paths.data_dir={log_dir / 'data'}"],
                       log_dir, checkpoints)


@pytest.fixture(scope="module")
def mesh_epoch(tmp_path_factory, prepared):
    """One epoch on the 2 x 2 mesh with sparse table gradients (the default), its checkpoint kept:
    the sparse case of the equivalence test and the first leg of the resume test (four processes
    on two cores: the suite runs it once)."""
    return _run([*MESH, f"data.batch_size={BATCH}"], tmp_path_factory.mktemp("mesh_epoch"), prepared[1],
                checkpoints=True)


@pytest.mark.slow
@pytest.mark.parametrize("gradients", ["sparse", "dense"])
def test_a_2x2_mesh_trains_as_one_process_on_the_same_global_batches(tmp_path, prepared, mesh_epoch, gradients):
    """``STEPS`` updates: the ranks of one data-parallel index split the table's rows, the two
    data-parallel indices read different halves of every global batch. Each rank's rows (shaped by
    row-wise Adagrad), the dense layers and the test metrics (every row scored once) equal the one
    process's; the copies of a row, and of the dense layers, are identical across data-parallel
    ranks. The table shards' gradients are the rows a batch touched (``sparse``) or the whole
    shard (``dense``), averaged over the data-parallel ranks either way."""
    single_data, mesh_data = prepared
    table_gradients = [f"model.sparse_gradients={gradients == 'sparse'}".lower()]
    single = _run(["hardware=cpu", f"data.batch_size={2 * BATCH}", *table_gradients], tmp_path / "single",
                  single_data)
    mesh = mesh_epoch if gradients == "sparse" else _run([*MESH, f"data.batch_size={BATCH}", *table_gradients],
                                                         tmp_path / "mesh", mesh_data)
    assert "Initializing distributed: GLOBAL_RANK: 3, MEMBER: 4/4" in mesh["out"]
    (whole,), ranks = single["ranks"], mesh["ranks"]
    table = whole[TABLE]
    assert len(ranks) == 4
    for rank, saved in enumerate(ranks):
        # Lightning's mesh: rank = data-parallel index x 2 + table-sharding index
        start, end = saved[f"{TABLE}.rows"]
        assert (start, end) == row_range(len(table), 2, rank % 2)
        assert saved[TABLE].shape == (end - start, table.shape[1])  # half the table's memory
        # float round-off only: duplicate rows' gradients are summed in another order, which
        # Adagrad's 1/sqrt(G) scales up where G is tiny
        torch.testing.assert_close(saved[TABLE], table[start:end], rtol=1e-5, atol=1e-5)
        for name, value in whole.items():
            if name != TABLE:
                torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5)
                assert torch.equal(saved[name], ranks[0][name]), name
        if rank >= 2:
            assert torch.equal(saved[TABLE], ranks[rank - 2][TABLE])
    # each data-parallel rank read half of every global batch; the run's events count each row
    # once (the two table-sharding ranks of a data-parallel rank read the same rows)
    assert mesh["metrics"]["train/events"] == single["metrics"]["train/events"] == STEPS * 2 * BATCH
    for name in ("test/auc", "test/logloss", "test/accuracy", "val/auc"):
        assert mesh["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5), name
    assert mesh["metrics"]["test/count"] == single["metrics"]["test/count"] > 0


ONE = ["hardware=cpu", f"data.batch_size={2 * BATCH}"]
# a distributed checkpoint resumes on a mesh: one process is a 1 x 1 one
ONE_ON_A_MESH = ["hardware=model_parallel_cpu", "trainer.devices=1", "trainer.strategy.tensor_parallel_size=1",
                 f"data.batch_size={2 * BATCH}"]


@pytest.mark.slow
def test_a_2x2_run_resumed_on_one_process_then_on_the_mesh_trains_as_one_process(tmp_path, prepared, mesh_epoch):
    """Epoch 1 on the 2 x 2 mesh, epoch 2 on one process, epoch 3 on the mesh again (distributed
    checkpoints read at each layout) end where 3 epochs of one process end: every rank's rows, with
    the row-wise Adagrad state that shaped them, the dense layers and the test metrics. Then
    src/eval.py in one process, without a mesh, reads the last checkpoint and reports the same."""
    single_data, mesh_data = prepared
    on_mesh = [*MESH, f"data.batch_size={BATCH}"]
    straight = _run([*ONE, "trainer.max_epochs=3"], tmp_path / "straight", single_data)
    first = mesh_epoch  # epoch 1 on the mesh
    assert len(list(first["last"].glob("*.distcp"))) == 4
    second = _run([*ONE_ON_A_MESH, "trainer.max_epochs=2", f"ckpt_path={first['last']}"], tmp_path / "second",
                  single_data, checkpoints=True)
    third = _run([*on_mesh, "trainer.max_epochs=3", f"ckpt_path={second['last']}"], tmp_path / "third", mesh_data,
                 checkpoints=True)
    (whole,) = straight["ranks"]
    for rank, saved in enumerate(third["ranks"]):
        start, end = saved[f"{TABLE}.rows"]
        assert (start, end) == row_range(len(whole[TABLE]), 2, rank % 2)
        torch.testing.assert_close(saved[TABLE], whole[TABLE][start:end], rtol=1e-5, atol=1e-5)
        for name, value in whole.items():
            if name != TABLE:
                torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5)
    for name in ("test/auc", "test/logloss"):
        assert third["metrics"][name] == pytest.approx(straight["metrics"][name], rel=1e-5), name

    single = eval_in_one_process(third["last"], tmp_path / "eval", tmp_path / "data")
    for name in ("test/auc", "test/logloss", "test/accuracy"):
        assert single[name] == pytest.approx(third["metrics"][name], rel=1e-6), name

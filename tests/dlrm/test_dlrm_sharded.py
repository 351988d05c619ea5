"""DLRM with its tables split across processes (issue 19): ``hardware=model_parallel_cpu`` against
the same run in one process, lazy tables against eager ones, and the mesh refused in one line."""
from __future__ import annotations

import pytest
import torch
from conftest import REPO_ROOT
from split_table_runs import TABLE, eval_in_one_process, train_ranks

from recforge.config_checks import check_hardware
from recforge.errors import UserInputError
from recforge.models.dlrm import DLRM
from recforge.pipeline import train

SMALL = ["model=dlrm", "data.generator.n_rows=6000", "data.batch_size=128", "data.eval_batch_size=1000",
         "model.dense_arch=[32,16]", "model.over_arch=[32]", "model.embedding_dim=8"]


def test_lazy_tables_hold_the_eager_values_and_leave_the_generator_where_eager_does():
    # 70,000 rows: more than one block of the streamed draws
    cards, kwargs = [70_000, 3, 100], {"embedding_dim": 4, "dense_arch": [8], "over_arch": [8]}
    torch.manual_seed(5)
    eager = DLRM(cards, **kwargs)
    after_eager = torch.rand(3)
    torch.manual_seed(5)
    lazy = DLRM(cards, **kwargs, lazy_tables=True)
    after_lazy = torch.rand(3)
    assert lazy.sparse_arch.embedding.weight.is_meta  # nothing held before the draw
    with pytest.raises(RuntimeError, match="a lazy table is drawn in shard_rows"):
        lazy(torch.zeros(2, 13), torch.zeros(2, 3, dtype=torch.long))
    lazy.shard_tables(None)
    lazy.shard_tables(None)  # idempotent, as Lightning's configure_model must be
    assert torch.equal(after_eager, after_lazy)
    want, got = eager.state_dict(), lazy.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def _run(args: list[str], log_dir, data_dir, checkpoints: bool = False) -> dict:
    return train_ranks(SMALL, [*args, "trainer.limit_train_batches=12", f"paths.data_dir={data_dir}"], log_dir,
                       checkpoints)




@pytest.mark.slow
def test_two_processes_splitting_the_tables_train_as_one(tmp_path, data_dir):
    """12 updates of the same batches: each rank holds half of the table's rows, and those rows (with
    the row-wise Adagrad state that shaped them), the dense layers and the test metrics (every row
    scored once) equal the single process's. (Sparse SGD on split rows: tests/shared/test_sharded_table.py.)"""
    # count: how many rows the test split scored, which would double if both ranks' rows counted
    common = ["optimizer=rowwise_adagrad", "optimizer.dense.lr=0.05", "optimizer.sparse.lr=0.05",
              "model.lazy_tables=true", "evaluation.metrics=[auc,logloss,accuracy,count]"]
    single = _run(["hardware=cpu", *common], tmp_path / "single", data_dir)
    sharded = _run(["hardware=model_parallel_cpu", *common], tmp_path / "sharded", data_dir)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in sharded["out"]
    (whole,), ranks = single["ranks"], sharded["ranks"]
    table = whole[TABLE]
    assert [r[f"{TABLE}.rows"] for r in ranks] == [(0, -(-len(table) // 2)), (-(-len(table) // 2), len(table))]
    for rank in ranks:
        start, end = rank[f"{TABLE}.rows"]
        assert rank[TABLE].shape == (end - start, table.shape[1])  # its rows only: half the table's memory
        # float round-off only: duplicate rows' gradients are summed in another order (the shard's
        # subset coalesced, not the whole), which Adagrad's 1/sqrt(G) scales up where G is tiny
        torch.testing.assert_close(rank[TABLE], table[start:end], rtol=1e-5, atol=1e-5)
        for name, value in whole.items():
            if name != TABLE:
                torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-5)
    assert sharded["metrics"]["train/events"] == single["metrics"]["train/events"] == 12 * 128
    for name in ("test/auc", "test/logloss", "test/accuracy", "val/auc"):
        assert sharded["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5), name
    assert sharded["metrics"]["test/count"] == single["metrics"]["test/count"] > 0


@pytest.mark.slow
def test_norm_clipping_over_split_tables_trains_as_one_process(tmp_path, data_dir):
    """Clipping by the norm over every parameter, a table whose rows 2 processes split included:
    plain SGD (whose steps scale with the clipped gradient) at a norm well under the gradients',
    so every update is clipped. Both ranks' rows and dense layers equal the single process's, as
    they do only if each rank scales by the whole table's norm (tests/shared/test_clipping.py
    takes the norm itself apart)."""
    common = ["optimizer=sgd", "model.lazy_tables=true", "task.gradient_clip_val=0.01"]
    single = _run(["hardware=cpu", *common], tmp_path / "single", data_dir)
    sharded = _run(["hardware=model_parallel_cpu", *common], tmp_path / "sharded", data_dir)
    (whole,), ranks = single["ranks"], sharded["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        start, end = rank[f"{TABLE}.rows"]
        torch.testing.assert_close(rank[TABLE], whole[TABLE][start:end], rtol=1e-5, atol=1e-6)
        for name, value in whole.items():
            if name != TABLE:
                torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-6)
    assert sharded["metrics"]["test/auc"] == pytest.approx(single["metrics"]["test/auc"], rel=1e-5)


ONE_PROCESS = ["trainer.devices=1", "trainer.strategy.tensor_parallel_size=1"]


@pytest.mark.slow
def test_a_sharded_run_resumed_on_one_process_then_on_two_trains_as_an_uninterrupted_one(tmp_path, data_dir):
    """Epoch 1 on 2 ranks, epoch 2 on 1, epoch 3 on 2 again (distributed checkpoints, read at each
    world size) end where 3 epochs in one process end (which 2 ranks match: the test above): every
    rank's rows, the dense layers, the row-wise Adagrad state that shaped them, and the test
    metrics. Then src/eval.py in one process, without a mesh, reads the last checkpoint and reports
    the same metrics."""
    # no monitor: the checkpoint a run tests is its last epoch's, the one the next run resumes
    common = ["optimizer=rowwise_adagrad", "optimizer.dense.lr=0.05", "optimizer.sparse.lr=0.05",
              "model.lazy_tables=true"]
    split = [*common, "hardware=model_parallel_cpu"]
    straight = _run([*common, "hardware=cpu", "trainer.max_epochs=3"], tmp_path / "straight", data_dir)
    first = _run([*split, "trainer.max_epochs=1"], tmp_path / "first", data_dir, checkpoints=True)
    assert (first["last"] / ".metadata").is_file() and len(list(first["last"].glob("*.distcp"))) == 2
    second = _run([*split, *ONE_PROCESS, "trainer.max_epochs=2", f"ckpt_path={first['last']}"],
                  tmp_path / "second", data_dir, checkpoints=True)
    assert len(second["ranks"]) == 1 and second["ranks"][0][f"{TABLE}.rows"][0] == 0
    third = _run([*split, "trainer.max_epochs=3", f"ckpt_path={second['last']}"], tmp_path / "third", data_dir,
                 checkpoints=True)
    (whole,) = straight["ranks"]
    assert len(third["ranks"]) == 2
    for rank in third["ranks"]:
        start, end = rank[f"{TABLE}.rows"]
        torch.testing.assert_close(rank[TABLE], whole[TABLE][start:end], rtol=1e-5, atol=1e-5)
        for name, value in whole.items():
            if name != TABLE:
                torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-5)
    for name in ("test/auc", "test/logloss"):
        assert third["metrics"][name] == pytest.approx(straight["metrics"][name], rel=1e-5), name

    single = eval_in_one_process(third["last"], tmp_path / "eval", data_dir)
    for name in ("test/auc", "test/logloss", "test/accuracy"):
        assert single[name] == pytest.approx(third["metrics"][name], rel=1e-6), name


def test_a_distributed_checkpoint_does_not_resume_without_a_mesh_in_one_line(make_cfg, tmp_path):
    fake = tmp_path / "last.ckpt"
    fake.mkdir()
    (fake / ".metadata").write_bytes(b"")
    (fake / "meta.pt").write_bytes(b"")
    cfg = make_cfg(*SMALL, f"ckpt_path={fake}", "+run_config=" + str(REPO_ROOT / "conf" / "train.yaml"))
    with pytest.raises(UserInputError, match=r"is a distributed checkpoint \(hardware=model_parallel\*\): resume it "
                                             r"under hardware=model_parallel_cpu"):
        train(cfg)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model=hstu"], (r"^hardware=model_parallel_cpu splits DLRM's embedding tables across processes; model=hstu "
                      r"has none to split: use hardware=ddp_cpu or hardware=ddp$")),
    (["model=dlrm", "trainer.devices=3"], (r"^hardware=model_parallel_cpu: trainer.devices=3 cannot form a mesh of "
                                           r"data_parallel_size=1 x tensor_parallel_size=2; set "
                                           r"trainer.strategy.tensor_parallel_size=3$")),
    (["model=dlrm", "trainer.strategy.data_parallel_size=2", "trainer.devices=3"],
     (r"^hardware=model_parallel_cpu: trainer.devices=3 cannot form a mesh of data_parallel_size=2 x "
      r"tensor_parallel_size=2; set trainer.devices x trainer.num_nodes to a multiple of data_parallel_size=2$")),
    (["model=dlrm", "trainer.strategy.data_parallel_size=2", "trainer.devices=4", "+trainer.num_nodes=2"],
     (r"^hardware=model_parallel_cpu: trainer.devices=4 x trainer.num_nodes=2 cannot form a mesh of "
      r"data_parallel_size=2 x tensor_parallel_size=2; set trainer.strategy.tensor_parallel_size=4$")),
    (["model=dlrm", "trainer.strategy.tensor_parallel_size=0"],
     r"^hardware=model_parallel_cpu: trainer.strategy.tensor_parallel_size=0: expected a positive integer or auto$"),
])
def test_a_mesh_that_cannot_be_is_refused_in_one_line(make_cfg, overrides, message):
    cfg = make_cfg("hardware=model_parallel_cpu", *overrides)
    choices = {"hardware": "model_parallel_cpu", "model": overrides[0].split("=")[1]}
    with pytest.raises(UserInputError, match=message):
        check_hardware(cfg, choices)
    check_hardware(make_cfg("hardware=model_parallel_cpu", "model=dlrm"), choices)  # the preset itself passes


@pytest.mark.parametrize("mesh", [
    ["trainer.devices=4", "trainer.strategy.data_parallel_size=2"],  # 2 x 2
    ["trainer.devices=4", "trainer.strategy.data_parallel_size=4", "trainer.strategy.tensor_parallel_size=1"],
    ["trainer.devices=2", "+trainer.num_nodes=2", "trainer.strategy.data_parallel_size=auto",
     "trainer.strategy.tensor_parallel_size=auto"],  # Lightning's auto: a data-parallel rank per node
    # clipping: elementwise, or by the norm over every table row (the split rows' squares summed across processes)
    ["task.gradient_clip_val=1.0", "task.gradient_clip_algorithm=value"],
    ["task.gradient_clip_val=1.0"],
    ["trainer.strategy.data_parallel_size=2", "trainer.strategy.tensor_parallel_size=1", "task.gradient_clip_val=1.0"],
])
def test_a_mesh_of_several_data_parallel_ranks_is_accepted(make_cfg, mesh):
    check_hardware(make_cfg("hardware=model_parallel_cpu", "model=dlrm", *mesh),
                   {"hardware": "model_parallel_cpu", "model": "dlrm"})

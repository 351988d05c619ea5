"""Clipping sparse + dense gradients equals clipping their dense equivalents."""
import pytest
import torch

from recforge.optim.clipping import clip_grad_norm_, clip_grad_value_


def _grads(sparse: bool):
    torch.manual_seed(0)
    table = torch.nn.Embedding(20, 4, sparse=sparse)
    dense = torch.nn.Linear(4, 3)
    items = torch.tensor([1, 5, 5, 7, 1])  # duplicates: a sparse grad holds them uncoalesced
    out = dense(table(items)).pow(2).sum() * 3.0
    out.backward()
    return [table.weight, *dense.parameters()]


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_norm_clipping_matches_dense(max_norm):
    sparse, dense = _grads(True), _grads(False)
    total = clip_grad_norm_(sparse, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(dense, max_norm)
    assert float(total) == pytest.approx(float(expected), rel=1e-5)
    for s, d in zip(sparse, dense):
        got = s.grad.to_dense() if s.grad.is_sparse else s.grad
        torch.testing.assert_close(got, d.grad, rtol=1e-5, atol=1e-6)


def test_value_clipping_matches_dense():
    sparse, dense = _grads(True), _grads(False)
    clip_grad_value_(sparse, 0.3)
    torch.nn.utils.clip_grad_value_(dense, 0.3)
    for s, d in zip(sparse, dense):
        got = s.grad.to_dense() if s.grad.is_sparse else s.grad
        torch.testing.assert_close(got, d.grad)


# ---------------------------------------------------------------- a table split across processes
ROWS, DIM = 11, 3  # 11 rows over 2 ranks: 6 + 5


def _split_grads(table: torch.nn.Module, dense: torch.nn.Linear) -> None:
    items = torch.tensor([0, 3, 3, 7, 10, 10, 5])  # rows of both shards, duplicates in each
    (dense(table(items)).pow(2).sum() * 3.0).backward()


def _model(table: torch.nn.Module) -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(DIM, 2)


def _whole_table() -> torch.Tensor:
    return torch.empty(ROWS, DIM).uniform_(-1, 1, generator=torch.Generator().manual_seed(2))


def _split_worker(rank: int, max_norm: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from recforge.distributed.sharded_table import RowShardedEmbedding

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("table",))
    table = RowShardedEmbedding(ROWS, DIM, mesh["table"], sparse=True)
    table.load_state_dict({"weight": _whole_table()})
    dense = _model(table)
    _split_grads(table, dense)
    params = [table.weight, *dense.parameters()]
    total = clip_grad_norm_(params, max_norm, split=[table.weight], split_group=mesh["table"].get_group())
    return {"total": float(total), "rows": (table.start, table.end),
            "grads": [p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for p in params]}


@pytest.mark.slow
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_norm_clipping_of_a_table_split_across_processes_matches_the_whole_table(max_norm):
    """Each of 2 gloo processes holds half of the table's rows and the whole dense layer: the norm
    they clip by, and so every gradient, is the one process holding the whole table gets."""
    from gloo_ranks import run_ranks

    ranks = run_ranks(_split_worker, max_norm)
    table = torch.nn.Embedding(ROWS, DIM, sparse=True, _weight=_whole_table())
    dense = _model(table)
    _split_grads(table, dense)
    params = [table.weight, *dense.parameters()]
    want_total = clip_grad_norm_(params, max_norm)
    if max_norm < 1e6:
        assert float(want_total) > max_norm  # the clip applies: the scale must be the same everywhere
    for rank in (0, 1):
        start, end = ranks[rank]["rows"]
        assert ranks[rank]["total"] == pytest.approx(float(want_total), rel=1e-12)
        table_grad, *dense_grads = ranks[rank]["grads"]
        torch.testing.assert_close(table_grad, table.weight.grad.to_dense()[start:end], rtol=1e-6, atol=0)
        for got, p in zip(dense_grads, params[1:]):
            torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=0)

"""The dense layers' replication on a data_parallel x tensor_parallel mesh (issue 19), in 2 gloo
processes: rank 0's values become everyone's, gradients become their mean over the ranks, and the
sharded table is left to its own averaging. The end-to-end check (a 2 x 2 mesh trains as one
process) is tests/dlrm/test_dlrm_mesh2d.py."""
import pytest
import torch


GIVEN = ("linear.weight", "linear.bias", "scale")  # the dense parameters given a gradient


def _dense_layers(rank: int) -> dict:
    torch.manual_seed(10 + rank)  # every rank draws its own weights
    return {"linear": torch.nn.Linear(2, 3),
            "scale": torch.nn.Parameter(torch.randn(4, dtype=torch.float64)),  # a second dtype
            "unused": torch.nn.Parameter(torch.randn(2))}  # no gradient on any rank


def _model(rank: int, table_mesh):
    from recforge.distributed.sharded_table import RowShardedEmbedding

    model = torch.nn.Module()
    model.table = RowShardedEmbedding(5, 2, table_mesh, sparse=True)
    model.table.load_state_dict({"weight": torch.full((5, 2), float(rank))})
    for name, layer in _dense_layers(rank).items():
        setattr(model, name, layer)
    return model


def _worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from recforge.distributed.data_parallel import average_dense_grads_, dense_parameters, replicate_dense

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = _model(rank, mesh["tensor_parallel"])
    dense = dense_parameters(model)
    replicate_dense(model, mesh)
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    # gradients that differ by rank: (rank + 1) times a fixed pattern; the table's its own
    for i, name in enumerate(GIVEN):
        p = model.get_parameter(name)
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
    model.table.weight.grad = torch.full((5, 2), float(rank))
    average_dense_grads_(dense, mesh)
    return {"dense": [name for name, p in model.named_parameters() if any(p is q for q in dense)],
            "values": values, "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


@pytest.mark.slow
def test_dense_layers_start_as_rank_0s_and_step_on_the_ranks_mean_gradient():
    from gloo_ranks import run_ranks

    ranks = run_ranks(_worker)
    assert sorted(ranks[0]["dense"]) == ["linear.bias", "linear.weight", "scale", "unused"]
    rank0 = torch.nn.Module()
    for name, layer in _dense_layers(0).items():
        setattr(rank0, name, layer)
    for rank in (0, 1):
        values, grads = ranks[rank]["values"], ranks[rank]["grads"]
        for name in ("linear.weight", "linear.bias", "scale", "unused"):
            assert torch.equal(values[name], dict(rank0.named_parameters())[name]), (rank, name)
        assert torch.equal(values["table.weight"], torch.full((5, 2), float(rank)))  # not replicated
        assert torch.equal(grads["table.weight"], torch.full((5, 2), float(rank)))  # not averaged here
        # the mean of (r + 1) * pattern + i over r = 0, 1 is 1.5 * pattern + i
        for i, name in enumerate(GIVEN):
            p = dict(rank0.named_parameters())[name]
            want = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 1.5 + i
            assert grads[name].dtype == p.dtype
            torch.testing.assert_close(grads[name], want, rtol=0, atol=0)
        assert torch.equal(grads["unused"], torch.zeros(2))

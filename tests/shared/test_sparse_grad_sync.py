"""Averaging sparse item-table gradients across ranks (two gloo processes on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from torch import nn

from recforge.optim.sparse_grad_sync import average_sparse_grads_, sparse_parameter_names


def _rank_grads(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
    """Each rank's own gradient rows: different counts, repeats within and across ranks."""
    gen = torch.Generator().manual_seed(rank)
    n = (7, 3)[rank]
    table = (torch.randint(0, 10, (n,), generator=gen), torch.randn(n, 4, generator=gen))
    bias = (torch.randint(0, 10, (2 + rank,), generator=gen), torch.randn(2 + rank, 1, generator=gen))
    # the third table has no gradient on rank 1 at all
    extra = (torch.tensor([1, 1]), torch.ones(2, 4)) if rank == 0 else None
    return {"table": table, "bias": bias, "extra": extra}


def _worker(rank: int) -> dict:
    shapes = {"table": (10, 4), "bias": (10, 1), "extra": (10, 4)}
    params = {name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
    for name, grad in _rank_grads(rank).items():
        if grad is not None:
            rows, values = grad
            params[name].grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shapes[name])
    average_sparse_grads_(params.values())
    return {name: p.grad.to_dense() for name, p in params.items()}


@pytest.mark.slow
def test_two_ranks_get_the_mean_of_their_gradients():
    results = run_ranks(_worker)
    # oracle: each rank's gradient made dense by hand (duplicates summed), then averaged
    want = {}
    for name, shape in (("table", (10, 4)), ("bias", (10, 1)), ("extra", (10, 4))):
        total = torch.zeros(shape)
        for rank in (0, 1):
            grad = _rank_grads(rank)[name]
            if grad is not None:
                for r, v in zip(*grad):
                    total[r] += v
        want[name] = total / 2
    for rank in (0, 1):
        for name in want:
            torch.testing.assert_close(results[rank][name], want[name], msg=f"rank {rank}, {name}")


def test_sparse_parameter_names_finds_sparse_embeddings_only():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = nn.Embedding(5, 3, sparse=True)
            self.bias = nn.Embedding(5, 1, sparse=True)
            self.dense = nn.Embedding(5, 3)
            self.linear = nn.Linear(3, 3)

    class Task(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Model()

    assert sparse_parameter_names(Task()) == ["model.items.weight", "model.bias.weight"]


def test_a_dense_gradient_is_refused():
    p = nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.ones(3, 2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="sparse gradient"):
            average_sparse_grads_([p])
    finally:
        dist.destroy_process_group()

"""shared_row_lookup against its slow twin: one sparse nn.Embedding lookup of the concatenation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from recforge.models.row_lookup import shared_row_lookup


def _embedding_twin(weight: torch.Tensor, first: torch.Tensor, second: torch.Tensor):
    table = nn.Embedding(*weight.shape, sparse=True)
    with torch.no_grad():
        table.weight.copy_(weight)
    rows = table(torch.cat([first, second]))
    return table, rows[: len(first)], rows[len(first) :]


@pytest.mark.parametrize("use", ["both", "first", "second"])
def test_values_and_sparse_gradient_match_one_embedding_lookup(use):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 7, generator=gen)
    # repeats inside and across the two index sets, as targets and sampled negatives have
    first = torch.tensor([3, 3, 10, 49])
    second = torch.randint(0, 50, (40,), generator=gen)
    second[:3] = torch.tensor([3, 10, 10])
    grad_first = torch.randn(len(first), 7, generator=gen)
    grad_second = torch.randn(len(second), 7, generator=gen)

    table, twin_a, twin_b = _embedding_twin(weight, first, second)
    param = nn.Parameter(weight.clone())
    a, b = shared_row_lookup(param, first, second)
    torch.testing.assert_close(a, twin_a, rtol=0, atol=0)
    torch.testing.assert_close(b, twin_b, rtol=0, atol=0)

    def loss(x, y):
        terms = {"both": (x * grad_first).sum() + (y * grad_second).sum(),
                 "first": (x * grad_first).sum(), "second": (y * grad_second).sum()}
        return terms[use]

    loss(twin_a, twin_b).backward()
    loss(a, b).backward()
    mine, theirs = param.grad, table.weight.grad
    assert mine.is_sparse and theirs.is_sparse
    # the same uncoalesced entries in the same order, so the optimizer sums duplicates alike
    assert torch.equal(mine._indices(), theirs._indices())
    assert torch.equal(mine._values(), theirs._values())
    assert torch.equal(mine.coalesce().to_dense(), theirs.coalesce().to_dense())


def test_dense_gradient_equals_hand_summed_rows():
    weight = nn.Parameter(torch.zeros(5, 2))
    a, b = shared_row_lookup(weight, torch.tensor([1, 4]), torch.tensor([1, 1, 0]))
    (a.sum() + 2 * b.sum()).backward()
    # row 1: once in the first set (1) and twice in the second (2 + 2); row 4 once; row 0 (2)
    expected = torch.tensor([[2.0, 2.0], [5.0, 5.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    assert torch.equal(weight.grad.to_dense(), expected)

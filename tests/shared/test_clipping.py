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

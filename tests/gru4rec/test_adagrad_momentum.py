"""IndexedAdagradM against a naive per-row loop of spec §1.6."""
import pytest
import torch

from recforge.optim.adagrad_momentum import IndexedAdagradM


def naive_steps(table0, dense0, batches, lr, mu, eps):
    """Per element / per row, in float64: G += g²; v = μv − lr·g/√(G+ε); θ += v (lazy rows)."""
    table, dense = table0.clone().double(), dense0.clone().double()
    G_t, V_t = torch.zeros_like(table), torch.zeros_like(table)
    G_d, V_d = torch.zeros_like(dense), torch.zeros_like(dense)
    for rows, row_grads, dense_grad in batches:
        summed = {}
        for r, g in zip(rows.tolist(), row_grads.double()):
            summed[r] = summed.get(r, 0) + g  # duplicates are summed before the update
        for r, g in summed.items():
            G_t[r] += g * g
            step = g / torch.sqrt(G_t[r] + eps)
            if mu > 0:
                V_t[r] = mu * V_t[r] - lr * step
                table[r] += V_t[r]
            else:
                table[r] -= lr * step
        g = dense_grad.double()
        G_d += g * g
        step = g / torch.sqrt(G_d + eps)
        if mu > 0:
            V_d = mu * V_d - lr * step
            dense += V_d
        else:
            dense -= lr * step
    return table, dense


@pytest.mark.parametrize("mu", [0.0, 0.3])
def test_matches_naive_row_loop(mu):
    torch.manual_seed(0)
    n, d, lr, eps = 12, 3, 0.2, 1e-6
    table = torch.nn.Parameter(torch.randn(n, d, dtype=torch.float64))
    dense = torch.nn.Parameter(torch.randn(4, d, dtype=torch.float64))
    start_table, start_dense = table.detach().clone(), dense.detach().clone()
    opt = IndexedAdagradM([table, dense], lr=lr, momentum=mu, eps=eps)
    batches = []
    for _ in range(5):
        rows = torch.randint(0, n, (7,))  # with duplicates; most rows untouched
        row_grads = torch.randn(7, d, dtype=torch.float64)
        dense_grad = torch.randn(4, d, dtype=torch.float64)
        batches.append((rows, row_grads, dense_grad))
        table.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), row_grads, (n, d))
        dense.grad = dense_grad.clone()
        opt.step()
    want_table, want_dense = naive_steps(start_table, start_dense, batches, lr, mu, eps)
    torch.testing.assert_close(table.detach(), want_table)
    torch.testing.assert_close(dense.detach(), want_dense)


def test_rows_outside_the_batch_keep_their_velocity():
    table = torch.nn.Parameter(torch.zeros(3, 2))
    opt = IndexedAdagradM([table], lr=0.1, momentum=0.5)
    table.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 2), (3, 2))
    opt.step()
    after_first = table.detach().clone()
    velocity = opt.state[table]["velocity"].clone()
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (3, 2))
    opt.step()
    # row 0 not in the batch: no momentum step, no decay
    torch.testing.assert_close(table.detach()[0], after_first[0])
    torch.testing.assert_close(opt.state[table]["velocity"][0], velocity[0])
    assert not torch.equal(table.detach()[1], after_first[1])


def test_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="momentum"):
        IndexedAdagradM(p, momentum=1.0)
    with pytest.raises(ValueError, match="lr"):
        IndexedAdagradM(p, lr=0.0)

"""The row-wise Adagrad-momentum step: Triton twin vs the PyTorch reference vs a naive row loop.

On CPU-only machines the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest), so shapes stay small.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import recforge.kernels.rowwise_adagrad as ra
from recforge.kernels.rowwise_adagrad import sparse_adagrad_momentum_
from recforge.optim.adagrad_momentum import IndexedAdagradM

pytestmark = pytest.mark.triton

triton_usable = pytest.mark.skipif(
    ra.TRITON.unusable_reason(torch.zeros(1, 1)) is not None,
    reason="Triton cannot run here (not importable, or CPU without TRITON_INTERPRET=1)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def launches(monkeypatch):
    """Counts launches of the Triton twin, so a silent fallback cannot pass for a match."""
    calls = []
    module = ra.TRITON.module()
    if module is None:
        return calls
    real = module.sparse_adagrad_momentum_triton_

    def spy(*args, **kwargs):
        calls.append(args[3].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "sparse_adagrad_momentum_triton_", spy)
    return calls


def naive_rowwise(table, grad_sum, velocity, rows, values, lr, mu, eps):
    """Spec §1.6 one row at a time in float64: sum the duplicates, then update touched rows only."""
    table, grad_sum = table.double().clone(), grad_sum.double().clone()
    velocity = velocity.double().clone() if velocity is not None else None
    summed: dict[int, torch.Tensor] = {}
    for r, g in zip(rows.tolist(), values.double()):
        summed[r] = summed[r] + g if r in summed else g.clone()
    for r, g in summed.items():
        grad_sum[r] += g * g
        step = -lr * g / torch.sqrt(grad_sum[r] + eps)
        if velocity is not None:
            velocity[r] = mu * velocity[r] + step
            step = velocity[r]
        table[r] += step
    return table, grad_sum, velocity


def _problem(n_rows, width, nnz, seed, duplicates=True, extra_dims=()):
    gen = torch.Generator().manual_seed(seed)
    shape = (n_rows, width, *extra_dims)
    table = torch.randn(shape, generator=gen)
    grad_sum = torch.rand(shape, generator=gen) * 3  # a state that has seen earlier steps
    velocity = torch.randn(shape, generator=gen) * 0.1
    if duplicates:
        rows = torch.randint(0, n_rows, (nnz,), generator=gen)
    else:
        rows = torch.randperm(n_rows, generator=gen)[:nnz]
    values = torch.randn((nnz, width, *extra_dims), generator=gen)
    return table, grad_sum, velocity, rows, values


def _step(impl, table, grad_sum, velocity, rows, values, lr, mu, eps, **kwargs):
    table, grad_sum = table.clone().to(DEVICE), grad_sum.clone().to(DEVICE)
    velocity = velocity.clone().to(DEVICE) if mu > 0 else None
    grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, table.shape).to(DEVICE)
    sparse_adagrad_momentum_(table, grad_sum, velocity, grad, lr=lr, momentum=mu, eps=eps, kernel=impl, **kwargs)
    return table.cpu(), grad_sum.cpu(), None if velocity is None else velocity.cpu()


@triton_usable
@pytest.mark.parametrize("mu", [0.0, 0.3])
@pytest.mark.parametrize(
    "n_rows,width,nnz",
    [(40, 7, 25), (9, 33, 60), (300, 5, 1), (5, 16, 5)],  # sparse, many duplicates, one row, all rows
)
def test_triton_matches_reference_and_naive_loop(n_rows, width, nnz, mu, launches):
    lr, eps = 0.2, 1e-6
    problem = _problem(n_rows, width, nnz, seed=n_rows + nnz)
    got = _step("triton", *problem, lr, mu, eps)
    want = _step("pytorch", *problem, lr, mu, eps)
    oracle = naive_rowwise(*problem[:2], problem[2] if mu > 0 else None, *problem[3:], lr, mu, eps)
    assert launches == [nnz]
    for name, g, w, o in zip(("table", "grad_sum", "velocity"), got, want, oracle):
        if w is None:
            assert g is None and o is None
            continue
        # duplicate rows may be summed in another order than coalesce() sums them
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(g.double(), o, rtol=1e-5, atol=1e-6, msg=name)


def ieee_float32_step(table, grad_sum, velocity, rows, values, lr, mu, eps):
    """The reference's float operations, in its order, each rounded once in float32 (numpy)."""
    t, s, v = (x.numpy().copy() for x in (table, grad_sum, velocity))
    r, g = rows.numpy(), values.numpy()  # distinct rows
    f32 = np.float32
    s[r] = s[r] + g * g
    step = g / (np.sqrt(s[r] + f32(eps)) * f32(-1.0 / lr))
    if mu > 0:
        v[r] = v[r] * f32(mu) + step
        step = v[r]
    t[r] = t[r] + step
    return t, s, v if mu > 0 else None


@triton_usable
@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_without_duplicates_rounds_every_operation_once(mu):
    # The kernel does the reference's operations in its order, IEEE-rounded, and no FMA: bit for
    # bit the numpy float32 oracle. torch's CPU sqrt is not correctly rounded (one ulp off for
    # about a sixth of inputs), so the PyTorch path matches only to an ulp there; CUDA's is.
    problem = _problem(50, 19, 30, seed=4, duplicates=False)
    got = _step("triton", *problem, 0.05, mu, 1e-6)
    for mine, oracle in zip(got, ieee_float32_step(*problem, 0.05, mu, 1e-6)):
        assert (mine is None and oracle is None) or np.array_equal(mine.numpy(), oracle)
    if DEVICE == "cuda":
        want = _step("pytorch", *problem, 0.05, mu, 1e-6)
        for mine, theirs in zip(got, want):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs)


@triton_usable
def test_rows_wider_than_a_tile_and_more_sparse_dims(launches):
    # block_d=16 makes a 40-wide row three tiles, the last partial; [N, 4, 10] rows are 40 wide
    problem = _problem(12, 4, 20, seed=9, extra_dims=(10,))
    table, grad_sum, velocity, rows, values = problem
    t, g, v = table.clone().to(DEVICE), grad_sum.clone().to(DEVICE), velocity.clone().to(DEVICE)
    module = ra.TRITON.module()
    module.sparse_adagrad_momentum_triton_(
        t, g, v, rows.to(DEVICE), values.to(DEVICE), lr=0.1, momentum=0.2, eps=1e-6, block_d=16
    )
    want = _step("pytorch", *problem, 0.1, 0.2, 1e-6)
    assert launches == [20]
    for name, mine, theirs in zip(("table", "grad_sum", "velocity"), (t, g, v), want):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=2e-6, atol=1e-7, msg=name)


@triton_usable
def test_untouched_rows_and_an_empty_gradient():
    table, grad_sum, velocity, _, _ = _problem(10, 3, 0, seed=2)
    rows = torch.tensor([7, 2, 7])
    values = torch.randn(3, 3)
    got_table, got_sum, got_velocity = _step("triton", table, grad_sum, velocity, rows, values, 0.1, 0.4, 1e-6)
    untouched = [r for r in range(10) if r not in (2, 7)]
    assert torch.equal(got_table[untouched], table[untouched])
    assert torch.equal(got_sum[untouched], grad_sum[untouched])
    assert torch.equal(got_velocity[untouched], velocity[untouched])
    assert not torch.equal(got_table[[2, 7]], table[[2, 7]])

    empty = _step("triton", table, grad_sum, velocity, rows[:0], values[:0], 0.1, 0.4, 1e-6)
    for got, before in zip(empty, (table, grad_sum, velocity)):
        assert torch.equal(got, before)


@triton_usable
@pytest.mark.parametrize("mu", [0.0, 0.2])
def test_optimizer_switch_follows_the_reference_over_steps(mu, launches):
    """IndexedAdagradM(kernel='triton') over several steps: sparse table and dense weights."""
    torch.manual_seed(0)
    runs = {}
    for kernel in ("pytorch", "triton"):
        table = torch.nn.Parameter(torch.linspace(-1, 1, 60).reshape(20, 3).to(DEVICE))
        dense = torch.nn.Parameter(torch.ones(4, 3, device=DEVICE))
        opt = IndexedAdagradM([table, dense], lr=0.1, momentum=mu, eps=1e-6, kernel=kernel)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            rows = torch.randint(0, 20, (9,), generator=gen)
            table.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(9, 3, generator=gen), (20, 3)).to(DEVICE)
            dense.grad = torch.randn(4, 3, generator=gen).to(DEVICE)
            opt.step()
        runs[kernel] = (table.detach().cpu(), dense.detach().cpu())
    assert len(launches) == 6
    torch.testing.assert_close(runs["triton"][0], runs["pytorch"][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(runs["triton"][1], runs["pytorch"][1])  # dense steps share one code path


def test_unavailable_triton_warns_once_and_falls_back(monkeypatch, launches):
    monkeypatch.setattr(ra.TRITON, "available", lambda: False)
    monkeypatch.setattr(ra.TRITON, "warned", False)
    problem = _problem(8, 3, 6, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _step("triton", *problem, 0.1, 0.3, 1e-6)
        _step("triton", *problem, 0.1, 0.3, 1e-6)
    fallback = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallback) == 1 and "Triton could not be imported" in str(fallback[0].message)
    assert launches == []
    want = _step("pytorch", *problem, 0.1, 0.3, 1e-6)
    for g, w in zip(first, want):
        assert torch.equal(g, w)


@triton_usable
@pytest.mark.parametrize("case", ["float64", "strided"])
def test_unsupported_inputs_fall_back(case, monkeypatch, launches):
    monkeypatch.setattr(ra.TRITON, "warned", False)
    table, grad_sum, velocity, rows, values = _problem(8, 3, 6, seed=5)
    if case == "float64":
        table, grad_sum, velocity, values = (t.double() for t in (table, grad_sum, velocity, values))
        match = "float64"
    else:
        table = torch.randn(3, 8).t()  # a transposed view: rows are not contiguous
        match = "contiguous"
    grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, table.shape)
    want = table.clone()
    sparse_adagrad_momentum_reference = ra.sparse_adagrad_momentum_reference_
    sparse_adagrad_momentum_reference(want, grad_sum.clone(), velocity.clone(), grad, 0.1, 0.3, 1e-6)
    with pytest.warns(RuntimeWarning, match=match):
        sparse_adagrad_momentum_(table, grad_sum, velocity, grad, lr=0.1, momentum=0.3, kernel="triton")
    assert launches == [] and torch.equal(table, want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(grad=torch.zeros(4, 2)), "sparse COO"),
        (dict(grad=torch.zeros(4, 2).to_sparse(2)), "one sparse dimension"),
        (dict(grad=torch.zeros(5, 2).to_sparse(1)), "grad has shape"),
        (dict(velocity=None), "needs a velocity"),
        (dict(kernel="cuda"), "unknown kernel 'cuda'"),
    ],
)
def test_invalid_inputs(kwargs, match):
    args = dict(
        param=torch.zeros(4, 2), grad_sum=torch.zeros(4, 2), velocity=torch.zeros(4, 2),
        grad=torch.zeros(4, 2).to_sparse(1), lr=0.1, momentum=0.5,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sparse_adagrad_momentum_(**args)


def test_optimizer_rejects_an_unknown_kernel():
    with pytest.raises(ValueError, match="unknown optimizer.kernel 'cuda'"):
        IndexedAdagradM([torch.nn.Parameter(torch.zeros(1))], kernel="cuda")


@pytest.mark.slow
@triton_usable
def test_config_switch_trains_through_the_kernel(make_cfg, launches):
    """optimizer.kernel=triton: every training step's item-table update goes through the kernel."""
    from recforge.pipeline import train

    cfg = make_cfg("optimizer.kernel=triton", "task.n_sample=8", "trainer.fast_dev_run=2",
                   "data.batch_size=4", "data.steps_per_batch=1", "model.hidden_size=8")
    metrics = train(cfg)
    # two steps, two sparse tables each: Wy (4 inputs + 4 targets + 8 samples) and By (12 columns)
    assert launches == [16, 12, 16, 12]
    assert metrics["test/recall@20"] >= 0

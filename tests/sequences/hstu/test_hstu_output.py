"""HSTU output step ``x + dropout(u ⊙ LN(attn)) @ Wᵀ + b``: reference vs a written-out float64
computation, the dropout hash's statistics, and the Triton kernel vs the reference (TRITON_INTERPRET=1
on CPU), forward and every gradient, with the same dropout mask in both twins."""
from __future__ import annotations

import warnings

import pytest
import torch

from recforge.kernels.hstu_output import (
    TRITON,
    dropout_keep,
    dropout_keep_reference,
    dropout_key,
    hstu_output,
    hstu_output_reference,
)

triton_usable = pytest.mark.skipif(
    TRITON.unusable_reason(torch.zeros(1, 1)) is not None,
    reason="Triton cannot run here (not importable, or CPU without TRITON_INTERPRET=1)",
)

EPS = 1e-6
# float32 round-off through LayerNorm and a width-50 dot product on O(1) values; the reference's
# LayerNorm and matmuls are torch's own, so the twins agree to a few ulps of the outputs (~10).
RTOL, ATOL = 1e-5, 2e-5


def _inputs(n_rows: int, width: int, dim: int, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    """attn [T, E], u [T, E], x [T, D], weight [D, E], bias [D]; attn gets an offset and spread per
    row so LayerNorm's centring and scaling both matter."""
    gen = torch.Generator().manual_seed(seed)
    attn = torch.randn(n_rows, width, generator=gen) * 3 + torch.randn(n_rows, 1, generator=gen) * 5
    u = torch.randn(n_rows, width, generator=gen)
    x = torch.randn(n_rows, dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen) / width**0.5
    bias = torch.randn(dim, generator=gen)
    return [t.to(dtype) for t in (attn, u, x, weight, bias)]


def _run(kernel: str, tensors, grad_out: torch.Tensor | None, **kw):
    """Output and the five gradients for upstream gradient ``grad_out`` (as given: any strides)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = hstu_output(*leaves, kernel=kernel, **kw)
    if grad_out is None:
        return out.detach(), None
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), list(grads)


# ------------------------------------------------------------------------------ the reference
def _lowbias32(x: int) -> int:
    """The hash round, written independently on Python ints (unbounded: mask by hand)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_mask_hash_matches_python_integers() -> None:
    # the torch version splits each multiply into 16-bit halves to stay inside int64: check it
    # against exact integer arithmetic, element by element, seeds using both 32-bit words
    for seed in (0, 12345, 2**40 + 7, 2**64 - 1):
        k0, k1 = dropout_key(seed)
        keep = dropout_keep(3, 37, 0.4, seed)
        for flat in range(3 * 37):
            h = _lowbias32(_lowbias32(flat ^ k0) ^ k1)
            assert bool(keep.view(-1)[flat]) == ((h >> 8) >= round(0.4 * 2**24)), (seed, flat)


@pytest.mark.parametrize("keep_fn", [dropout_keep, dropout_keep_reference], ids=["int32-chunks", "int64"])
def test_both_mask_formulations_match_python_integers(keep_fn) -> None:
    seed, p = 2**63 + 12345, 0.3
    k0, k1 = dropout_key(seed)
    keep = keep_fn(5, 29, p, seed).view(-1)
    for flat in range(5 * 29):
        h = _lowbias32(_lowbias32(flat ^ k0) ^ k1)
        assert bool(keep[flat]) == ((h >> 8) >= round(p * 2**24)), flat


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (1, 2**16), (1, 2**16 + 1), (257, 255), (700, 301)])
def test_the_cpu_mask_in_int32_chunks_is_the_int64_mask(shape) -> None:
    # chunk boundaries (2^16), vector tails, and seeds whose keys have the int32 sign bit set
    for seed in (0, 7, 2**32 - 1, 2**40 + 3, 2**64 - 1):
        for p in (0.0, 0.2, 0.5, 0.99):
            assert torch.equal(dropout_keep(*shape, p, seed), dropout_keep_reference(*shape, p, seed)), (seed, p)


def _naive_float64(attn, u, x, weight, bias, p: float, seed: int) -> torch.Tensor:
    attn, u, x, weight, bias = (t.double() for t in (attn, u, x, weight, bias))
    n_rows, width = attn.shape
    mean = attn.sum(dim=1, keepdim=True) / width
    var = ((attn - mean) ** 2).sum(dim=1, keepdim=True) / width
    y = u * (attn - mean) / torch.sqrt(var + EPS)
    if p > 0:
        y = y * dropout_keep(n_rows, width, p, seed).double() / (1 - p)
    out = x.clone()
    for t in range(n_rows):
        for d in range(weight.shape[0]):
            out[t, d] += (y[t] * weight[d]).sum() + bias[d]
    return out


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(5, 50, 7), (4, 25, 3), (1, 8, 2), (0, 6, 4)], ids=str)
def test_reference_matches_naive_float64(shape, p) -> None:
    tensors = _inputs(*shape, seed=sum(shape))
    expected = _naive_float64(*tensors, p, seed=99)
    got64 = hstu_output_reference(*(t.double() for t in tensors), p, 99, EPS)
    torch.testing.assert_close(got64, expected, rtol=1e-12, atol=1e-12)
    got32 = hstu_output(*tensors, dropout_p=p, seed=99)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_reference_gradients_gradcheck(p) -> None:
    # the reference is the CPU training path: its autograd gradients must be right
    tensors = [t.double().requires_grad_() for t in _inputs(3, 6, 4, seed=5)]
    assert torch.autograd.gradcheck(
        lambda *ts: hstu_output(*ts, dropout_p=p, seed=3), tensors, eps=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_mask_drop_rate_and_independence(p) -> None:
    keep = dropout_keep(500, 1000, p, seed=7).float()
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs((1 - keep.mean().item()) - p) < 5 * sigma
    # rows and columns: each row's and each column's drop rate sits in its binomial spread
    assert ((1 - keep.mean(dim=1)) - p).abs().max() < 5 * (p * (1 - p) / 1000) ** 0.5
    assert ((1 - keep.mean(dim=0)) - p).abs().max() < 5 * (p * (1 - p) / 500) ** 0.5

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()

    limit = 5 / n**0.5  # five standard errors of a correlation of independent bits
    assert abs(corr(keep[:, :-1], keep[:, 1:])) < limit  # neighbouring counters
    assert abs(corr(keep[:-1], keep[1:])) < limit  # the same column in the next row
    for other_seed in (8, 7 + 2**32, 7 ^ (1 << 63)):  # the next seed, and each word of the seed
        assert abs(corr(keep, dropout_keep(500, 1000, p, seed=other_seed).float())) < limit


def test_mask_is_a_function_of_seed_and_flat_index() -> None:
    # the flat index is t·E + e: the same elements drop whatever [T, E] view of them is taken
    flat = dropout_keep(6, 10, 0.3, 4).view(-1)
    torch.testing.assert_close(flat, dropout_keep(3, 20, 0.3, 4).view(-1))
    torch.testing.assert_close(dropout_keep(2, 10, 0.3, 4), dropout_keep(6, 10, 0.3, 4)[:2])
    assert not torch.equal(dropout_keep(6, 10, 0.3, 4), dropout_keep(6, 10, 0.3, 5))
    assert dropout_keep(4, 5, 0.0, 1).all()


def test_dropout_scales_kept_values_and_unseeded_runs_follow_manual_seed() -> None:
    tensors = _inputs(64, 50, 8, seed=1)
    attn, u, x, weight, bias = tensors
    eye = torch.eye(50)  # weight = I: the output is y itself (plus x = 0, bias = 0)
    zeros = (torch.zeros(64, 50), torch.zeros(50))
    plain = hstu_output(attn, u, zeros[0], eye, zeros[1])
    dropped = hstu_output(attn, u, zeros[0], eye, zeros[1], dropout_p=0.25, seed=11)
    keep = dropout_keep(64, 50, 0.25, 11)
    torch.testing.assert_close(dropped[keep], plain[keep] / 0.75)
    assert (dropped[~keep] == 0).all()

    torch.manual_seed(3)
    a = hstu_output(*tensors, dropout_p=0.25)
    b = hstu_output(*tensors, dropout_p=0.25)
    torch.manual_seed(3)
    c = hstu_output(*tensors, dropout_p=0.25)
    assert torch.equal(a, c) and not torch.equal(a, b)
    # no dropout, no seed needed, and eval-mode output does not depend on one
    assert torch.equal(hstu_output(*tensors), hstu_output(*tensors, seed=5))


# ------------------------------------------------------------------------------ Triton twin
def _upstream(n_rows: int, dim: int, seed: int) -> torch.Tensor:
    # a random gradient laid out transposed (not contiguous), as a later transpose would hand it
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(dim, n_rows, generator=gen).t()


def _assert_twins_agree(tensors, grad_out, **kw) -> None:
    out_p, grads_p = _run("pytorch", tensors, grad_out, **kw)
    out_t, grads_t = _run("triton", tensors, grad_out, **kw)
    torch.testing.assert_close(out_t, out_p, rtol=RTOL, atol=ATOL)
    for name, g_t, g_p in zip(("attn", "u", "x", "weight", "bias"), grads_t, grads_p):
        assert g_t.shape == g_p.shape, name
        torch.testing.assert_close(
            g_t, g_p, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"d_{n}: {m}"
        )


@triton_usable
@pytest.mark.triton
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize(
    "shape", [(13, 50, 50), (9, 25, 12), (6, 64, 8), (1, 50, 16), (0, 50, 16)], ids=str
)
def test_triton_matches_reference(shape, p) -> None:
    # T = 13 and 9 leave a ragged last block of the interpreter's 4-row programs; E = 50 and 25
    # leave padding lanes in the 64- and 32-wide tiles
    tensors = _inputs(*shape, seed=sum(shape))
    grad_out = _upstream(shape[0], shape[2], seed=sum(shape))
    _assert_twins_agree(tensors, grad_out, dropout_p=p, seed=2024)


@triton_usable
@pytest.mark.triton
def test_triton_strided_inputs_and_stride0_upstream_gradient() -> None:
    # attn and u as column slices of one wide projection (row stride > E), and a stride-0
    # upstream gradient (what .sum().backward() hands down), which broke the upstream kernel
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(11, 130, generator=gen)
    attn, u = wide[:, 5:55], wide[:, 70:120]
    _, _, x, weight, bias = _inputs(11, 50, 9, seed=8)
    tensors = [attn, u, x, weight, bias]
    _assert_twins_agree(tensors, torch.full((1, 1), 0.7).expand(11, 9), dropout_p=0.2, seed=5)
    # and a column-strided attn (a transposed view): copied, then the same result
    attn_t = attn.t().contiguous().t()
    assert attn_t.stride(1) != 1
    _assert_twins_agree([attn_t, u, x, weight, bias], _upstream(11, 9, seed=3), dropout_p=0.2, seed=5)


@triton_usable
@pytest.mark.triton
def test_triton_drops_exactly_the_reference_mask() -> None:
    from recforge.kernels import hstu_output_triton as hot

    attn, u, *_ = _inputs(10, 50, 1, seed=4)
    for p, seed in ((0.3, 77), (0.5, 2**63 + 9)):
        y, mean, rstd = hot.hstu_output_forward(attn, u, p, seed, EPS)
        # u and the normalised attn are never exactly 0, so y is 0 exactly where the mask drops
        assert torch.equal(y != 0, dropout_keep(10, 50, p, seed))
        torch.testing.assert_close(mean, attn.mean(dim=1))
        torch.testing.assert_close(rstd, 1 / torch.sqrt(attn.var(dim=1, unbiased=False) + EPS))


@triton_usable
@pytest.mark.triton
def test_triton_partial_gradients_and_determinism() -> None:
    attn, u, x, weight, bias = _inputs(7, 25, 6, seed=12)
    grad_out = _upstream(7, 6, seed=12)
    # only weight and bias need gradients (e.g. frozen inputs): y is recomputed for d_weight alone
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    out = hstu_output(attn, u, x, w, b, dropout_p=0.4, seed=1, kernel="triton")
    gw, gb = torch.autograd.grad(out, (w, b), grad_out)
    _, grads_p = _run("pytorch", [attn, u, x, weight, bias], grad_out, dropout_p=0.4, seed=1)
    torch.testing.assert_close(gw, grads_p[3], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gb, grads_p[4], rtol=RTOL, atol=ATOL)
    # no atomics: two runs give bitwise-identical gradients
    first = _run("triton", [attn, u, x, weight, bias], grad_out, dropout_p=0.4, seed=1)[1]
    second = _run("triton", [attn, u, x, weight, bias], grad_out, dropout_p=0.4, seed=1)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ------------------------------------------------------------------------------ fallback, errors
def _count_launches(monkeypatch) -> list[int]:
    calls: list[int] = []
    module = TRITON.module()
    if module is not None:
        real = module._HSTUOutput.apply
        monkeypatch.setattr(module._HSTUOutput, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def test_unavailable_triton_warns_once_and_falls_back(monkeypatch) -> None:
    calls = _count_launches(monkeypatch)
    monkeypatch.setattr(TRITON, "available", lambda: False)
    monkeypatch.setattr(TRITON, "warned", False)
    tensors = _inputs(3, 10, 4, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = hstu_output(*tensors, dropout_p=0.2, seed=3, kernel="triton")
        b = hstu_output(*tensors, dropout_p=0.2, seed=3, kernel="triton")
    fallback = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallback) == 1
    assert "Triton could not be imported" in str(fallback[0].message)
    assert fallback[0].filename == __file__  # attributed to the caller's line
    assert calls == []
    expected = hstu_output(*tensors, dropout_p=0.2, seed=3)
    assert torch.equal(a, expected) and torch.equal(b, expected)


@triton_usable
@pytest.mark.triton
def test_float64_and_too_wide_rows_fall_back(monkeypatch) -> None:
    calls = _count_launches(monkeypatch)
    monkeypatch.setattr(TRITON, "warned", False)
    tensors64 = _inputs(3, 10, 4, seed=1, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="float64"):
        out = hstu_output(*tensors64, kernel="triton")
    assert calls == [] and out.dtype == torch.float64

    monkeypatch.setattr(TRITON.module(), "MAX_E", 32)
    monkeypatch.setattr(TRITON, "warned", False)
    tensors = _inputs(3, 50, 4, seed=1)
    with pytest.warns(RuntimeWarning, match="wider than"):
        out = hstu_output(*tensors, kernel="triton")
    assert calls == []
    assert torch.equal(out, hstu_output(*tensors))

    hstu_output(*_inputs(3, 32, 4, seed=1), kernel="triton")  # at the limit: the kernel runs
    assert calls == [1]


def _bad(**changes):
    tensors = dict(zip(("attn", "u", "x", "weight", "bias"), _inputs(3, 5, 4, seed=0)))
    kwargs = {k: changes.pop(k) for k in ("dropout_p", "seed", "eps", "kernel") if k in changes}
    tensors.update(changes)
    return tensors, kwargs


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (_bad(attn=torch.zeros(3, 5, 1)), r"attn must be 2-D \[T, E\]"),
        (_bad(u=torch.zeros(3, 6)), "u must have attn's shape"),
        (_bad(x=torch.zeros(2, 4)), r"x must be 2-D \[T, D\] with T=3"),
        (_bad(weight=torch.zeros(5, 4)), r"weight must be \[D, E\] = \[4, 5\]"),
        (_bad(bias=torch.zeros(5)), r"bias must be \[D\] = \[4\]"),
        (_bad(attn=torch.zeros(3, 0), u=torch.zeros(3, 0), weight=torch.zeros(4, 0)), "E >= 1"),
        (_bad(u=torch.zeros(3, 5, dtype=torch.float64)), "share one dtype"),
        (_bad(x=torch.zeros(3, 4, dtype=torch.long)), "floating-point"),
        (_bad(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
        (_bad(dropout_p=-0.1), r"dropout_p must be in \[0, 1\)"),
        (_bad(eps=0.0), "eps must be > 0"),
        (_bad(seed=1.5), "seed must be a Python int"),
        (_bad(kernel="cuda"), "unknown kernel 'cuda'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_inputs_raise_value_errors(case, match) -> None:
    tensors, kwargs = case
    for kernel in ("pytorch", "triton"):
        with pytest.raises(ValueError, match=match):
            hstu_output(*tensors.values(), **{"kernel": kernel, **kwargs})

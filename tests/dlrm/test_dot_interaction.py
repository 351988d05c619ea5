"""DLRM's dot interaction: the PyTorch reference against a per-row loop written from the definition,
and the Triton kernels (TRITON_INTERPRET=1 on CPU) against the reference, forward and both gradients
under random upstream gradients, with and without the diagonal, at odd batch sizes, F and d."""
from __future__ import annotations

import warnings

import pytest
import torch

from recforge.kernels.dot_interaction import TRITON, dot_interaction, dot_interaction_reference, n_pairs

triton_usable = pytest.mark.skipif(
    TRITON.unusable_reason(torch.zeros(1, 1)) is not None,
    reason="Triton cannot run here (not importable, or CPU without TRITON_INTERPRET=1)",
)

# float32 round-off on dots of up to 40 products of O(1) values: a few ulps of outputs up to ~40
RTOL, ATOL = 1e-5, 1e-5


def _inputs(batch: int, n_emb: int, dim: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dim, generator=gen)
    embeddings = torch.randn(batch, n_emb, dim, generator=gen)
    return dense.to(dtype), embeddings.to(dtype)


def _upstream(batch: int, width: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    # random, and laid out transposed (not contiguous), as a later transpose would hand it down
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(width, batch, generator=gen).to(dtype).t()


def _run(impl: str, dense, embeddings, itself: bool, grad_out: torch.Tensor | None):
    d = dense.detach().clone().requires_grad_()
    e = embeddings.detach().clone().requires_grad_()
    out = dot_interaction(d, e, itself, kernel=impl)
    if grad_out is None:
        return out.detach(), None
    return out.detach(), torch.autograd.grad(out, (d, e), grad_out)


# ------------------------------------------------------------------------------ the reference
def _naive(dense: torch.Tensor, embeddings: torch.Tensor, itself: bool) -> torch.Tensor:
    """Row by row from the definition: vectors [dense, e_1, ...], Z[i, j] = v_i·v_j for i > j (or
    i >= j), i ascending then j ascending, after dense."""
    rows = []
    for b in range(dense.shape[0]):
        vectors = [dense[b]] + [embeddings[b, f] for f in range(embeddings.shape[1])]
        values = list(dense[b])
        for i in range(len(vectors)):
            for j in range(i + 1 if itself else i):
                values.append((vectors[i] * vectors[j]).sum())
        rows.append(torch.stack(values))
    if not rows:
        return dense.new_zeros((0, dense.shape[1] + n_pairs(embeddings.shape[1] + 1, itself)))
    return torch.stack(rows)


@pytest.mark.parametrize("itself", [False, True])
@pytest.mark.parametrize("shape", [(4, 26, 16), (3, 5, 7), (1, 1, 1), (2, 0, 3), (0, 4, 5)], ids=str)
def test_reference_matches_a_per_row_loop(shape, itself) -> None:
    dense, embeddings = (t.double() for t in _inputs(*shape, seed=sum(shape)))
    out = dot_interaction(dense, embeddings, itself)
    n_features = shape[1] + 1
    assert out.shape == (shape[0], shape[2] + n_pairs(n_features, itself))
    assert n_pairs(27) == 351 and n_pairs(27, True) == 378
    torch.testing.assert_close(out, _naive(dense, embeddings, itself), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("itself", [False, True])
def test_reference_gradients_gradcheck(itself) -> None:
    dense, embeddings = (t.double().requires_grad_() for t in _inputs(3, 4, 5, seed=2))
    assert torch.autograd.gradcheck(lambda d, e: dot_interaction(d, e, itself), (dense, embeddings))


def test_mixed_dtypes_promote_like_torch_cat() -> None:
    # a bf16 MLP output beside fp32 tables (autocast) computes in fp32; each gradient comes back
    # in its input's dtype
    dense, embeddings = _inputs(3, 4, 8, seed=1)
    d = dense.bfloat16().requires_grad_()
    e = embeddings.requires_grad_()
    out = dot_interaction(d, e)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, dot_interaction_reference(d.detach().float(), embeddings.detach()))
    out.backward(torch.randn(out.shape))
    assert d.grad.dtype == torch.bfloat16 and e.grad.dtype == torch.float32


# ------------------------------------------------------------------------------ Triton twin
@triton_usable
@pytest.mark.triton
@pytest.mark.parametrize("itself", [False, True])
@pytest.mark.parametrize(
    "shape",
    [(5, 26, 16), (1, 26, 16), (7, 5, 3), (3, 9, 20), (2, 1, 1), (2, 0, 4), (0, 26, 16)],
    ids=str,
)
def test_triton_matches_reference(shape, itself) -> None:
    # B = 5 and 7 leave a ragged last program of the interpreter's two rows; F = 27, 6, 10 and d = 3,
    # 20 leave padding lanes in the 32- and 16-wide tiles; F_e = 0 has only the dense vector
    dense, embeddings = _inputs(*shape, seed=sum(shape))
    width = shape[2] + n_pairs(shape[1] + 1, itself)
    grad_out = _upstream(shape[0], width, seed=sum(shape))
    out_p, grads_p = _run("pytorch", dense, embeddings, itself, grad_out)
    out_t, grads_t = _run("triton", dense, embeddings, itself, grad_out)
    torch.testing.assert_close(out_t, out_p, rtol=RTOL, atol=ATOL)
    for name, g_t, g_p in zip(("dense", "embeddings"), grads_t, grads_p):
        torch.testing.assert_close(g_t, g_p, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"d_{n}: {m}")


@triton_usable
@pytest.mark.triton
@pytest.mark.parametrize("itself", [False, True])
def test_triton_walks_d_in_slices(itself) -> None:
    # d = 40 in 16-wide slices (the GPU setting): three slices, the last ragged, and three rows a
    # program; Z accumulates across the slices, dT is written slice by slice
    from recforge.kernels import dot_interaction_triton as dit

    dense, embeddings = _inputs(7, 6, 40, seed=3)
    config = {"rows": 3, "block_f": 16, "block_k": 16, "num_warps": 1}
    grad_out = _upstream(7, 40 + n_pairs(7, itself), seed=3)
    out = dit.dot_interaction_forward(dense, embeddings, itself, config)
    d_dense, d_emb = dit.dot_interaction_backward(grad_out, dense, embeddings, itself, config)
    out_p, (g_dense, g_emb) = _run("pytorch", dense, embeddings, itself, grad_out)
    torch.testing.assert_close(out, out_p, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d_dense, g_dense, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d_emb, g_emb, rtol=RTOL, atol=ATOL)


@triton_usable
@pytest.mark.triton
def test_triton_strided_inputs_and_stride0_upstream_gradient() -> None:
    # dense a column slice of a wider tensor, embeddings a slice of more features (strided rows and
    # features), and the stride-0 gradient .sum() hands down
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 30, generator=gen)
    many = torch.randn(6, 12, 11, generator=gen)
    dense, embeddings = wide[:, 4:15], many[:, 2:9]
    assert not dense.is_contiguous() and not embeddings.is_contiguous()
    width = 11 + n_pairs(8)
    for grad_out in (torch.full((1, 1), 0.7).expand(6, width), _upstream(6, width, seed=5)):
        out_p, grads_p = _run("pytorch", dense, embeddings, False, grad_out)
        out_t, grads_t = _run("triton", dense, embeddings, False, grad_out)
        torch.testing.assert_close(out_t, out_p, rtol=RTOL, atol=ATOL)
        for g_t, g_p in zip(grads_t, grads_p):
            torch.testing.assert_close(g_t, g_p, rtol=RTOL, atol=ATOL)


@triton_usable
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype) -> None:
    # half inputs, float32 accumulation, one rounding at the end: within a couple of half ulps of
    # the float32 result (the reference computed in float32 from the same half inputs)
    dense, embeddings = _inputs(5, 26, 16, seed=9, dtype=dtype)
    grad_out = _upstream(5, 16 + 351, seed=9, dtype=dtype)
    out_t, (d_dense, d_emb) = _run("triton", dense, embeddings, False, grad_out)
    assert out_t.dtype == d_dense.dtype == d_emb.dtype == dtype
    out_f, (g_dense, g_emb) = _run("pytorch", dense.float(), embeddings.float(), False, grad_out.float())
    tol = {"rtol": 1e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 4e-3}
    torch.testing.assert_close(out_t.float(), out_f, **tol)
    torch.testing.assert_close(d_dense.float(), g_dense, **tol)
    torch.testing.assert_close(d_emb.float(), g_emb, **tol)


@triton_usable
@pytest.mark.triton
def test_triton_partial_gradients_and_determinism() -> None:
    dense, embeddings = _inputs(5, 7, 6, seed=4)
    grad_out = _upstream(5, 6 + n_pairs(8, True), seed=4)
    e = embeddings.clone().requires_grad_()
    (g_emb,) = torch.autograd.grad(dot_interaction(dense, e, True, kernel="triton"), (e,), grad_out)
    _, grads_p = _run("pytorch", dense, embeddings, True, grad_out)
    torch.testing.assert_close(g_emb, grads_p[1], rtol=RTOL, atol=ATOL)
    # no atomics: two runs give bitwise-identical gradients
    first = _run("triton", dense, embeddings, True, grad_out)[1]
    second = _run("triton", dense, embeddings, True, grad_out)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ------------------------------------------------------------------------------ fallback, errors
def _count_launches(monkeypatch) -> list[int]:
    calls: list[int] = []
    module = TRITON.module()
    if module is not None:
        real = module._DotInteraction.apply
        monkeypatch.setattr(module._DotInteraction, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def test_unavailable_triton_warns_once_and_falls_back(monkeypatch) -> None:
    calls = _count_launches(monkeypatch)
    monkeypatch.setattr(TRITON, "available", lambda: False)
    monkeypatch.setattr(TRITON, "warned", False)
    dense, embeddings = _inputs(3, 4, 5, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = dot_interaction(dense, embeddings, kernel="triton")
        b = dot_interaction(dense, embeddings, kernel="triton")
    fallback = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallback) == 1
    assert "Triton could not be imported" in str(fallback[0].message)
    assert fallback[0].filename == __file__  # attributed to the caller's line
    assert calls == []
    expected = dot_interaction(dense, embeddings)
    assert torch.equal(a, expected) and torch.equal(b, expected)


@triton_usable
@pytest.mark.triton
def test_float64_and_too_many_features_fall_back(monkeypatch) -> None:
    calls = _count_launches(monkeypatch)
    monkeypatch.setattr(TRITON, "warned", False)
    dense, embeddings = _inputs(3, 4, 5, seed=1)
    with pytest.warns(RuntimeWarning, match="float64"):
        out = dot_interaction(dense.double(), embeddings.double(), kernel="triton")
    assert calls == [] and out.dtype == torch.float64

    monkeypatch.setattr(TRITON.module(), "MAX_F", 4)
    monkeypatch.setattr(TRITON, "warned", False)
    with pytest.warns(RuntimeWarning, match="F = 5 stacked vectors"):
        out = dot_interaction(dense, embeddings, kernel="triton")
    assert calls == []
    assert torch.equal(out, dot_interaction(dense, embeddings))

    dot_interaction(dense, embeddings[:, :3], kernel="triton")  # F = 4, at the limit: the kernel runs
    assert calls == [1]


@pytest.mark.parametrize(
    ("dense", "embeddings", "match"),
    [
        (torch.zeros(3, 4, 1), torch.zeros(3, 2, 4), r"dense must be 2-D \[B, d\]"),
        (torch.zeros(3, 4), torch.zeros(3, 8), r"embeddings must be 3-D \[B, F, d\] = \[3, F, 4\]"),
        (torch.zeros(3, 4), torch.zeros(2, 5, 4), r"= \[3, F, 4\]"),
        (torch.zeros(3, 4), torch.zeros(3, 5, 3), r"= \[3, F, 4\]"),
        (torch.zeros(3, 0), torch.zeros(3, 5, 0), "d >= 1"),
        (torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 5, 4), "dense must be a floating-point"),
        (torch.zeros(3, 4), torch.zeros(3, 5, 4, dtype=torch.int32),
         "embeddings must be a floating-point"),
        (torch.zeros(3, 4).numpy(), torch.zeros(3, 5, 4), "dense must be a tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_inputs_raise_value_errors(dense, embeddings, match) -> None:
    for impl in ("pytorch", "triton"):
        with pytest.raises(ValueError, match=match):
            dot_interaction(dense, embeddings, kernel=impl)


def test_unknown_impl() -> None:
    with pytest.raises(ValueError, match="unknown kernel 'cuda'"):
        dot_interaction(torch.zeros(2, 3), torch.zeros(2, 4, 3), kernel="cuda")

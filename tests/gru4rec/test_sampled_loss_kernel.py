"""Fused sampled softmax cross-entropy: Triton kernels vs the PyTorch reference (CrossEntropy)."""
from __future__ import annotations

import warnings

import pytest
import torch

import recforge.kernels.sampled_loss as sl
from recforge.kernels.sampled_loss import sampled_softmax_xe
from recforge.losses.sampled import CrossEntropy

pytestmark = pytest.mark.triton

triton_usable = pytest.mark.skipif(
    sl.TRITON.unusable_reason(torch.zeros(1, 1)) is not None,
    reason="Triton cannot run here (not importable, or CPU without TRITON_INTERPRET=1)",
)

BATCH_SIZE = 32
# fp32 round-off over a few ops per element; gradients are O(1 / BATCH_SIZE).
RTOL, ATOL = 2e-6, 1e-8


def _scores(n_rows: int, n_cols: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(n_rows, n_cols, generator=gen) * 3
    # ±magnitude: targets of some rows sit far below their negatives, so p_ii is tiny (30: about
    # exp(-60), the 1e-24 damps the gradient) or underflows to 0 (60: the loss is -log(1e-24)).
    magnitude = float(kind.split("_")[1])
    signs = torch.randint(0, 2, (n_rows, n_cols), generator=gen).float() * 2 - 1
    return signs * magnitude


def _log_q(n_cols: int, seed: int) -> torch.Tensor:
    # log of raw popularity counts, as the task passes them
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.log(torch.randint(1, 5000, (n_cols,), generator=gen).float())


def _value_and_grad(impl: str, scores: torch.Tensor, log_q, logq: float, upstream: float = 1.0):
    s = scores.clone().requires_grad_()
    loss = sampled_softmax_xe(s, log_q, logq, BATCH_SIZE, kernel=impl)
    (grad,) = torch.autograd.grad(loss * upstream, s)
    return loss.detach(), grad


def _shapes():
    for n_rows in (1, 3, 17):
        for n_cols in sorted({n_rows, n_rows + 5, 70}):
            yield n_rows, n_cols


@triton_usable
@pytest.mark.parametrize("logq", [0.0, 0.8])
@pytest.mark.parametrize("kind", ["random", "pm_30", "pm_60"])
@pytest.mark.parametrize("shape", list(_shapes()), ids=lambda s: f"{s[0]}x{s[1]}")
def test_triton_matches_reference(shape, kind, logq) -> None:
    n_rows, n_cols = shape
    scores = _scores(n_rows, n_cols, kind, seed=n_rows * 100 + n_cols)
    log_q = _log_q(n_cols, seed=n_cols)
    loss_t, grad_t = _value_and_grad("triton", scores, log_q, logq)
    loss_p, grad_p = _value_and_grad("pytorch", scores, log_q, logq)
    assert loss_t.dtype == torch.float32 and loss_t.shape == ()
    torch.testing.assert_close(loss_t, loss_p, rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(grad_t, grad_p, rtol=RTOL, atol=ATOL)
    assert torch.isfinite(grad_t).all()


@triton_usable
def test_extreme_target_gradient_is_damped_like_the_reference() -> None:
    # Row 0's target is 60 below every negative: p_00 ~ exp(-60) ~ 1e-26, so p/(p + 1e-24) ~ 0.01
    # scales the whole row's gradient; without the eps term the target's gradient would be ~ -1.
    scores = torch.full((2, 6), 30.0)
    scores[0, 0] = -30.0
    loss_t, grad_t = _value_and_grad("triton", scores, None, 0.0)
    loss_p, grad_p = _value_and_grad("pytorch", scores, None, 0.0)
    torch.testing.assert_close(loss_t, loss_p, rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(grad_t, grad_p, rtol=RTOL, atol=ATOL)
    p00 = torch.softmax(scores[0], 0)[0]
    expected = -(1 - p00) * p00 / (p00 + 1e-24) / BATCH_SIZE
    torch.testing.assert_close(grad_t[0, 0], expected, rtol=1e-5, atol=0)
    assert 0 < -grad_t[0, 0] * BATCH_SIZE < 0.1


@triton_usable
@pytest.mark.parametrize("logq", [0.0, 1.0])
def test_equals_cross_entropy_loss_module(logq) -> None:
    scores = _scores(5, 12, "random", seed=7)
    log_q = _log_q(12, seed=3)
    s_ref = scores.clone().requires_grad_()
    ref = CrossEntropy(logq)(s_ref, BATCH_SIZE, log_q)
    (g_ref,) = torch.autograd.grad(ref, s_ref)
    loss_t, grad_t = _value_and_grad("triton", scores, log_q, logq)
    torch.testing.assert_close(loss_t, ref.detach(), rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(grad_t, g_ref, rtol=RTOL, atol=ATOL)
    # the pytorch path is the module itself: bit-identical
    loss_p, grad_p = _value_and_grad("pytorch", scores, log_q, logq)
    assert torch.equal(loss_p, ref.detach()) and torch.equal(grad_p, g_ref)


@triton_usable
def test_upstream_gradient_log_q_gradient_and_strided_scores() -> None:
    # upstream gradient != 1, log_q requiring grad, and a transposed (non-contiguous) score view
    base = _scores(9, 4, "random", seed=11)  # [C, B'] so that .T is [B', C] with stride (1, B')
    log_q = _log_q(9, seed=5)
    grads = {}
    for impl in ("triton", "pytorch"):
        s = base.clone().T.requires_grad_()
        assert not s.is_contiguous()
        q = log_q.clone().requires_grad_()
        loss = sampled_softmax_xe(s, q, 0.5, BATCH_SIZE, kernel=impl)
        grads[impl] = torch.autograd.grad(loss * -2.5, (s, q))
    for got, want in zip(grads["triton"], grads["pytorch"]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@triton_usable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_scores_computed_in_float32(dtype) -> None:
    scores = _scores(4, 11, "random", seed=2).to(dtype)
    loss_t, grad_t = _value_and_grad("triton", scores, None, 0.0)
    assert loss_t.dtype == dtype and grad_t.dtype == dtype
    # the kernel reads the half scores and computes in fp32: compare with the fp32 reference
    loss_p, grad_p = _value_and_grad("pytorch", scores.float(), None, 0.0)
    torch.testing.assert_close(loss_t.float(), loss_p, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(grad_t.float(), grad_p, rtol=1e-2, atol=1e-4)


def _count_launches(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = sl._SampledSoftmaxXE.apply
    monkeypatch.setattr(sl._SampledSoftmaxXE, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def test_unavailable_triton_warns_once_and_falls_back(monkeypatch) -> None:
    monkeypatch.setattr(sl.TRITON, "available", lambda: False)
    monkeypatch.setattr(sl.TRITON, "warned", False)
    calls = _count_launches(monkeypatch)
    scores = _scores(3, 8, "random", seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_a, grad_a = _value_and_grad("triton", scores, None, 0.0)
        loss_b, _ = _value_and_grad("triton", scores, None, 0.0)
    fallback = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallback) == 1
    assert "Triton could not be imported" in str(fallback[0].message)
    assert fallback[0].filename == __file__  # attributed to the caller's line
    assert calls == []
    loss_p, grad_p = _value_and_grad("pytorch", scores, None, 0.0)
    assert torch.equal(loss_a, loss_p) and torch.equal(grad_a, grad_p)
    assert torch.equal(loss_b, loss_p)


@triton_usable
def test_float64_falls_back(monkeypatch) -> None:
    monkeypatch.setattr(sl.TRITON, "warned", False)
    calls = _count_launches(monkeypatch)
    scores = _scores(3, 8, "random", seed=1).double()
    with pytest.warns(RuntimeWarning, match="float64"):
        loss, _ = _value_and_grad("triton", scores, None, 0.0)
    assert calls == [] and loss.dtype == torch.float64


@triton_usable
def test_triton_path_launches(monkeypatch) -> None:
    calls = _count_launches(monkeypatch)
    _value_and_grad("triton", _scores(2, 3, "random", seed=0), None, 0.0)
    assert calls == [1]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(3), None, 0.0, 4), "2-D"),
        ((torch.zeros(4, 3), None, 0.0, 4), "C >= B'"),
        ((torch.zeros(2, 3), None, 0.5, 4), "log sampling weights"),
        ((torch.zeros(2, 3), torch.zeros(2), 0.5, 4), r"log_q must be 1-D \[C\]"),
        ((torch.zeros(2, 3), None, 0.0, 0), "batch_size"),
        ((torch.zeros(2, 3, dtype=torch.long), None, 0.0, 4), "floating-point"),
    ],
)
def test_invalid_inputs(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        sampled_softmax_xe(*args, kernel="triton")
    with pytest.raises(ValueError, match="unknown kernel"):
        sampled_softmax_xe(torch.zeros(2, 3), None, 0.0, 4, kernel="cuda")


# ---------------------------------------------------------------------------------------- BPR-max
def _bpr_value_and_grad(impl: str, scores: torch.Tensor, bpreg: float, elu: float, upstream=1.0):
    s = scores.clone().requires_grad_()
    loss = sl.sampled_bprmax(s, bpreg, elu, BATCH_SIZE, kernel=impl)
    (grad,) = torch.autograd.grad(loss * upstream, s)
    return loss.detach(), grad


def _check_bpr(scores: torch.Tensor, bpreg: float, elu: float, upstream: float = 1.0):
    """Triton vs the fp32 reference, and both vs the reference run in float64.

    With ±30 scores the regulariser's r^2 terms (900) cancel against their weighted mean in the
    reference's autograd graph, which leaves it errors of ~1e-5 of the largest gradient; the
    kernel's closed-form gradient does not cancel that way. So the kernel must be near the fp32
    reference and at least as near the float64 truth as the fp32 reference is.
    """
    got = _bpr_value_and_grad("triton", scores, bpreg, elu, upstream)
    want = _bpr_value_and_grad("pytorch", scores, bpreg, elu, upstream)
    exact = _bpr_value_and_grad("pytorch", scores.double(), bpreg, elu, upstream)
    (loss_t, grad_t), (loss_p, grad_p), (_, grad_x) = got, want, exact
    assert torch.isfinite(grad_t).all()
    torch.testing.assert_close(loss_t, loss_p, rtol=1e-5, atol=1e-6)
    scale = float(grad_x.abs().max()) or 1.0
    torch.testing.assert_close(grad_t, grad_p, rtol=1e-5, atol=1e-4 * scale)
    err_t = float((grad_t.double() - grad_x).abs().max())
    err_p = float((grad_p.double() - grad_x).abs().max())
    assert err_t <= 2 * err_p + 1e-6 * scale, (err_t, err_p, scale)
    return got, want


def _bpr_shapes():
    for n_rows, n_cols in _shapes():
        if n_cols >= 2:  # BPR-max needs a negative per row
            yield n_rows, n_cols


# sigmoid(r_ii - r_ij) of a far-ranked target overflows exp() inside numpy's interpreter ops:
# correct (it rounds to 0 as on the GPU), only noisy.
@triton_usable
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(("bpreg", "elu"), [(0.0, 0.0), (1.0, 0.5), (0.3, 0.0)])
@pytest.mark.parametrize("kind", ["random", "pm_30"])
@pytest.mark.parametrize("shape", list(_bpr_shapes()), ids=lambda s: f"{s[0]}x{s[1]}")
def test_bprmax_triton_matches_reference(shape, kind, bpreg, elu) -> None:
    n_rows, n_cols = shape
    scores = _scores(n_rows, n_cols, kind, seed=n_rows * 100 + n_cols + 1)
    got, _ = _check_bpr(scores, bpreg, elu)
    assert got[0].dtype == torch.float32 and got[0].shape == ()


@triton_usable
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_bprmax_far_ranked_target_and_scores_near_zero() -> None:
    # Row 0's target sits 60 below all negatives (P ~ 1e-26 < 1e-24: the eps damps it); row 1 holds
    # scores of order 1e-4 on both sides of ELU's switch at 0.
    scores = torch.full((3, 7), 30.0)
    scores[0, 0] = -30.0
    scores[1] = torch.linspace(-3e-4, 3e-4, 7)
    for bpreg, elu in [(0.0, 0.0), (1.0, 0.5), (0.0, 1.0)]:
        got, want = _check_bpr(scores, bpreg, elu, upstream=-1.7)
        # row 1 alone, so that row 0's large gradients do not set the tolerance for it
        torch.testing.assert_close(got[1][1], want[1][1], rtol=1e-5, atol=1e-9)


@triton_usable
def test_bprmax_equals_loss_module_and_strided_scores() -> None:
    from recforge.losses.sampled import BPRMax

    base = _scores(10, 4, "random", seed=4)
    s_ref = base.clone().T.requires_grad_()
    ref = BPRMax(0.7, 0.5)(s_ref, BATCH_SIZE)
    (g_ref,) = torch.autograd.grad(ref, s_ref)
    s = base.clone().T.requires_grad_()
    assert not s.is_contiguous()
    loss = sl.sampled_bprmax(s, 0.7, 0.5, BATCH_SIZE, kernel="triton")
    (grad,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, g_ref, rtol=1e-5, atol=1e-7)
    loss_p, grad_p = _bpr_value_and_grad("pytorch", base.T, 0.7, 0.5)
    assert torch.equal(loss_p, ref.detach()) and torch.equal(grad_p, g_ref)


def test_bprmax_unavailable_triton_warns_once_and_falls_back(monkeypatch) -> None:
    monkeypatch.setattr(sl.TRITON, "available", lambda: False)
    monkeypatch.setattr(sl.TRITON, "warned", False)
    calls: list[int] = []
    real = sl._SampledBPRMax.apply
    monkeypatch.setattr(sl._SampledBPRMax, "apply", lambda *a: calls.append(1) or real(*a))
    scores = _scores(3, 8, "random", seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _bpr_value_and_grad("triton", scores, 1.0, 0.5)
        _bpr_value_and_grad("triton", scores, 1.0, 0.5)
    fallback = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallback) == 1 and "sampled_bprmax(kernel='triton')" in str(fallback[0].message)
    assert calls == []
    want = _bpr_value_and_grad("pytorch", scores, 1.0, 0.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bprmax_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="C >= 2"):
        sl.sampled_bprmax(torch.zeros(1, 1), 1.0, 0.5, 4, kernel="triton")
    with pytest.raises(ValueError, match="C >= B'"):
        sl.sampled_bprmax(torch.zeros(3, 2), 1.0, 0.5, 4, kernel="triton")
    with pytest.raises(ValueError, match="elu_param"):
        sl.sampled_bprmax(torch.zeros(2, 3), 1.0, -0.5, 4, kernel="triton")
    with pytest.raises(ValueError, match="unknown kernel"):
        sl.sampled_bprmax(torch.zeros(2, 3), 1.0, 0.5, 4, kernel="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["xe", "bprmax"])
def test_config_switch_trains_through_the_fused_kernel(loss, make_cfg, monkeypatch):
    """loss.kernel=triton: training steps go through the fused op (interpreter on CPU)."""
    import recforge.kernels.sampled_loss as ops
    from recforge.pipeline import train

    fn = ops._SampledSoftmaxXE if loss == "xe" else ops._SampledBPRMax
    calls = []
    original = fn.apply
    monkeypatch.setattr(fn, "apply", lambda *a: calls.append(1) or original(*a))
    cfg = make_cfg(f"loss={loss}", "loss.kernel=triton", "task.n_sample=8", "trainer.fast_dev_run=2",
                   "data.batch_size=4", "data.steps_per_batch=1")
    metrics = train(cfg)
    assert len(calls) == 2
    assert metrics["test/recall@20"] >= 0

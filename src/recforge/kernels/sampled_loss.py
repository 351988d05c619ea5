"""Fused sampled softmax cross-entropy (GRU4Rec's training loss, spec §1.4).

``scores [B', C]`` hold row i's target in column i. The loss is the logq-corrected, max-subtracted
softmax cross-entropy of the diagonal, ``sum_i -log(p_ii + 1e-24) / batch_size``, i.e. exactly
:class:`recforge.losses.sampled.CrossEntropy`, which calls it. ``kernel="pytorch"`` is the
written-out reference below; ``kernel="triton"`` runs the row-wise kernels of
:mod:`recforge.kernels.sampled_loss_triton` behind a ``torch.autograd.Function``, so neither the
corrected score matrix nor the softmax is kept for backward: only two float32 numbers per row.

:func:`sampled_bprmax` does the same for BPR-max (:class:`recforge.losses.sampled.BPRMax`), keeping
five float32 statistics per row for its one-pass backward.

The Triton module is imported lazily so this module needs only torch; when Triton cannot run (no
Triton, CPU tensors without ``TRITON_INTERPRET=1``, float64 scores) the call falls back to the
reference with one warning per process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch.nn import functional as F

from recforge.kernels.twin import KernelImpl, TritonTwin

__all__ = [
    "bprmax_value_and_grad",
    "check_column_counts",
    "negatives_softmax",
    "sampled_bprmax",
    "sampled_bprmax_fused",
    "sampled_bprmax_reference",
    "sampled_softmax_xe",
    "sampled_softmax_xe_reference",
    "softmax_xe_value_and_grad",
]

TRITON = TritonTwin("recforge.kernels.sampled_loss_triton")


def _validate_scores(scores: Tensor, batch_size: int) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-D [B', C], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating-point tensor, got dtype {scores.dtype}")
    n_rows, n_cols = scores.shape
    if n_cols < n_rows:
        # column i is row i's target, so every row needs its own column
        raise ValueError(f"scores [B', C] needs C >= B', got shape {tuple(scores.shape)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def check_column_counts(scores: Tensor, counts: Tensor | None) -> None:
    """Refuse column counts that are not one per column of ``scores``, in its dtype."""
    if counts is None:
        return
    if counts.shape != (scores.shape[1],):
        raise ValueError(f"counts must be [C] = [{scores.shape[1]}] (one per column), got shape {tuple(counts.shape)}")
    if counts.dtype != scores.dtype:
        raise ValueError(f"counts must have the scores' dtype {scores.dtype}, got {counts.dtype}")


def _validate(scores: Tensor, log_q: Tensor | None, logq: float, batch_size: int) -> None:
    _validate_scores(scores, batch_size)
    n_cols = scores.shape[1]
    if logq < 0.0:
        raise ValueError(f"logq must be >= 0, got {logq}")
    if logq > 0.0:
        if log_q is None:
            raise ValueError("loss.logq > 0 needs the columns' log sampling weights")
        if log_q.dim() != 1 or log_q.shape[0] != n_cols:
            raise ValueError(
                f"log_q must be 1-D [C] with C={n_cols}, got shape {tuple(log_q.shape)}"
            )
        if log_q.device != scores.device:
            raise ValueError(f"log_q is on {log_q.device}, scores on {scores.device}")


def negatives_softmax(r: Tensor) -> Tensor:
    """Row-wise softmax over each row's negatives (its target column gets weight 0).

    Mask, subtract the row max over the masked matrix (the zeroed diagonal takes part, as in the
    reference), exponentiate and mask again. Not detached: BPR-max and TOP1-max train through it.
    """
    n_rows = r.shape[0]
    off_diag = torch.ones_like(r)
    off_diag[:, :n_rows].fill_diagonal_(0.0)
    masked = r * off_diag
    e = torch.exp(masked - masked.max(dim=1, keepdim=True).values) * off_diag
    return e / e.sum(dim=1, keepdim=True)


def sampled_softmax_xe_reference(
    scores: Tensor, log_q: Tensor | None, logq: float, batch_size: int
) -> Tensor:
    """The PyTorch reference, written out (not torch.softmax) to round like GRU4Rec's code."""
    if logq > 0.0:
        scores = scores - logq * log_q.unsqueeze(0)
    e = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
    probs = e / e.sum(dim=1, keepdim=True)
    return -torch.log(torch.diagonal(probs) + 1e-24).sum() / batch_size


class _SampledSoftmaxXE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, log_q: Tensor | None, logq: float, batch_size: int) -> Tensor:
        module = TRITON.module()
        loss, row_max, row_sum = module.softmax_xe_forward(scores, log_q, logq)
        ctx.save_for_backward(scores, log_q, row_max, row_sum)
        ctx.logq = logq
        ctx.batch_size = batch_size
        # Rows are summed by torch, not atomically in the kernel: deterministic.
        return (loss.sum() / batch_size).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        scores, log_q, row_max, row_sum = ctx.saved_tensors
        grad_scores = grad_log_q = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            scale = grad_out.detach().to(torch.float32) / ctx.batch_size
            grad_scores = TRITON.module().softmax_xe_backward(
                scores, log_q, ctx.logq, row_max, row_sum, scale
            )
            if ctx.needs_input_grad[1]:
                # x_ij = s_ij - logq * log_q_j, so log_q's gradient is -logq times column sums.
                grad_log_q = (-ctx.logq * grad_scores.sum(dim=0)).to(log_q.dtype)
            if not ctx.needs_input_grad[0]:
                grad_scores = None
        return grad_scores, grad_log_q, None, None


def sampled_softmax_xe(
    scores: Tensor,
    log_q: Tensor | None,
    logq: float,
    batch_size: int,
    kernel: KernelImpl = "pytorch",
) -> Tensor:
    """Sampled softmax cross-entropy of the diagonal targets, differentiable w.r.t. ``scores``.

    Args:
        scores: ``[B', C]`` float scores, ``C >= B'``; column i is row i's target.
        log_q: ``[C]`` log sampling weights of the columns, or ``None``; read only when
            ``logq > 0`` (as in :class:`~recforge.losses.sampled.CrossEntropy`).
        logq: strength of the correction ``x_ij = scores_ij - logq * log_q_j``.
        batch_size: the *configured* batch size the row sum is divided by.
        kernel: ``"pytorch"`` or ``"triton"``. ``"triton"`` runs the fused kernels on CUDA
            tensors, or on CPU tensors under ``TRITON_INTERPRET=1``, computing in float32 for
            fp32/bf16/fp16 scores; otherwise it falls back to ``"pytorch"`` with one warning per
            process.

    Returns:
        The scalar loss ``sum_i -log(softmax(x)_ii + 1e-24) / batch_size`` in ``scores.dtype``.
    """
    logq = float(logq)
    _validate(scores, log_q, logq, batch_size)
    return TRITON.dispatch(
        "sampled_softmax_xe", kernel, (scores,),
        triton=lambda _module: _SampledSoftmaxXE.apply(
            scores, log_q if logq > 0.0 else None, logq, batch_size
        ),
        reference=lambda: sampled_softmax_xe_reference(scores, log_q, logq, batch_size),
    )


# ---------------------------------------------------------------------------------------- BPR-max
def sampled_bprmax_reference(
    scores: Tensor, bpreg: float, elu_param: float, batch_size: int
) -> Tensor:
    """The PyTorch reference: -log Σ_j s_ij σ(r_ii - r_ij) + bpreg Σ_j s_ij r_ij², r = ELU(scores).

    Written in GRU4Rec's own order of float operations (r² first, then times s), so that given the
    same weights and negatives a run retraces the official code bit for bit.
    """
    r = F.elu(scores, alpha=elu_param) if elu_param > 0 else scores
    s = negatives_softmax(r)
    target = torch.diagonal(r).unsqueeze(1)
    pairwise = (torch.sigmoid(target - r) * s).sum(dim=1)
    loss = -torch.log(pairwise + 1e-24) + bpreg * (r.pow(2) * s).sum(dim=1)
    return loss.sum() / batch_size


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_j a_ij b_ij`` as ``[B', 1]``, without the ``[B', C]`` product."""
    return torch.linalg.vecdot(a, b).unsqueeze(1)


def _bprmax_value_and_grad(
    scores: Tensor, bpreg: float, elu_param: float, batch_size: int, with_grad: bool = True,
    counts: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """BPR-max's loss (rows summed, over ``batch_size``) and, if ``with_grad``, its gradient
    w.r.t. ``scores`` ``[B', C]``, in few passes over the matrix. ``counts [C]``: column j stands
    for ``counts[j]`` identical columns (see :func:`bprmax_value_and_grad`).

    With ``s`` the negatives' softmax, ``σ_k = σ(r_ii − r_ik)``, ``P = Σ s σ`` and
    ``reg = Σ s r²`` per row, the row loss is ``−log(P + ε) + bpreg·reg`` and

        dL/dr_k = s_k (1 − σ_k² / (P + ε) + bpreg (r_k² + 2 r_k − reg))      (a negative k)
        dL/dr_i = −(P − Σ s σ²) / (P + ε)                                   (the target)

    (``σ_k − P − σ_k(1 − σ_k)`` folded into ``σ_k² − P``, and ``Σ s σ(1 − σ)`` into ``P − Σ s σ²``),
    then times ELU' where ``elu_param > 0``. The Triton kernels' derivation is the same before
    the folding (``sampled_loss_triton``). Values equal the reference's up to float round-off;
    this is the fast step's loss, not the bit-exact one.
    """
    r = F.elu(scores, alpha=elu_param) if elu_param > 0 else scores.clone()
    diagonal = r.diagonal()  # row i's target, a view into r
    target = diagonal.clone()
    diagonal.zero_()  # the target takes part in the row max as 0, as in the reference
    e = torch.sub(r, r.amax(dim=1, keepdim=True)).exp_()
    e.diagonal().zero_()
    if counts is not None:
        # every sum below is over the negatives' softmax weights: a column counted c times
        # weighs c times, and its gradient (a multiple of its weight) is the sum over its copies
        e.mul_(counts)
    diagonal.copy_(target)
    inv_z = e.sum(dim=1, keepdim=True).reciprocal_()
    sig = torch.sub(target.unsqueeze(1), r).sigmoid_()
    pairwise = _row_dot(e, sig).mul_(inv_z)
    r_sq = r * r
    reg = _row_dot(e, r_sq).mul_(inv_z)
    loss = (bpreg * reg - torch.log(pairwise + 1e-24)).sum() / batch_size
    if not with_grad:
        return loss, None
    neg_inv_p = (pairwise + 1e-24).reciprocal_().neg_()
    sig_sq = sig.mul_(sig)
    target_grad = (pairwise - _row_dot(e, sig_sq).mul_(inv_z)).mul_(neg_inv_p)
    grad = r_sq.add_(r, alpha=2.0).mul_(bpreg).add_(1.0 - bpreg * reg).addcmul_(sig_sq, neg_inv_p)
    grad.mul_(e).mul_(inv_z)
    grad.diagonal().copy_(target_grad.squeeze(1))
    grad.div_(batch_size)
    if elu_param > 0:
        grad = torch.ops.aten.elu_backward(grad, elu_param, 1, 1, False, scores)
    return loss, grad


class _FusedBPRMax(torch.autograd.Function):
    """BPR-max with its backward written out: forward computes the gradient with the value
    (:func:`_bprmax_value_and_grad`), backward scales it; autograd through the reference
    records some twenty ops on ``[B', C]`` and replays their backward."""

    @staticmethod
    def forward(ctx, scores: Tensor, bpreg: float, elu_param: float, batch_size: int) -> Tensor:
        loss, grad = _bprmax_value_and_grad(scores, bpreg, elu_param, batch_size,
                                            with_grad=ctx.needs_input_grad[0])
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_out), None, None, None


def bprmax_value_and_grad(
    scores: Tensor, bpreg: float, elu_param: float, batch_size: int, counts: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`sampled_bprmax_fused`'s value and its gradient w.r.t. ``scores``, both computed now
    (no graph): for a caller that writes out its own backward (the fused GRU4Rec step).

    ``counts [C]`` (the scores' dtype), if given: column j stands for ``counts[j]`` identical
    columns (a negative drawn that many times; the targets' columns count 1). The value is the
    loss over the columns repeated so, and a column's gradient is the sum over its copies."""
    _validate_scores(scores, batch_size)
    check_column_counts(scores, counts)
    return _bprmax_value_and_grad(scores, float(bpreg), float(elu_param), batch_size, counts=counts)


def softmax_xe_value_and_grad(scores: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    """Softmax cross-entropy, row i's target in column i, summed over rows / ``batch_size`` (the
    fast step's :meth:`recforge.losses.sampled.CrossEntropy.fast`), and its gradient w.r.t.
    ``scores``, ``(softmax - onehot) / batch_size``, both computed now (no graph)."""
    _validate_scores(scores, batch_size)
    log_p = torch.log_softmax(scores, dim=1)
    diagonal = log_p.diagonal()
    loss = -diagonal.sum() / batch_size
    grad = log_p.exp_()  # log_p is not read again: the softmax takes its place
    grad.diagonal().sub_(1.0)
    return loss, grad.div_(batch_size)


def sampled_bprmax_fused(scores: Tensor, bpreg: float, elu_param: float, batch_size: int) -> Tensor:
    """:func:`sampled_bprmax` in PyTorch ops with a written-out backward (the fast GRU4Rec step's
    loss, ``task.fast_step``): same value and gradient as the reference up to float rounding."""
    _validate_scores(scores, batch_size)
    return _FusedBPRMax.apply(scores, float(bpreg), float(elu_param), batch_size)


class _SampledBPRMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, bpreg: float, elu_param: float, batch_size: int) -> Tensor:
        loss, stats = TRITON.module().bprmax_forward(scores, bpreg, elu_param)
        ctx.save_for_backward(scores, stats)
        ctx.bpreg, ctx.elu_param, ctx.batch_size = bpreg, elu_param, batch_size
        return (loss.sum() / batch_size).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        scores, stats = ctx.saved_tensors
        scale = grad_out.detach().to(torch.float32) / ctx.batch_size
        grad = TRITON.module().bprmax_backward(scores, ctx.bpreg, ctx.elu_param, stats, scale)
        return grad, None, None, None


def sampled_bprmax(
    scores: Tensor,
    bpreg: float,
    elu_param: float,
    batch_size: int,
    kernel: KernelImpl = "pytorch",
) -> Tensor:
    """BPR-max over the sampled columns, differentiable w.r.t. ``scores`` (spec §1.4).

    Args:
        scores: ``[B', C]`` float scores, ``C >= B'``; column i is row i's target. Rows need at
            least one negative (``C >= 2``), as for :class:`~recforge.losses.sampled.BPRMax`.
        bpreg: weight of the score regulariser ``sum_j s_ij r_ij^2``.
        elu_param: ELU alpha applied to the scores first; ``0`` keeps them linear.
        batch_size: the *configured* batch size the row sum is divided by.
        kernel: ``"pytorch"`` or ``"triton"``, with the same fallback as :func:`sampled_softmax_xe`.

    Returns:
        The scalar loss ``sum_i [-log(sum_j s_ij sigmoid(r_ii - r_ij) + 1e-24)
        + bpreg sum_j s_ij r_ij^2] / batch_size`` in ``scores.dtype``; the softmax weights
        ``s_ij`` over the negatives are not detached.
    """
    bpreg, elu_param = float(bpreg), float(elu_param)
    _validate_scores(scores, batch_size)
    if elu_param < 0.0:
        raise ValueError(f"elu_param must be >= 0, got {elu_param}")
    if scores.shape[1] < 2:
        # no negatives: the softmax over them is 0/0 (NaN in the reference too)
        raise ValueError(f"BPR-max needs C >= 2 columns, got shape {tuple(scores.shape)}")
    return TRITON.dispatch(
        "sampled_bprmax", kernel, (scores,),
        triton=lambda _module: _SampledBPRMax.apply(scores, bpreg, elu_param, batch_size),
        reference=lambda: sampled_bprmax_reference(scores, bpreg, elu_param, batch_size),
    )

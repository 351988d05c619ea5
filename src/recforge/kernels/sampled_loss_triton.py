"""Triton twins of :func:`recforge.kernels.sampled_loss.sampled_softmax_xe` and ``sampled_bprmax``.

One program per score row, looping over the columns in ``BLOCK_C`` tiles. The forward pass takes
the row max (pass 1) and the sum of shifted exponentials (pass 2) and writes the row's loss plus
both statistics; the backward pass re-reads the row once more and writes its gradient, so no
``[B', C]`` probability matrix is ever stored between the passes. Two plain passes rather than an
online rescaled sum: the sum is then formed exactly as the reference forms it (exp(x - max)), so
values agree to round-off even where exponentials approach underflow. BPR-max follows the same
plan with more per-row statistics (see its section below).

This module imports triton at import time; :mod:`recforge.kernels.sampled_loss` imports it lazily
and falls back to the PyTorch path when that fails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.kernels._interpret import interpreted

__all__ = [
    "INTERPRETED",
    "KERNEL_DTYPES",
    "bprmax_backward",
    "bprmax_forward",
    "softmax_xe_backward",
    "softmax_xe_forward",
]

#: Score dtypes the kernels read natively (all arithmetic is float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Added to the target's probability before the log, as in the reference (spec §1.4).
EPS = 1e-24


@triton.jit
def _corrected(s_ptr, lq_ptr, row_off, cols, col_mask, stride_c, LOGQ, HAS_LOGQ: tl.constexpr):
    # Shared by the tile loops and the diagonal load: the target's score must be rounded exactly
    # like its column in the tiles, or p_ii would not be the value the sum was built from.
    x = tl.load(s_ptr + row_off + cols.to(tl.int64) * stride_c, mask=col_mask, other=float("-inf"))
    x = x.to(tl.float32)
    if HAS_LOGQ:
        lq = tl.load(lq_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = x - LOGQ * lq
    return x


@triton.jit
def _xe_forward_kernel(
    s_ptr,
    lq_ptr,
    loss_ptr,
    max_ptr,
    sum_ptr,
    C,
    stride_r,
    stride_c,
    LOGQ,
    HAS_LOGQ: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    row_off = row.to(tl.int64) * stride_r
    offs = tl.arange(0, BLOCK_C)

    # Per-lane partials, reduced once after the loop: one cross-lane reduction per pass.
    run_max = tl.full((BLOCK_C,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        x = _corrected(s_ptr, lq_ptr, row_off, cols, cols < C, stride_c, LOGQ, HAS_LOGQ)
        run_max = tl.maximum(run_max, x)
    row_max = tl.max(run_max, axis=0)

    run_sum = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        col_mask = cols < C
        x = _corrected(s_ptr, lq_ptr, row_off, cols, col_mask, stride_c, LOGQ, HAS_LOGQ)
        run_sum += tl.where(col_mask, tl.exp(x - row_max), 0.0)
    row_sum = tl.sum(run_sum, axis=0)

    # The target column of row i is column i: a one-lane tile keeps the same load/correct path.
    diag = row + tl.arange(0, 1)
    x_ii = tl.sum(_corrected(s_ptr, lq_ptr, row_off, diag, diag < C, stride_c, LOGQ, HAS_LOGQ), 0)
    p_ii = tl.exp(x_ii - row_max) / row_sum
    tl.store(loss_ptr + row, -tl.log(p_ii + 1e-24))
    tl.store(max_ptr + row, row_max)
    tl.store(sum_ptr + row, row_sum)


@triton.jit
def _xe_backward_kernel(
    s_ptr,
    lq_ptr,
    max_ptr,
    sum_ptr,
    scale_ptr,
    g_ptr,
    C,
    stride_r,
    stride_c,
    stride_gr,
    LOGQ,
    HAS_LOGQ: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    row_off = row.to(tl.int64) * stride_r
    g_off = row.to(tl.int64) * stride_gr
    offs = tl.arange(0, BLOCK_C)
    row_max = tl.load(max_ptr + row)
    row_sum = tl.load(sum_ptr + row)
    # scale = upstream gradient / batch_size, read from memory so backward needs no host sync.
    scale = tl.load(scale_ptr)

    diag = row + tl.arange(0, 1)
    x_ii = tl.sum(_corrected(s_ptr, lq_ptr, row_off, diag, diag < C, stride_c, LOGQ, HAS_LOGQ), 0)
    p_ii = tl.exp(x_ii - row_max) / row_sum
    # d/dx_ij of -log(p_ii + eps) = (p_ij - [i == j]) * p_ii / (p_ii + eps): the eps damps the
    # gradient of a target whose probability has (nearly) underflowed, exactly as in the reference.
    coef = scale * (p_ii / (p_ii + 1e-24))

    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        col_mask = cols < C
        x = _corrected(s_ptr, lq_ptr, row_off, cols, col_mask, stride_c, LOGQ, HAS_LOGQ)
        p = tl.exp(x - row_max) / row_sum
        grad = (p - tl.where(cols == row, 1.0, 0.0)) * coef
        tl.store(g_ptr + g_off + cols, grad.to(g_ptr.dtype.element_ty), mask=col_mask)


INTERPRETED = interpreted(_xe_forward_kernel)


def _block_c(scores: Tensor, block_c: int | None) -> int:
    """Columns per tile: ``block_c`` if given, else the default for where ``scores`` lives."""
    if block_c:
        return block_c
    # The interpreter pays per op, not per element, but small tiles there exercise the column loop
    # and the ragged last tile in tests. On the GPU one tile of up to 2048 fp32 per row keeps the
    # typical C (batch + a few thousand samples) to one or two iterations per pass.
    if scores.device.type != "cuda" or INTERPRETED:
        return 16
    return min(2048, max(16, triton.next_power_of_2(scores.shape[1])))


def _backward_buffers(scores: Tensor, scale: Tensor, block_c: int | None):
    """What both backward launches start from: the gradient buffer, the tile width and ``scale``
    as a 1-element float32 tensor on the scores' device."""
    grad = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
    scale = scale.to(device=scores.device, dtype=torch.float32).reshape(1).contiguous()
    return grad, _block_c(scores, block_c), scale


def softmax_xe_forward(
    scores: Tensor, log_q: Tensor | None, logq: float, block_c: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row losses ``-log(p_ii + 1e-24)`` and the row statistics backward needs.

    Inputs are validated by the caller. Returns ``(loss [B'], row_max [B'], row_sum [B'])``, all
    float32, where ``p_ij = exp(x_ij - row_max) / row_sum`` and ``x`` is the logq-corrected row.
    """
    n_rows, n_cols = scores.shape
    device = scores.device
    block = _block_c(scores, block_c)
    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    row_max = torch.empty_like(loss)
    row_sum = torch.empty_like(loss)
    if n_rows == 0:
        return loss, row_max, row_sum
    has_logq = log_q is not None
    # without a correction any pointer will do: HAS_LOGQ=False never reads it
    lq = log_q.contiguous() if has_logq else scores
    _xe_forward_kernel[(n_rows,)](
        scores, lq, loss, row_max, row_sum,
        n_cols, scores.stride(0), scores.stride(1), float(logq),
        HAS_LOGQ=has_logq, BLOCK_C=block,
    )  # fmt: skip
    return loss, row_max, row_sum


def softmax_xe_backward(
    scores: Tensor,
    log_q: Tensor | None,
    logq: float,
    row_max: Tensor,
    row_sum: Tensor,
    scale: Tensor,
    block_c: int | None = None,
) -> Tensor:
    """``dL/dscores`` for ``L = sum_i -log(p_ii + 1e-24) * scale`` (``scale``: 1-element tensor)."""
    n_rows, n_cols = scores.shape
    grad, block, scale = _backward_buffers(scores, scale, block_c)
    if n_rows == 0:
        return grad
    has_logq = log_q is not None
    lq = log_q.contiguous() if has_logq else scores
    _xe_backward_kernel[(n_rows,)](
        scores, lq, row_max, row_sum, scale, grad,
        n_cols, scores.stride(0), scores.stride(1), grad.stride(0), float(logq),
        HAS_LOGQ=has_logq, BLOCK_C=block,
    )  # fmt: skip
    return grad


# ---------------------------------------------------------------------------------------- BPR-max
# loss_i = -log(P_i + 1e-24) + bpreg * Reg_i with P_i = sum_j s_ij sigmoid(r_ii - r_ij) and
# Reg_i = sum_j s_ij r_ij^2, s_i. a softmax over row i's negatives (j != i), r = ELU(scores) or the
# scores themselves. The forward pass saves per row: the masked max m, the exponential sum Z, P,
# Reg and D = sum_j s_ij sig_ij (1 - sig_ij) (the target's own gradient), so backward is one pass.
N_BPR_STATS = 5


@triton.jit
def _activated(s_ptr, row_off, cols, col_mask, stride_c, ELU, HAS_ELU: tl.constexpr):
    x = tl.load(s_ptr + row_off + cols.to(tl.int64) * stride_c, mask=col_mask, other=0.0)
    x = x.to(tl.float32)
    r = x
    if HAS_ELU:
        # exp(x) - 1 instead of expm1 (not in tl's core ops): its error is ~1 ulp of 1 absolute,
        # which only ever enters through r differences, sigmoids and r^2 of the same magnitude.
        r = tl.where(x > 0.0, x, ELU * (tl.exp(tl.minimum(x, 0.0)) - 1.0))
    return x, r


@triton.jit
def _bprmax_forward_kernel(
    s_ptr,
    loss_ptr,
    stats_ptr,
    B,
    C,
    stride_r,
    stride_c,
    BPREG,
    ELU,
    HAS_ELU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    row_off = row.to(tl.int64) * stride_r
    offs = tl.arange(0, BLOCK_C)
    diag = row + tl.arange(0, 1)
    # its own name for the unused raw score: compiled Triton would treat a shared `_` as carried
    # through the loops below, where its shape changes ([1] here, [BLOCK_C] there)
    _x_diag, r_diag = _activated(s_ptr, row_off, diag, diag < C, stride_c, ELU, HAS_ELU)
    target = tl.sum(r_diag, 0)

    # The reference masks the target to 0 (not -inf) before the max, so a 0 takes part in it;
    # any upper bound is stable, and matching it keeps the rounding of exp(a - m) identical.
    run_max = tl.full((BLOCK_C,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        col_mask = cols < C
        _, r = _activated(s_ptr, row_off, cols, col_mask, stride_c, ELU, HAS_ELU)
        a = tl.where(cols == row, 0.0, r)
        run_max = tl.maximum(run_max, tl.where(col_mask, a, float("-inf")))
    row_max = tl.max(run_max, axis=0)

    z = tl.zeros((BLOCK_C,), dtype=tl.float32)
    pair = tl.zeros((BLOCK_C,), dtype=tl.float32)
    reg = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dsig = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        col_mask = cols < C
        _, r = _activated(s_ptr, row_off, cols, col_mask, stride_c, ELU, HAS_ELU)
        negative = col_mask & (cols != row)
        e = tl.where(negative, tl.exp(r - row_max), 0.0)
        sig = tl.sigmoid(target - r)
        z += e
        pair += e * sig
        reg += e * (r * r)
        dsig += e * (sig * (1.0 - sig))
    z_sum = tl.sum(z, axis=0)
    p = tl.sum(pair, axis=0) / z_sum
    reg_i = tl.sum(reg, axis=0) / z_sum
    d = tl.sum(dsig, axis=0) / z_sum
    tl.store(loss_ptr + row, -tl.log(p + 1e-24) + BPREG * reg_i)
    tl.store(stats_ptr + row, row_max)
    tl.store(stats_ptr + B + row, z_sum)
    tl.store(stats_ptr + 2 * B + row, p)
    tl.store(stats_ptr + 3 * B + row, reg_i)
    tl.store(stats_ptr + 4 * B + row, d)


@triton.jit
def _bprmax_backward_kernel(
    s_ptr,
    stats_ptr,
    scale_ptr,
    g_ptr,
    B,
    C,
    stride_r,
    stride_c,
    stride_gr,
    BPREG,
    ELU,
    HAS_ELU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    row_off = row.to(tl.int64) * stride_r
    g_off = row.to(tl.int64) * stride_gr
    offs = tl.arange(0, BLOCK_C)
    row_max = tl.load(stats_ptr + row)
    z_sum = tl.load(stats_ptr + B + row)
    p = tl.load(stats_ptr + 2 * B + row)
    reg_i = tl.load(stats_ptr + 3 * B + row)
    d = tl.load(stats_ptr + 4 * B + row)
    scale = tl.load(scale_ptr)
    inv_p = 1.0 / (p + 1e-24)
    diag = row + tl.arange(0, 1)
    _x_diag, r_diag = _activated(s_ptr, row_off, diag, diag < C, stride_c, ELU, HAS_ELU)
    target = tl.sum(r_diag, 0)

    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        col_mask = cols < C
        x, r = _activated(s_ptr, row_off, cols, col_mask, stride_c, ELU, HAS_ELU)
        is_target = cols == row
        s = tl.where(is_target, 0.0, tl.exp(r - row_max)) / z_sum
        sig = tl.sigmoid(target - r)
        # Negative k: the softmax weight moves with r_k (ds_j/dr_k = s_j (δ_jk - s_k)) and so does
        # its own sigmoid; the target only enters through the sigmoids: -D / (P + eps).
        d_pair = s * (sig - p - sig * (1.0 - sig))
        d_reg = s * (r * r - reg_i + 2.0 * r)
        dr = tl.where(is_target, -d * inv_p, -d_pair * inv_p + BPREG * d_reg)
        if HAS_ELU:
            dr = dr * tl.where(x > 0.0, 1.0, ELU * tl.exp(x))
        tl.store(g_ptr + g_off + cols, (dr * scale).to(g_ptr.dtype.element_ty), mask=col_mask)


def bprmax_forward(
    scores: Tensor, bpreg: float, elu_param: float, block_c: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per-row BPR-max losses ``[B']`` and the ``[5, B']`` float32 statistics backward needs."""
    n_rows, n_cols = scores.shape
    device = scores.device
    block = _block_c(scores, block_c)
    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    stats = torch.empty((N_BPR_STATS, n_rows), dtype=torch.float32, device=device)
    if n_rows == 0:
        return loss, stats
    _bprmax_forward_kernel[(n_rows,)](
        scores, loss, stats,
        n_rows, n_cols, scores.stride(0), scores.stride(1), float(bpreg), float(elu_param),
        HAS_ELU=elu_param > 0, BLOCK_C=block,
    )  # fmt: skip
    return loss, stats


def bprmax_backward(
    scores: Tensor,
    bpreg: float,
    elu_param: float,
    stats: Tensor,
    scale: Tensor,
    block_c: int | None = None,
) -> Tensor:
    """``dL/dscores`` for the BPR-max row losses times ``scale`` (a 1-element tensor)."""
    n_rows, n_cols = scores.shape
    grad, block, scale = _backward_buffers(scores, scale, block_c)
    if n_rows == 0:
        return grad
    _bprmax_backward_kernel[(n_rows,)](
        scores, stats, scale, grad,
        n_rows, n_cols, scores.stride(0), scores.stride(1), grad.stride(0),
        float(bpreg), float(elu_param),
        HAS_ELU=elu_param > 0, BLOCK_C=block,
    )  # fmt: skip
    return grad

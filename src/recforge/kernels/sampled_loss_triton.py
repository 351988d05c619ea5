"""Triton twin of :func:`recforge.kernels.sampled_loss.sampled_softmax_xe`.

One program per score row, looping over the columns in ``BLOCK_C`` tiles. The forward pass takes
the row max (pass 1) and the sum of shifted exponentials (pass 2) and writes the row's loss plus
both statistics; the backward pass re-reads the row once more and writes its gradient, so no
``[B', C]`` probability matrix is ever stored between the passes. Two plain passes rather than an
online rescaled sum: the sum is then formed exactly as the reference forms it (exp(x - max)), so
values agree to round-off even where exponentials approach underflow.

This module imports triton at import time; :mod:`recforge.kernels.sampled_loss` imports it lazily
and falls back to the PyTorch path when that fails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["KERNEL_DTYPES", "interpreted", "softmax_xe_forward", "softmax_xe_backward"]

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


def interpreted() -> bool:
    """Whether the kernels were defined under ``TRITON_INTERPRET=1`` (so CPU tensors work)."""
    return not isinstance(_xe_forward_kernel, triton.runtime.JITFunction)


def _block_c(n_cols: int, on_gpu: bool) -> int:
    # The interpreter pays per op, not per element, but small tiles there exercise the column loop
    # and the ragged last tile in tests. On the GPU one tile of up to 2048 fp32 per row keeps the
    # typical C (batch + a few thousand samples) to one or two iterations per pass.
    if not on_gpu:
        return 16
    return min(2048, max(16, triton.next_power_of_2(n_cols)))


def softmax_xe_forward(
    scores: Tensor, log_q: Tensor | None, logq: float, block_c: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row losses ``-log(p_ii + 1e-24)`` and the row statistics backward needs.

    Inputs are validated by the caller. Returns ``(loss [B'], row_max [B'], row_sum [B'])``, all
    float32, where ``p_ij = exp(x_ij - row_max) / row_sum`` and ``x`` is the logq-corrected row.
    """
    n_rows, n_cols = scores.shape
    device = scores.device
    on_gpu = device.type == "cuda" and not interpreted()
    block = block_c or _block_c(n_cols, on_gpu)
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
    device = scores.device
    grad = torch.empty((n_rows, n_cols), dtype=scores.dtype, device=device)
    if n_rows == 0:
        return grad
    on_gpu = device.type == "cuda" and not interpreted()
    block = block_c or _block_c(n_cols, on_gpu)
    has_logq = log_q is not None
    lq = log_q.contiguous() if has_logq else scores
    scale = scale.to(device=device, dtype=torch.float32).reshape(1).contiguous()
    _xe_backward_kernel[(n_rows,)](
        scores, lq, row_max, row_sum, scale, grad,
        n_cols, scores.stride(0), scores.stride(1), grad.stride(0), float(logq),
        HAS_LOGQ=has_logq, BLOCK_C=block,
    )  # fmt: skip
    return grad

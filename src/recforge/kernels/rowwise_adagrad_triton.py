"""Triton twin of :func:`recforge.kernels.rowwise_adagrad.sparse_adagrad_momentum_reference_`.

The gradient's row indices are sorted (stably) on the host side of the launch; the kernel then
runs one program per sorted position. A program whose row differs from its predecessor's owns
that row: it sums the row's duplicate gradient rows in their original order, then reads the
accumulator, velocity and parameter row once, updates them, and writes them once. Programs on a
repeated row do nothing. There is no atomic anywhere, so the result is deterministic, and no
device-to-host synchronisation (the number of distinct rows is never needed on the host).

Every float operation is the reference's, in its order, with IEEE-rounded division and square
root and no fused multiply-add: up to the order in which duplicate rows are summed, the update
rounds exactly like the reference.

This module imports triton at import time; :mod:`recforge.kernels.rowwise_adagrad` imports it
lazily and falls back to the PyTorch path when that fails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.kernels._interpret import interpreted

__all__ = ["INTERPRETED", "KERNEL_DTYPES", "sparse_adagrad_momentum_triton_"]

#: Parameter, state and gradient dtypes the kernel takes (the optimizer state is float32).
KERNEL_DTYPES = (torch.float32,)


@triton.jit
def _sparse_adagrad_momentum_kernel(
    p_ptr,
    sum_ptr,
    vel_ptr,
    rows_ptr,
    order_ptr,
    values_ptr,
    n_values,
    D,
    NEG_INV_LR,
    MU,
    EPS,
    HAS_MOMENTUM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    previous = tl.load(rows_ptr + i - 1, mask=i > 0, other=-1)
    if row != previous:
        row_off = row.to(tl.int64) * D
        offs = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            col_mask = cols < D
            # The duplicates of this row sit at sorted positions i, i+1, ...; the stable sort
            # keeps their original order, so the sum is formed in gradient order.
            g = tl.zeros((BLOCK_D,), dtype=tl.float32)
            j = i
            current = row
            while current == row:
                src = tl.load(order_ptr + j).to(tl.int64)
                g += tl.load(values_ptr + src * D + cols, mask=col_mask, other=0.0)
                j += 1
                current = tl.load(rows_ptr + j, mask=j < n_values, other=-1)

            acc = tl.load(sum_ptr + row_off + cols, mask=col_mask, other=0.0) + g * g
            tl.store(sum_ptr + row_off + cols, acc, mask=col_mask)
            neg_scaled_denom = tl.sqrt_rn(acc + EPS) * NEG_INV_LR
            step = tl.div_rn(g, neg_scaled_denom)
            if HAS_MOMENTUM:
                v = tl.load(vel_ptr + row_off + cols, mask=col_mask, other=0.0) * MU + step
                tl.store(vel_ptr + row_off + cols, v, mask=col_mask)
                step = v
            theta = tl.load(p_ptr + row_off + cols, mask=col_mask, other=0.0) + step
            tl.store(p_ptr + row_off + cols, theta, mask=col_mask)


def _num_warps(block_d: int, on_gpu: bool) -> int:
    # one warp covers a 128-wide row in four-element vectors; wider rows get more warps
    return max(1, min(8, block_d // 128)) if on_gpu else 1


INTERPRETED = interpreted(_sparse_adagrad_momentum_kernel)


def sparse_adagrad_momentum_triton_(
    param: Tensor,
    grad_sum: Tensor,
    velocity: Tensor | None,
    rows: Tensor,
    values: Tensor,
    *,
    lr: float,
    momentum: float,
    eps: float,
    block_d: int | None = None,
) -> None:
    """Launch the kernel on validated, contiguous inputs (see ``sparse_adagrad_momentum_``).

    Args:
        param, grad_sum, velocity: ``[N, ...]`` float32, contiguous, updated in place
            (``velocity`` is None without momentum).
        rows: ``[nnz]`` the gradient's row indices, duplicates allowed, any order.
        values: ``[nnz, ...]`` the gradient rows.
        block_d: the row tile width (default: the row width rounded up to a power of two, at
            most 1024); tests set it smaller to exercise the loop over tiles.
    """
    n_values = rows.shape[0]
    if n_values == 0:
        return
    width = param[0].numel() if param.shape[0] else 1
    values = values.reshape(n_values, width).to(torch.float32).contiguous()
    sorted_rows, order = torch.sort(rows, stable=True)
    on_gpu = param.device.type == "cuda" and not INTERPRETED
    if block_d is None:
        block_d = min(1024, triton.next_power_of_2(width))
    _sparse_adagrad_momentum_kernel[(n_values,)](
        param, grad_sum, velocity if velocity is not None else param,
        sorted_rows, order, values,
        n_values, width, -1.0 / lr, momentum, eps,
        HAS_MOMENTUM=velocity is not None, BLOCK_D=block_d,
        num_warps=_num_warps(block_d, on_gpu), enable_fp_fusion=False,
    )  # fmt: skip

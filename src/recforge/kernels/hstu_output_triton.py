"""Triton twin of :func:`recforge.kernels.hstu_output.hstu_output_reference`.

Forward: one kernel takes ``BLOCK_M`` rows of ``attn`` and ``u`` per program (the whole row of E
columns in one tile), computes LayerNorm's mean and 1/std in float32, writes
``y = dropout(u ⊙ (attn − mean)·rstd)`` and the two row statistics; then
``out = addmm(bias, y, weight.T) + x`` in torch.

Why the GEMM is not in the kernel (upstream fuses it through its own Triton addmm): the kernel
needs the whole E-wide row in registers for the statistics, and a fused GEMM would add a
``[BLOCK_M, BLOCK_D]`` accumulator and a weight tile beside it, which either spills or shrinks the
row tile; cuBLAS picks its own tiling and TF32/tensor-core path for ``[T, E] × [E, D]``, where all
the FLOPs are. The cost of not fusing is one write and one read of ``y`` (``[T, E]``): with
D = E the forward moves six ``[T, E]``-sized arrays (attn, u, y twice, x, out) where a fully
fused one moves four.

Backward: ``dy = dout @ weight`` (torch), then one kernel per row block regenerates the dropout
mask from (seed, flat index), recomputes the normalised row from the saved mean/rstd and writes
``d_attn`` (LayerNorm backward), ``d_u`` and, when ``weight`` needs a gradient, ``y`` again for
``d_weight = doutᵀ @ y``; ``d_x = dout`` and ``d_bias = Σ_t dout`` are torch reductions.
``y`` is recomputed rather than saved: saving it would keep a ``[T, E]`` activation per layer
alive from forward to backward (the cost HSTU's design minimises), while recomputing it is a
few flops per element and one ``[T, E]`` write inside a kernel that reads ``attn`` and ``u``
anyway. No atomics anywhere:
every output element is written by exactly one program, and the two reductions over T are
torch's (deterministic) matmul and sum, so repeated runs are bitwise identical.

This module imports triton at import time; :mod:`recforge.kernels.hstu_output` imports it lazily
and falls back to the PyTorch path when that fails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.kernels._interpret import interpreted
from recforge.kernels.hstu_output import dropout_key, dropout_threshold

__all__ = ["INTERPRETED", "KERNEL_DTYPES", "MAX_E", "hstu_output_triton", "layout_reason"]

#: Dtypes the kernel takes (the layer trains in float32; statistics are float32 throughout).
KERNEL_DTYPES = (torch.float32,)

#: Widest E the one-tile-per-row kernels take; wider rows fall back to the reference.
MAX_E = 4096


@triton.jit
def _mix32(x):
    # the reference's _mix32 on uint32 lanes: shifts are logical and products wrap mod 2^32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _keep(rows64, cols, E, KEY0, KEY1, DROP_THRESHOLD):
    # Keys arrive as int32 bit patterns (so launches specialise to i32 whatever the key); the
    # flat index is int64 so T·E past 2^32 still gets distinct counters (its high word is hashed).
    idx = rows64[:, None] * E + cols[None, :]
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    h = _mix32(lo ^ KEY0.to(tl.uint32, bitcast=True))
    h = _mix32(h ^ (hi + KEY1.to(tl.uint32, bitcast=True)))
    return (h >> 8).to(tl.int32) >= DROP_THRESHOLD


@triton.jit
def _hstu_output_fwd_kernel(
    a_ptr,
    u_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    T,
    E,
    stride_a,
    stride_u,
    EPS,
    KEY0,
    KEY1,
    DROP_THRESHOLD,
    SCALE,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    rows64 = rows.to(tl.int64)
    mask = (rows < T)[:, None] & (cols < E)[None, :]

    a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
    mean = tl.sum(a, axis=1) / E
    # two passes over the registers (mean, then squared deviations) like torch's LayerNorm,
    # not E[a²] − mean², which cancels badly when |mean| ≫ std
    diff = tl.where(mask, a - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / E + EPS)
    u = tl.load(u_ptr + rows64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    y = u * (diff * rstd[:, None])
    if HAS_DROPOUT:
        y = tl.where(_keep(rows64, cols, E, KEY0, KEY1, DROP_THRESHOLD), y * SCALE, 0.0)
    tl.store(y_ptr + rows64[:, None] * E + cols[None, :], y, mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rows < T)
    tl.store(rstd_ptr + rows, rstd, mask=rows < T)


@triton.jit
def _hstu_output_bwd_kernel(
    a_ptr,
    u_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    da_ptr,
    du_ptr,
    y_ptr,
    T,
    E,
    stride_a,
    stride_u,
    stride_dy,
    KEY0,
    KEY1,
    DROP_THRESHOLD,
    SCALE,
    HAS_DROPOUT: tl.constexpr,
    STORE_Y: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    rows64 = rows.to(tl.int64)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < E)[None, :]
    out_off = rows64[:, None] * E + cols[None, :]

    mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
    # the same two float ops as forward on the same saved mean: n (and y) repeat bit for bit
    n = tl.where(mask, a - mean[:, None], 0.0) * rstd[:, None]
    u = tl.load(u_ptr + rows64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    g = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    if HAS_DROPOUT:
        keep = _keep(rows64, cols, E, KEY0, KEY1, DROP_THRESHOLD)
        g = tl.where(keep, g * SCALE, 0.0)
    tl.store(du_ptr + out_off, g * n, mask=mask)

    # LayerNorm without affine: d_a = rstd · (dn − mean(dn) − n · mean(dn ⊙ n)), padding lanes 0
    dn = g * u
    dn_mean = tl.sum(dn, axis=1) / E
    dnn_mean = tl.sum(dn * n, axis=1) / E
    da = (dn - dn_mean[:, None] - n * dnn_mean[:, None]) * rstd[:, None]
    tl.store(da_ptr + out_off, da, mask=mask)

    if STORE_Y:
        y = u * n
        if HAS_DROPOUT:
            y = tl.where(keep, y * SCALE, 0.0)
        tl.store(y_ptr + out_off, y, mask=mask)


INTERPRETED = interpreted(_hstu_output_fwd_kernel)


def layout_reason(attn: Tensor, u: Tensor) -> str | None:
    """Why the kernels cannot take these (validated) inputs, or None when they can."""
    if attn.shape[1] > MAX_E:
        return f"E = {attn.shape[1]} is wider than the kernel's one-tile rows (at most {MAX_E})"
    return None


def _tiles(width: int, on_gpu: bool, block_m: int | None) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_E, num_warps)`` for rows of ``width`` columns."""
    block_e = triton.next_power_of_2(width)
    if not on_gpu:
        # the interpreter pays per op, not per element; few rows per program keep the tests'
        # tiny T spread over several programs and a ragged last block
        return block_m or 4, block_e, 1
    # about 1024 elements a program, 8 float32 per thread and tile at 4 warps: the backward keeps
    # half a dozen row tiles plus the int64 hash counters live, and 2048-element tiles took ~200
    # registers a thread on sm_80/sm_90 (tests/shared/test_kernels_compile_for_gpu.py reports them)
    block_m = block_m or max(1, 1024 // block_e)
    return block_m, block_e, max(4, min(8, block_m * block_e // 256))


def _as_int32_bits(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def _dropout_args(dropout_p: float, seed: int) -> tuple[int, int, int, float]:
    if dropout_p <= 0.0:
        return 0, 0, 0, 1.0
    k0, k1 = dropout_key(seed)
    return _as_int32_bits(k0), _as_int32_bits(k1), dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _unit_columns(t: Tensor) -> Tensor:
    # rows may be strided (attn and u are often column slices of wider tensors); columns may not
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def hstu_output_forward(
    attn: Tensor, u: Tensor, dropout_p: float, seed: int, eps: float, block_m: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y [T, E], mean [T], rstd [T])``: dropout(u ⊙ LN(attn)) and LayerNorm's float32 row stats."""
    attn, u = _unit_columns(attn), _unit_columns(u)
    n_rows, width = attn.shape
    device = attn.device
    y = torch.empty((n_rows, width), dtype=attn.dtype, device=device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=device)
    rstd = torch.empty_like(mean)
    if n_rows == 0:
        return y, mean, rstd
    on_gpu = device.type == "cuda" and not INTERPRETED
    bm, be, warps = _tiles(width, on_gpu, block_m)
    k0, k1, threshold, scale = _dropout_args(dropout_p, seed)
    _hstu_output_fwd_kernel[(triton.cdiv(n_rows, bm),)](
        attn, u, y, mean, rstd,
        n_rows, width, attn.stride(0), u.stride(0), eps, k0, k1, threshold, scale,
        HAS_DROPOUT=dropout_p > 0.0, BLOCK_M=bm, BLOCK_E=be, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


def hstu_output_backward(
    attn: Tensor,
    u: Tensor,
    dy: Tensor,
    mean: Tensor,
    rstd: Tensor,
    dropout_p: float,
    seed: int,
    store_y: bool,
    block_m: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(d_attn, d_u, y or None)`` from ``dy = dL/dy [T, E]`` (``y`` recomputed when ``store_y``)."""
    attn, u, dy = _unit_columns(attn), _unit_columns(u), _unit_columns(dy)
    n_rows, width = attn.shape
    device = attn.device
    d_attn = torch.empty((n_rows, width), dtype=attn.dtype, device=device)
    d_u = torch.empty_like(d_attn)
    y = torch.empty_like(d_attn) if store_y else None
    if n_rows == 0:
        return d_attn, d_u, y
    on_gpu = device.type == "cuda" and not INTERPRETED
    bm, be, warps = _tiles(width, on_gpu, block_m)
    k0, k1, threshold, scale = _dropout_args(dropout_p, seed)
    _hstu_output_bwd_kernel[(triton.cdiv(n_rows, bm),)](
        attn, u, dy, mean, rstd, d_attn, d_u, y if store_y else d_u,
        n_rows, width, attn.stride(0), u.stride(0), dy.stride(0), k0, k1, threshold, scale,
        HAS_DROPOUT=dropout_p > 0.0, STORE_Y=store_y, BLOCK_M=bm, BLOCK_E=be, num_warps=warps,
    )  # fmt: skip
    return d_attn, d_u, y


class _HSTUOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, u, x, weight, bias, dropout_p, seed, eps):
        y, mean, rstd = hstu_output_forward(attn, u, dropout_p, seed, eps)
        ctx.save_for_backward(attn, u, weight, mean, rstd)
        ctx.dropout_p, ctx.seed = dropout_p, seed
        # (bias + y·Wᵀ) + x: the reference's order of the two additions
        return torch.addmm(bias, y, weight.t()).add_(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        attn, u, weight, mean, rstd = ctx.saved_tensors
        need_attn, need_u, need_x, need_w, need_b = ctx.needs_input_grad[:5]
        d_attn = d_u = d_x = d_w = d_b = None
        if need_attn or need_u or need_w:
            # torch's matmul reads any strides, so a stride-0 or transposed grad_out is never
            # handed to the kernel, which sees only this fresh contiguous dy
            # (zeros when only d_weight is wanted: the kernel's d_attn/d_u are then discarded)
            dy = grad_out.mm(weight) if (need_attn or need_u) else torch.zeros_like(attn)
            da, du, y = hstu_output_backward(attn, u, dy, mean, rstd, ctx.dropout_p, ctx.seed, need_w)
            d_attn = da if need_attn else None
            d_u = du if need_u else None
            d_w = grad_out.t().mm(y) if need_w else None
        if need_x:
            d_x = grad_out
        if need_b:
            d_b = grad_out.sum(0)
        return d_attn, d_u, d_x, d_w, d_b, None, None, None


def hstu_output_triton(
    attn: Tensor,
    u: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    dropout_p: float,
    seed: int,
    eps: float,
) -> Tensor:
    """The fused op behind :func:`recforge.kernels.hstu_output.hstu_output` (validated inputs).

    attn, u: ``[T, E]``; x: ``[T, D]``; weight: ``[D, E]``; bias: ``[D]``; returns ``[T, D]``.
    """
    return _HSTUOutput.apply(attn, u, x, weight, bias, float(dropout_p), int(seed), float(eps))

"""Triton twin of :func:`recforge.kernels.dot_interaction.dot_interaction_reference`.

Forward, one program per ``ROWS`` batch rows, one row at a time: load the row's stacked vectors
``T`` in ``[BLOCK_F, BLOCK_K]`` tiles, slice by slice of d (tile row 0 from ``dense``, rows 1..F_e
from ``embeddings``; padding rows and columns zero), accumulate ``Z = T Tᵀ`` with one ``tl.dot``
a slice, and store the kept triangle straight to its output columns: pair ``(i, j)`` goes to
column ``d + i(i-1)/2 + j`` (``d + i(i+1)/2 + j`` with the diagonal), the reference's row-by-row
order, and ``dense`` to columns ``0..d-1``. Neither ``T``, ``Z`` nor an index tensor is written to
memory; per row the kernel reads ``F·d`` values and writes ``d + P``, which is all the op must move.

Backward: with ``G`` the output gradient's pair columns scattered into the lower triangle of an
``F x F`` matrix, ``dT = (G + Gᵀ) T`` (Z is symmetric in T). The kernel gathers ``S = G + Gᵀ``
directly (``S[i, j] = g[pos(max(i, j), min(i, j))]``, the diagonal doubled when it is kept, zero
otherwise), recomputes ``T`` from the saved inputs slice by slice, takes ``S T`` with one
``tl.dot`` a slice and writes
``d_embeddings = (S T)[1:]`` and ``d_dense = g[:, :d] + (S T)[0]`` (the pass-through plus the
dense vector's share of the dots). Every output element is written by exactly one program, no
atomics: reruns are bitwise identical.

float32 dots use ``input_precision="ieee"`` (TF32 would round T to 10-bit mantissas, outside
float32 agreement with the reference; torch's own fp32 bmm does not use TF32 by default);
bfloat16/float16 inputs go to the tensor cores as they are (bfloat16 is upcast under the
interpreter, see ``_upcast``), accumulating in float32, and results are rounded once to the input
dtype. Walking d in slices bounds the registers whatever d is; only F is limited (``MAX_F``).

This module imports triton at import time; :mod:`recforge.kernels.dot_interaction` imports it
lazily and falls back to the PyTorch path when that fails.
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
    "MAX_D",
    "MAX_F",
    "dot_interaction_backward",
    "dot_interaction_forward",
    "dot_interaction_triton",
    "layout_reason",
]

#: Input dtypes the kernels read (dot products accumulate in float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Most stacked vectors (F = F_e + 1) the kernels take (the F x F tile lives in registers); more
#: fall back to the reference. d has no limit (it is walked in slices); MAX_D is only the widest
#: case tests/shared/test_kernels_compile_for_gpu.py compiles.
MAX_F = 64
MAX_D = 256


@triton.jit
def _load_stacked(dense_ptr, emb_ptr, row64, feats, cols, last_feat, n_cols, stride_dense,
                  stride_emb_b, stride_emb_f):
    # T's row f is dense for f = 0 and embeddings[:, f - 1] after; lanes past F or d read 0 so the
    # padded tile's dots are the real ones (a row past the batch passes last_feat = -1, n_cols = 0
    # and reads nothing)
    col_ok = cols < n_cols
    emb_rows = tl.maximum(feats - 1, 0).to(tl.int64)
    emb_mask = ((feats >= 1) & (feats <= last_feat))[:, None] & col_ok[None, :]
    t = tl.load(emb_ptr + row64 * stride_emb_b + emb_rows[:, None] * stride_emb_f + cols[None, :],
                mask=emb_mask, other=0.0)
    x = tl.load(dense_ptr + row64 * stride_dense + cols, mask=col_ok, other=0.0)
    return tl.where((feats == 0)[:, None], x[None, :], t), x


@triton.jit
def _dot_interaction_fwd_kernel(
    dense_ptr,
    emb_ptr,
    out_ptr,
    B,
    F_EMB,
    D,
    stride_dense,
    stride_emb_b,
    stride_emb_f,
    stride_out,
    ITSELF: tl.constexpr,
    UPCAST: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    feats = tl.arange(0, BLOCK_F)
    i = feats[:, None]
    j = feats[None, :]
    # output column of pair (i, j) after the d dense columns, and which pairs are kept
    if ITSELF:
        pair_col = i * (i + 1) // 2 + j
        lower = j <= i
    else:
        pair_col = i * (i - 1) // 2 + j
        lower = j < i
    for r in range(ROWS):
        row = tl.program_id(0) * ROWS + r
        row64 = row.to(tl.int64)
        # a row past the batch reads and stores nothing: its bounds collapse (a scalar mask does
        # not combine with tensor masks in the interpreter)
        last_feat = tl.where(row < B, F_EMB, -1)
        n_cols = tl.where(row < B, D, 0)
        out_row = out_ptr + row64 * stride_out
        # Z accumulates over slices of d, so the tiles stay BLOCK_F x BLOCK_K whatever d is
        gram = tl.zeros((BLOCK_F, BLOCK_F), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            t, x = _load_stacked(dense_ptr, emb_ptr, row64, feats, cols, last_feat, n_cols,
                                 stride_dense, stride_emb_b, stride_emb_f)
            if UPCAST:
                t = t.to(tl.float32)
                gram = tl.dot(t, tl.trans(t), gram, input_precision="ieee")
            else:
                gram = tl.dot(t, tl.trans(t), gram)
            tl.store(out_row + cols, x, mask=cols < n_cols)
        tl.store(out_row + D + pair_col, gram.to(out_ptr.dtype.element_ty),
                 mask=lower & (i <= last_feat))


@triton.jit
def _dot_interaction_bwd_kernel(
    grad_ptr,
    dense_ptr,
    emb_ptr,
    d_dense_ptr,
    d_emb_ptr,
    B,
    F_EMB,
    D,
    stride_grad,
    stride_dense,
    stride_emb_b,
    stride_emb_f,
    ITSELF: tl.constexpr,
    UPCAST: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    feats = tl.arange(0, BLOCK_F)
    i = feats[:, None]
    j = feats[None, :]
    # S = G + Gᵀ read in place: entry (i, j) is the gradient of pair (max, min)
    hi = tl.maximum(i, j)
    lo = tl.minimum(i, j)
    if ITSELF:
        pair_col = hi * (hi + 1) // 2 + lo
        paired = i == i
    else:
        pair_col = hi * (hi - 1) // 2 + lo
        paired = i != j
    emb_rows = tl.maximum(feats - 1, 0).to(tl.int64)
    for r in range(ROWS):
        row = tl.program_id(0) * ROWS + r
        row64 = row.to(tl.int64)
        last_feat = tl.where(row < B, F_EMB, -1)
        n_cols = tl.where(row < B, D, 0)
        grad_row = grad_ptr + row64 * stride_grad
        s = tl.load(grad_row + D + pair_col, mask=paired & (hi <= last_feat), other=0.0)
        if ITSELF:
            # Z[i, i] = t_i·t_i: its gradient reaches t_i twice
            s = tl.where(i == j, s + s, s)
        emb_out = (feats >= 1) & (feats <= last_feat)
        # dT = S T column slice by column slice: each slice of d is independent
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < n_cols
            t, _ = _load_stacked(dense_ptr, emb_ptr, row64, feats, cols, last_feat, n_cols,
                                 stride_dense, stride_emb_b, stride_emb_f)
            if UPCAST:
                d_t = tl.dot(s.to(tl.float32), t.to(tl.float32), input_precision="ieee")
            else:
                d_t = tl.dot(s, t)
            passthrough = tl.load(grad_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            d_x = passthrough + tl.sum(tl.where((feats == 0)[:, None], d_t, 0.0), axis=0)
            tl.store(d_dense_ptr + row64 * D + cols, d_x.to(d_dense_ptr.dtype.element_ty), mask=col_ok)
            tl.store(d_emb_ptr + row64 * F_EMB * D + emb_rows[:, None] * D + cols[None, :],
                     d_t.to(d_emb_ptr.dtype.element_ty), mask=emb_out[:, None] & col_ok[None, :])


INTERPRETED = interpreted(_dot_interaction_fwd_kernel)


def layout_reason(dense: Tensor, embeddings: Tensor) -> str | None:
    """Why the kernels cannot take these (validated) inputs, or None when they can."""
    n_features = embeddings.shape[1] + 1
    if n_features > MAX_F:
        return (f"F = {n_features} stacked vectors is more than the kernel's F x F tile takes "
                f"(at most {MAX_F})")
    return None


def _config(n_features: int, dim: int, on_gpu: bool) -> dict:
    """Launch settings: ``rows`` per program, the ``block_f`` x ``block_k`` tile of T (d is walked
    in ``block_k`` slices), ``num_warps``."""
    # tl.dot needs every tile dimension >= 16
    block_f = max(16, triton.next_power_of_2(n_features))
    if not on_gpu:
        # the interpreter pays per op, not per element: the whole row in one slice when d <= 64,
        # and two rows a program still exercise the row loop and a ragged last program
        return {"rows": 2, "block_f": block_f, "block_k": max(16, min(64, triton.next_power_of_2(dim))),
                "num_warps": 1}
    # float32 "ieee" dots run on FMAs with each thread holding whole operand rows and columns of
    # its outputs. Compiled for sm_80/sm_90 at F = 27 (32-row tiles), one row a program, 16-wide
    # slices and 4 warps take ~65 registers forward and ~130-145 backward (S stays live across the
    # slices); four rows a program took 96-144 / 168-185 (the row loop is pipelined), 32-wide
    # slices up to 240. 64-row tiles take 8 warps.
    return {"rows": 1, "block_f": block_f, "block_k": 16, "num_warps": 4 if block_f <= 32 else 8}


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the dots take float32 operands ("ieee" FMAs): float32 inputs, and bfloat16 under the
    interpreter, whose dot multiplies bf16's raw uint16 storage (Triton 3.x); upcasting gives the
    same exact products. Otherwise half inputs go to the tensor cores as they are."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and INTERPRETED)


def _unit_last(t: Tensor) -> Tensor:
    # rows and features may be strided (a slice of a wider tensor); the last dimension may not
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _launch_config(dense: Tensor, embeddings: Tensor, config: dict | None) -> dict:
    on_gpu = dense.device.type == "cuda" and not INTERPRETED
    return {**_config(embeddings.shape[1] + 1, dense.shape[1], on_gpu), **(config or {})}


def dot_interaction_forward(
    dense: Tensor, embeddings: Tensor, itself: bool, config: dict | None = None
) -> Tensor:
    """dense ``[B, d]``, embeddings ``[B, F_e, d]`` (one dtype) -> ``[B, d + P]``."""
    dense, embeddings = _unit_last(dense), _unit_last(embeddings)
    batch, dim = dense.shape
    n_emb = embeddings.shape[1]
    n_features = n_emb + 1
    n_out = dim + (n_features * (n_features + 1) // 2 if itself else n_features * (n_features - 1) // 2)
    out = torch.empty((batch, n_out), dtype=dense.dtype, device=dense.device)
    if batch == 0:
        return out
    cfg = _launch_config(dense, embeddings, config)
    _dot_interaction_fwd_kernel[(triton.cdiv(batch, cfg["rows"]),)](
        dense, embeddings, out,
        batch, n_emb, dim, dense.stride(0), embeddings.stride(0), embeddings.stride(1), out.stride(0),
        ITSELF=itself, UPCAST=_upcast(dense.dtype), ROWS=cfg["rows"],
        BLOCK_F=cfg["block_f"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def dot_interaction_backward(
    grad_out: Tensor, dense: Tensor, embeddings: Tensor, itself: bool, config: dict | None = None
) -> tuple[Tensor, Tensor]:
    """``(d_dense [B, d], d_embeddings [B, F_e, d])`` from ``grad_out [B, d + P]``."""
    dense, embeddings, grad_out = _unit_last(dense), _unit_last(embeddings), _unit_last(grad_out)
    batch, dim = dense.shape
    n_emb = embeddings.shape[1]
    d_dense = torch.empty((batch, dim), dtype=dense.dtype, device=dense.device)
    d_emb = torch.empty((batch, n_emb, dim), dtype=embeddings.dtype, device=dense.device)
    if batch == 0:
        return d_dense, d_emb
    cfg = _launch_config(dense, embeddings, config)
    _dot_interaction_bwd_kernel[(triton.cdiv(batch, cfg["rows"]),)](
        grad_out, dense, embeddings, d_dense, d_emb,
        batch, n_emb, dim, grad_out.stride(0), dense.stride(0), embeddings.stride(0),
        embeddings.stride(1),
        ITSELF=itself, UPCAST=_upcast(dense.dtype), ROWS=cfg["rows"],
        BLOCK_F=cfg["block_f"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return d_dense, d_emb


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, embeddings, itself, config):
        ctx.save_for_backward(dense, embeddings)
        ctx.itself, ctx.config = itself, config
        return dot_interaction_forward(dense, embeddings, itself, config)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        dense, embeddings = ctx.saved_tensors
        need_dense, need_emb = ctx.needs_input_grad[:2]
        if not (need_dense or need_emb):
            return None, None, None, None
        # grad_out's dtype follows the output's, which is the inputs'; a stride-0 gradient (from
        # .sum()) has no unit last stride and is copied by _unit_last
        d_dense, d_emb = dot_interaction_backward(
            grad_out.to(dense.dtype), dense, embeddings, ctx.itself, ctx.config
        )
        return (d_dense if need_dense else None), (d_emb if need_emb else None), None, None


@torch.compiler.disable
def dot_interaction_triton(
    dense: Tensor, embeddings: Tensor, itself: bool, config: dict | None = None
) -> Tensor:
    """The fused op behind :func:`recforge.kernels.dot_interaction.dot_interaction` (validated
    inputs of one dtype).

    dense ``[B, d]``, embeddings ``[B, F_e, d]`` -> ``[B, d + P]``. ``config`` overrides the launch
    settings (``rows``, ``block_f``, ``block_k``, ``num_warps``; see ``_config``) for tests, tuning
    and ahead-of-time compiles. Excluded from ``torch.compile`` graphs (a graph break): the
    autograd function launches its own kernels.
    """
    return _DotInteraction.apply(_unit_last(dense), _unit_last(embeddings), bool(itself), config)

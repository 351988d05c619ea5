"""Triton jagged causal HSTU attention, forward and backward, with the relative bias built in-kernel.

The op (spec §1.3-1.4), for row ``b`` of a jagged batch, query ``i``, key ``j <= i`` (within-row
positions, 0 = oldest) and head ``h``::

    s_ij  = q_i . k_j + pos_weights[W - 1 + j - i] + time_weights[bucket(query_times_i - t_j)]
    out_i = sum_{j <= i} SiLU(s_ij) / W * v_j

with ``bucket(d) = clamp(trunc(log(float32(max(|d|, 1))) / 0.301), 0, NB)`` (the reference's
float32 formula, :func:`time_bucket`). No ``[L, L]`` score or attention matrix is ever stored:

* forward, grid ``(cdiv(max_len, BLOCK_M), B, H)``: a program takes one query tile of one row and
  head, walks the key tiles up to the causal limit and accumulates ``SiLU(s) / W @ V`` in fp32;
* backward dK/dV, grid ``(cdiv(max_len, BLOCK_N), B, H)``: a program takes one key tile, walks the
  queries from the diagonal to the row's end, recomputes the scores, and accumulates dV, dK and
  the bias gradients (below);
* backward dQ, grid like the forward: recomputes scores and dP again and accumulates dQ, so no
  program ever adds into memory another program writes (no atomics, bit-identical reruns).

All dots are fp32 with ``input_precision="ieee"`` (FMAs, no TF32 rounding); the tiles are small
because such dots hold their operands in registers (see ``_config``).

The bias gradients are sums of ``dS`` over (i, j, h) per distance ``i - j`` and per time bucket.
Each dK/dV program keeps its own partial sums and writes them to a buffer of its own; torch sums
the buffers afterwards (a fixed-order reduction), so the result is deterministic:

* per distance: a gather that rotates each row of a dS tile by its index lines every diagonal up
  in one column, so two column sums give the tile's diagonal sums. They go into a register window
  over the distances the current and later query steps can reach; entries no later step reaches
  are written out once and the window slides on (details in the kernel). The buffer holds about
  ``max_len`` floats per (row, head, key tile): ``B * H * max_len**2 / BLOCK_N`` floats in all.
* per bucket: a tile holds a few distinct buckets (with chronological timestamps the buckets are
  monotone along both axes of a tile), so the program loops over the tile's bucket range and adds
  one masked tile sum per bucket into a register histogram. Worst case (unordered timestamps) is
  ``NB + 1`` masked sums per tile: slow, never wrong.

Exact buckets: Triton's ``log`` may differ from torch's by an ulp, which near a bucket boundary
would move ``trunc`` by one. :func:`bucket_thresholds` finds, with the torch formula itself, the
smallest integer gap of every bucket; the kernel takes the float estimate and corrects it by one
either way against that int64 table, so it reproduces the torch formula for every int64 gap.

This module imports triton at import time; the dispatcher (:mod:`recforge.kernels.hstu_attention`)
imports it lazily and falls back to its PyTorch path when that fails.
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
    "bucket_thresholds",
    "hstu_attention_triton",
    "time_bucket",
]

#: Input dtypes the kernels read (all arithmetic is float32).
KERNEL_DTYPES = (torch.float32,)

# The reference's log-bucket width (spec §1.4).
BUCKET_DIVISOR = 0.301
INT64_MAX = 2**63 - 1
# Largest gap the kernel compares with the threshold table: it rounds to the same float32 as
# INT64_MAX (2**63), so the bucket is unchanged, and it stays below the INT64_MAX sentinel that
# marks buckets no gap reaches.
GAP_MAX = INT64_MAX - 1
# the same, as constants the kernels may read
_DIVISOR = tl.constexpr(BUCKET_DIVISOR)
_INT64_MAX = tl.constexpr(INT64_MAX)
_GAP_MAX = tl.constexpr(GAP_MAX)
# "ieee": TF32 would round q and k to 10-bit mantissas, far outside fp32 agreement.
DOT_PRECISION = "ieee"


def time_bucket(delta: Tensor, num_buckets: int) -> Tensor:
    """The reference's time bucket of int64 gaps ``delta`` (any shape), as int64 in [0, num_buckets]."""
    gap = delta.abs().clamp(min=1).to(torch.float32)
    return (torch.log(gap) / BUCKET_DIVISOR).long().clamp(0, num_buckets)


_THRESHOLDS: dict[tuple[int, str, int | None], Tensor] = {}


def bucket_thresholds(num_buckets: int, device: torch.device | str) -> Tensor:
    """``[num_buckets + 2]`` int64: entry ``b`` is the smallest gap ``x >= 1`` with ``time_bucket(x) >= b``.

    Buckets no gap reaches (``num_buckets + 1`` always, and high buckets when ``num_buckets`` is
    large) get INT64_MAX, above every gap the kernel compares. Computed on ``device`` with the torch
    formula (CPU and CUDA logs may differ), by a bisection per bucket that relies on the formula
    being monotone in the gap; cached per (num_buckets, device).
    """
    device = torch.device(device)
    key = (num_buckets, device.type, device.index)
    table = _THRESHOLDS.get(key)
    if table is None:
        wanted = torch.arange(num_buckets + 2, device=device)
        lo = torch.ones_like(wanted)
        hi = torch.full_like(wanted, GAP_MAX)
        reached = time_bucket(hi, num_buckets) >= wanted
        # invariant for reached buckets: time_bucket(hi) >= b and every gap below lo is below b;
        # 63 halvings close a 2**63-wide interval
        for _ in range(64):
            mid = lo + (hi - lo) // 2
            up = time_bucket(mid, num_buckets) >= wanted
            hi = torch.where(up, mid, hi)
            lo = torch.where(up, lo, mid + 1)
        table = torch.where(reached, hi, torch.full_like(hi, INT64_MAX))
        _THRESHOLDS[key] = table
    return table


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _rab(rows, cols, L, qt, ts, pos_ptr, tw_ptr, thr_ptr, W, NB):
    """Relative bias, time bucket and causal mask of a ``[BLOCK_M, BLOCK_N]`` tile.

    rows, cols: within-row query and key positions ``[BLOCK_M]``, ``[BLOCK_N]``; qt, ts: their
    query times and key timestamps (int64). Entries outside the mask get bias 0 and some bucket
    in [0, NB].
    """
    valid = (cols[None, :] <= rows[:, None]) & (rows[:, None] < L)
    pos = tl.load(pos_ptr + (W - 1) + cols[None, :] - rows[:, None], mask=valid, other=0.0)
    delta = qt[:, None] - ts[None, :]
    # |delta| wraps for INT64_MIN exactly like torch's abs, and the clamp then sends it to 1 alike
    gap = tl.where(delta < 0, -delta, delta)
    gap = tl.minimum(tl.maximum(gap, 1), _GAP_MAX)
    est = (tl.log(gap.to(tl.float32)) / _DIVISOR).to(tl.int32)
    est = tl.minimum(tl.maximum(est, 0), NB)
    # The estimate is within one of the torch bucket; the thresholds settle which side of each
    # boundary the integer gap lies on.
    lo = tl.load(thr_ptr + est, mask=valid, other=1)
    hi = tl.load(thr_ptr + est + 1, mask=valid, other=_INT64_MAX)
    bucket = est - (gap < lo).to(tl.int32) + (gap >= hi).to(tl.int32)
    bucket = tl.minimum(tl.maximum(bucket, 0), NB)
    tw = tl.load(tw_ptr + bucket, mask=valid, other=0.0)
    return pos + tw, bucket, valid


@triton.jit
def _row_span(off_ptr, b):
    start = tl.load(off_ptr + b)
    length = (tl.load(off_ptr + b + 1) - start).to(tl.int32)
    return start, length


@triton.jit
def _load_rows(ptr, tok, mask, stride_t, D, BLOCK_D: tl.constexpr):
    """``[len(tok), BLOCK_D]`` tile of a head's ``[T, D]`` slice at ``ptr`` (zeros where masked or padded)."""
    dims = tl.arange(0, BLOCK_D)
    return tl.load(
        ptr + tok[:, None] * stride_t + dims[None, :], mask=mask[:, None] & (dims < D)[None, :], other=0.0
    )


@triton.jit
def _row_dots(a_ptr, a_tok, a_mask, stride_at, b_ptr, b_tok, b_mask, stride_bt, D,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              SLICE_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``[BLOCK_M, BLOCK_N]`` dot products of rows ``a[a_tok]`` with rows ``b[b_tok]`` over ``D`` dims.

    fp32 "ieee" dots are unrolled into FMAs whose operands sit in registers as whole K-strips per
    thread, so a 64-wide contraction spills; the head dimension is therefore contracted in
    ``SLICE_D``-wide slices, each loaded afresh (cache hits). Scores and dP go through here in
    every kernel, so the backward recomputes the forward's scores bit for bit.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, SLICE_D):
        dims = d0 + tl.arange(0, SLICE_D)
        a = tl.load(
            a_ptr + a_tok[:, None] * stride_at + dims[None, :],
            mask=a_mask[:, None] & (dims < D)[None, :],
            other=0.0,
        )
        b_t = tl.load(
            b_ptr + b_tok[None, :] * stride_bt + dims[:, None],
            mask=b_mask[None, :] & (dims < D)[:, None],
            other=0.0,
        )
        acc = tl.dot(a, b_t, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _hstu_fwd_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, pos_ptr, tw_ptr, ts_ptr, qt_ptr, thr_ptr, o_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    W, NB, DQK, DV, inv_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    SLICE_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, L = _row_span(off_ptr, b)
    m0 = pid_m * BLOCK_M
    if m0 >= L:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < L
    tok_m = start + rows  # int64: T * H * d may pass 2**31
    q_head = q_ptr + h * stride_qh
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    qt = tl.load(qt_ptr + tok_m, mask=row_mask, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for n0 in range(0, tl.minimum(m0 + BLOCK_M, L), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < L
        tok_n = start + cols
        ts = tl.load(ts_ptr + tok_n, mask=col_mask, other=0)
        rab, _, valid = _rab(rows, cols, L, qt, ts, pos_ptr, tw_ptr, thr_ptr, W, NB)
        qk = _row_dots(q_head, tok_m, row_mask, stride_qt, k_head, tok_n, col_mask, stride_kt, DQK,
                       BLOCK_M, BLOCK_N, BLOCK_DQK, SLICE_D, PRECISION)  # fmt: skip
        s = qk + rab
        a = tl.where(valid, s * tl.sigmoid(s) * inv_w, 0.0)
        v = _load_rows(v_head, tok_n, col_mask, stride_vt, DV, BLOCK_DV)
        acc = tl.dot(a, v, acc, input_precision=PRECISION)
    d_v = tl.arange(0, BLOCK_DV)
    tl.store(
        o_ptr + tok_m[:, None] * stride_ot + h * stride_oh + d_v[None, :],
        acc,
        mask=row_mask[:, None] & (d_v < DV)[None, :],
    )


@triton.jit
def _hstu_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, off_ptr, pos_ptr, tw_ptr, ts_ptr, qt_ptr, thr_ptr,
    dk_ptr, dv_ptr, dpos_ptr, dtw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    H, W, NB, DQK, DV, inv_w, n_tiles, dist_width,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_NB: tl.constexpr, SLICE_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # A program owns BLOCK_N keys and steps through the queries BLOCK_M at a time (BLOCK_M divides
    # BLOCK_N): BLOCK_M is the contraction of the dK and dV dots, kept small for registers.
    pid_n, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, L = _row_span(off_ptr, b)
    n0 = pid_n * BLOCK_N
    if n0 >= L:
        return
    cols = n0 + tl.arange(0, BLOCK_N)
    col_mask = cols < L
    tok_n = start + cols
    q_head = q_ptr + h * stride_qh
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    do_head = do_ptr + h * stride_doh
    ts = tl.load(ts_ptr + tok_n, mask=col_mask, other=0)
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    hist = tl.zeros((BLOCK_NB,), dtype=tl.float32)
    bins = tl.arange(0, BLOCK_NB)

    # Per-distance sums. Rotating row r of a tile left by r puts its entries of distance
    # off + t (rows r >= t) and off + t - BLOCK_N (rows r < t) into column t, off = m0 - n0, so
    # two column sums give all its diagonal sums. They land in a window over the distances
    # [off - BLOCK_N, off + BLOCK_N), held as a low and a high half; later tiles only reach
    # distances above off + BLOCK_M - BLOCK_N, so after each tile the window's first BLOCK_M
    # entries are final: they are written once, and the window slides on by BLOCK_M.
    lane_m = tl.arange(0, BLOCK_M)
    lane_n = tl.arange(0, BLOCK_N)
    rotate = (lane_m[:, None] - lane_n[None, :] + BLOCK_N) % BLOCK_N
    on_or_below = lane_m[:, None] >= lane_n[None, :]
    slide = lane_n + BLOCK_M
    from_low = slide < BLOCK_N
    slide_low = tl.where(from_low, slide, 0)
    slide_high = tl.where(from_low, 0, slide - BLOCK_N)
    low = tl.zeros((BLOCK_N,), dtype=tl.float32)
    high = tl.zeros((BLOCK_N,), dtype=tl.float32)
    part = ((b * H + h) * n_tiles + pid_n).to(tl.int64)
    dist_base = dpos_ptr + part * dist_width

    for m0 in range(n0, L, BLOCK_M):
        rows = m0 + lane_m
        row_mask = rows < L
        tok_m = start + rows
        qt = tl.load(qt_ptr + tok_m, mask=row_mask, other=0)
        rab, bucket, valid = _rab(rows, cols, L, qt, ts, pos_ptr, tw_ptr, thr_ptr, W, NB)
        qk = _row_dots(q_head, tok_m, row_mask, stride_qt, k_head, tok_n, col_mask, stride_kt, DQK,
                       BLOCK_M, BLOCK_N, BLOCK_DQK, SLICE_D, PRECISION)  # fmt: skip
        s = qk + rab
        sig = tl.sigmoid(s)
        a = tl.where(valid, s * sig * inv_w, 0.0)
        do = _load_rows(do_head, tok_m, row_mask, stride_dot, DV, BLOCK_DV)
        dv = tl.dot(tl.trans(a), do, dv, input_precision=PRECISION)
        dp = _row_dots(do_head, tok_m, row_mask, stride_dot, v_head, tok_n, col_mask, stride_vt, DV,
                       BLOCK_M, BLOCK_N, BLOCK_DV, SLICE_D, PRECISION)  # fmt: skip
        # d SiLU(s) / ds = sig * (1 + s * (1 - sig))
        ds = tl.where(valid, dp * (sig * (1.0 + s * (1.0 - sig))) * inv_w, 0.0)
        q = _load_rows(q_head, tok_m, row_mask, stride_qt, DQK, BLOCK_DQK)
        dk = tl.dot(tl.trans(ds), q, dk, input_precision=PRECISION)

        rotated = tl.gather(ds, rotate, axis=1)
        low += tl.sum(tl.where(on_or_below, 0.0, rotated), axis=0)
        high += tl.sum(tl.where(on_or_below, rotated, 0.0), axis=0)
        final = m0 - n0 - BLOCK_N + lane_n
        tl.store(dist_base + final, low, mask=(lane_n < BLOCK_M) & (final >= 0))
        low = tl.where(from_low, tl.gather(low, slide_low, axis=0), tl.gather(high, slide_high, axis=0))
        high = tl.where(from_low, tl.gather(high, slide_low, axis=0), 0.0)

        # Per bucket: one masked tile sum per bucket present in the tile.
        b_lo = tl.min(tl.where(valid, bucket, NB + 1))
        b_hi = tl.max(tl.where(valid, bucket, -1))
        for kb in range(b_lo, b_hi + 1):
            total = tl.sum(tl.where(bucket == kb, ds, 0.0))
            hist += tl.where(bins == kb, total, 0.0)

    # The window after the last slide starts at off_end - BLOCK_N, off_end the query count past
    # n0 rounded up to BLOCK_M; its high half starts at off_end, past every distance of the row.
    first = tl.cdiv(L - n0, BLOCK_M) * BLOCK_M - BLOCK_N + lane_n
    tl.store(dist_base + first, low, mask=first >= 0)
    tl.store(dtw_ptr + part * BLOCK_NB + bins, hist)
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)
    tl.store(
        dk_ptr + tok_n[:, None] * stride_dkt + h * stride_dkh + d_qk[None, :],
        dk,
        mask=col_mask[:, None] & (d_qk < DQK)[None, :],
    )
    tl.store(
        dv_ptr + tok_n[:, None] * stride_dvt + h * stride_dvh + d_v[None, :],
        dv,
        mask=col_mask[:, None] & (d_v < DV)[None, :],
    )


@triton.jit
def _hstu_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, off_ptr, pos_ptr, tw_ptr, ts_ptr, qt_ptr, thr_ptr, dq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    W, NB, DQK, DV, inv_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    SLICE_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, L = _row_span(off_ptr, b)
    m0 = pid_m * BLOCK_M
    if m0 >= L:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < L
    tok_m = start + rows
    q_head = q_ptr + h * stride_qh
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    do_head = do_ptr + h * stride_doh
    qt = tl.load(qt_ptr + tok_m, mask=row_mask, other=0)
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=tl.float32)
    for n0 in range(0, tl.minimum(m0 + BLOCK_M, L), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < L
        tok_n = start + cols
        ts = tl.load(ts_ptr + tok_n, mask=col_mask, other=0)
        rab, _, valid = _rab(rows, cols, L, qt, ts, pos_ptr, tw_ptr, thr_ptr, W, NB)
        qk = _row_dots(q_head, tok_m, row_mask, stride_qt, k_head, tok_n, col_mask, stride_kt, DQK,
                       BLOCK_M, BLOCK_N, BLOCK_DQK, SLICE_D, PRECISION)  # fmt: skip
        s = qk + rab
        sig = tl.sigmoid(s)
        dp = _row_dots(do_head, tok_m, row_mask, stride_dot, v_head, tok_n, col_mask, stride_vt, DV,
                       BLOCK_M, BLOCK_N, BLOCK_DV, SLICE_D, PRECISION)  # fmt: skip
        ds = tl.where(valid, dp * (sig * (1.0 + s * (1.0 - sig))) * inv_w, 0.0)
        k = _load_rows(k_head, tok_n, col_mask, stride_kt, DQK, BLOCK_DQK)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    d_qk = tl.arange(0, BLOCK_DQK)
    tl.store(
        dq_ptr + tok_m[:, None] * stride_dqt + h * stride_dqh + d_qk[None, :],
        dq,
        mask=row_mask[:, None] & (d_qk < DQK)[None, :],
    )


INTERPRETED = interpreted(_hstu_fwd_kernel)


# ------------------------------------------------------------------------------------------- host


def _padded(dim: int) -> int:
    # tl.dot needs every side >= 16; head dims that are not powers of two are masked up to one
    return max(16, triton.next_power_of_2(dim))


def _config(dim_qk: int, dim_v: int, on_gpu: bool) -> dict:
    """Launch settings: ``block_m`` x ``block_n`` query x key tiles of the forward and dQ kernels,
    ``bwd_block_m`` x ``bwd_block_n`` of the dK/dV kernel (``bwd_block_m`` divides
    ``bwd_block_n``), ``slice_d`` (head-dim slice of the score and dP contractions) and
    ``num_warps``."""
    if not on_gpu:
        # The interpreter pays per program and per op: small tiles keep it cheap and make tests at
        # tiny lengths cover several tiles, partial tiles, head-dim slices and a dK/dV key tile
        # spanning two query steps.
        return {"block_m": 16, "block_n": 16, "bwd_block_m": 16, "bwd_block_n": 32, "slice_d": 16,
                "num_warps": 4}  # fmt: skip
    # fp32 "ieee" dots are unrolled into FMAs whose operands sit in registers as whole strips
    # along the contraction, so every contraction is kept 16 wide: key steps of 16 (the K of
    # SiLU(s) @ V and dS @ K), query steps of 16 in the dK/dV kernel (the K of its dots) and head
    # dims in 16-wide slices. The dK/dV kernel holds dK and dV for its keys: 32 keys fit up to
    # head dim 64, 16 at 128. Measured without spills on sm_80 and sm_90, where 64-key dK/dV
    # tiles, 64-query forward tiles or 4 warps at head dim 64 spill (registers per launch:
    # tests/shared/gpu_aot_compile.py).
    widest = max(_padded(dim_qk), _padded(dim_v))
    return {
        "block_m": 32,
        "block_n": 16,
        "bwd_block_m": 16,
        "bwd_block_n": 32 if widest <= 64 else 16,
        "slice_d": 16,
        "num_warps": 8 if widest >= 64 else 4,
    }


def _unit_last(x: Tensor) -> Tensor:
    # The kernels take row and head strides but read the head dimension with unit stride: a view
    # split off a wider projection passes as it is, anything else (e.g. an expanded gradient) is
    # copied once.
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _check_inputs(q, k, v, offsets, max_len, pos_weights, time_weights, timestamps, query_times, width):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"q, k, v must be [T, H, d]; got {shapes}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [T, H, dv] with q's T, H = {tuple(q.shape[:2])}, got {tuple(v.shape)}")
    floats = {"q": q, "k": k, "v": v, "pos_weights": pos_weights, "time_weights": time_weights}
    for name, t in floats.items():
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name} must be one of {KERNEL_DTYPES}, got {t.dtype}")
    n_tok = q.shape[0]
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"offsets must be a 1-D int64 [B+1] tensor, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    for name, t in (("timestamps", timestamps), ("query_times", query_times)):
        if t.shape != (n_tok,) or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an int64 [T={n_tok}] tensor, got {t.dtype} {tuple(t.shape)}")
    if not isinstance(max_len, int) or not isinstance(width, int):
        raise ValueError(f"max_len and width must be python ints, got {type(max_len)}, {type(width)}")
    if width < 1 or width < max_len:
        raise ValueError(f"width ({width}) must be >= 1 and >= max_len ({max_len})")
    if pos_weights.shape != (2 * width - 1,):
        raise ValueError(
            f"pos_weights must be [2 * width - 1] = [{2 * width - 1}], got {tuple(pos_weights.shape)}"
        )
    if time_weights.dim() != 1 or time_weights.numel() < 1:
        raise ValueError(f"time_weights must be [NB + 1], got {tuple(time_weights.shape)}")
    devices = {t.device for t in (q, k, v, offsets, pos_weights, time_weights, timestamps, query_times)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    # one host sync for every fact about the offsets
    lengths = offsets[1:] - offsets[:-1]
    if lengths.numel():
        facts = torch.stack([offsets[0], offsets[-1], lengths.min(), lengths.max()]).tolist()
    else:
        facts = [int(offsets[0]), int(offsets[0]), 0, 0]
    first, last, shortest, longest = facts
    if first != 0 or last != n_tok or shortest < 0:
        raise ValueError(
            f"offsets must rise from 0 to T={n_tok}; got first {first}, last {last}, shortest row {shortest}"
        )
    if longest > max_len:
        raise ValueError(f"max_len ({max_len}) is below the longest row ({longest})")


class _HstuAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, pos_weights, time_weights, timestamps, query_times, width,
                overrides):  # fmt: skip
        n_tok, n_heads, dim_qk = q.shape
        dim_v = v.shape[2]
        on_gpu = q.device.type == "cuda" and not INTERPRETED
        config = {**_config(dim_qk, dim_v, on_gpu), **overrides}
        if config["bwd_block_m"] > config["bwd_block_n"]:
            raise ValueError(f"bwd_block_m must not exceed bwd_block_n, got {config}")
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        offsets = offsets.to(torch.int64).contiguous()
        timestamps = timestamps.to(torch.int64).contiguous()
        query_times = query_times.to(torch.int64).contiguous()
        pos_weights, time_weights = pos_weights.contiguous(), time_weights.contiguous()
        thresholds = bucket_thresholds(time_weights.numel() - 1, q.device)
        tensors = (q, k, v, offsets, pos_weights, time_weights, timestamps, query_times, thresholds)
        out = _forward(*tensors, max_len, width, config)
        ctx.save_for_backward(*tensors)
        ctx.max_len, ctx.width, ctx.config = max_len, width, config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = _unit_last(grad_out.to(torch.float32))
        dq, dk, dv, dpos, dtime = _backward(
            grad_out, *ctx.saved_tensors, ctx.max_len, ctx.width, ctx.config, need_dq=ctx.needs_input_grad[0]
        )
        return dq, dk, dv, None, None, dpos, dtime, None, None, None, None


def _forward(q, k, v, offsets, pos_weights, time_weights, timestamps, query_times, thresholds,
             max_len, width, config):  # fmt: skip
    n_tok, n_heads, dim_qk = q.shape
    dim_v = v.shape[2]
    n_rows = offsets.numel() - 1
    out = torch.zeros((n_tok, n_heads, dim_v), dtype=torch.float32, device=q.device)
    if not (n_tok and n_heads and max_len):
        return out
    _hstu_fwd_kernel[(triton.cdiv(max_len, config["block_m"]), n_rows, n_heads)](
        q, k, v, offsets, pos_weights, time_weights, timestamps, query_times, thresholds, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        width, time_weights.numel() - 1, dim_qk, dim_v, 1.0 / width,
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
        BLOCK_DQK=_padded(dim_qk), BLOCK_DV=_padded(dim_v), SLICE_D=config["slice_d"],
        PRECISION=DOT_PRECISION, num_warps=config["num_warps"],
    )  # fmt: skip
    return out


def _backward(grad_out, q, k, v, offsets, pos_weights, time_weights, timestamps, query_times, thresholds,
              max_len, width, config, need_dq=True):  # fmt: skip
    n_tok, n_heads, dim_qk = q.shape
    dim_v = v.shape[2]
    n_rows = offsets.numel() - 1
    num_buckets = time_weights.numel() - 1
    device = q.device
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format) if need_dq else None
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    dpos = torch.zeros_like(pos_weights)
    dtime = torch.zeros_like(time_weights)
    if not (n_tok and n_heads and max_len):
        return dq, dk, dv, dpos, dtime
    block_nb = _padded(num_buckets + 1)
    n_tiles = triton.cdiv(max_len, config["bwd_block_n"])
    dist_width = n_tiles * config["bwd_block_n"]
    n_programs = n_rows * n_heads * n_tiles
    # per-program partial sums, summed below in a fixed order; programs that exit early (tiles
    # past their row's end) and distances past a row's end leave zeros
    dist_part = torch.zeros((n_programs, dist_width), dtype=torch.float32, device=device)
    bucket_part = torch.zeros((n_programs, block_nb), dtype=torch.float32, device=device)
    inputs = (q, k, v, grad_out, offsets, pos_weights, time_weights, timestamps, query_times, thresholds)
    strides = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1),
    )  # fmt: skip
    dims = {"BLOCK_DQK": _padded(dim_qk), "BLOCK_DV": _padded(dim_v), "SLICE_D": config["slice_d"]}
    _hstu_bwd_dkdv_kernel[(n_tiles, n_rows, n_heads)](
        *inputs, dk, dv, dist_part, bucket_part,
        *strides, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        n_heads, width, num_buckets, dim_qk, dim_v, 1.0 / width, n_tiles, dist_width,
        BLOCK_M=config["bwd_block_m"], BLOCK_N=config["bwd_block_n"], BLOCK_NB=block_nb, **dims,
        PRECISION=DOT_PRECISION, num_warps=config["num_warps"],
    )  # fmt: skip
    if need_dq:
        _hstu_bwd_dq_kernel[(triton.cdiv(max_len, config["block_m"]), n_rows, n_heads)](
            *inputs, dq, *strides, dq.stride(0), dq.stride(1),
            width, num_buckets, dim_qk, dim_v, 1.0 / width,
            BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], **dims,
            PRECISION=DOT_PRECISION, num_warps=config["num_warps"],
        )  # fmt: skip
    # distance i - j = d sits at pos_weights[W - 1 - d]; only d < max_len <= W can occur
    per_distance = dist_part.sum(dim=0)[:max_len]
    dpos[width - max_len : width] = per_distance.flip(0)
    dtime.copy_(bucket_part.sum(dim=0)[: num_buckets + 1])
    return dq, dk, dv, dpos, dtime


def hstu_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    max_len: int,
    pos_weights: Tensor,
    time_weights: Tensor,
    timestamps: Tensor,
    query_times: Tensor,
    width: int,
    *,
    config: dict | None = None,
) -> Tensor:
    """Jagged causal HSTU attention with relative position and time bias; differentiable.

    Args:
        q, k: ``[T, H, dqk]`` float32 (SiLU already applied), T = sum of row lengths.
        v: ``[T, H, dv]`` float32.
        offsets: ``[B+1]`` int64, row b is tokens ``offsets[b]:offsets[b+1]``, oldest first.
        max_len: python int >= the longest row (sizes the grid).
        pos_weights: ``[2W-1]`` float32, bias of distance ``i - j`` at index ``W - 1 + j - i``.
        time_weights: ``[NB+1]`` float32, bias per time bucket.
        timestamps: ``[T]`` int64, each key's time ``t_j``.
        query_times: ``[T]`` int64, per query the time of the item it predicts (``t_{i+1}``).
        width: python int W >= max_len, the reference's padded width (attention is divided by it).
        config: overrides of the launch settings (keys ``block_m``, ``block_n``, ``bwd_block_m``,
            ``bwd_block_n``, ``slice_d``, ``num_warps``; see ``_config``), for tests, tuning and
            ahead-of-time compiles.

    Returns:
        ``[T, H, dv]`` float32. Gradients flow to q, k, v, pos_weights and time_weights.
    """
    _check_inputs(q, k, v, offsets, max_len, pos_weights, time_weights, timestamps, query_times, width)
    overrides = dict(config or {})
    unknown = set(overrides) - {"block_m", "block_n", "bwd_block_m", "bwd_block_n", "slice_d", "num_warps"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    for key in ("block_m", "block_n", "bwd_block_m", "bwd_block_n", "slice_d"):
        size = overrides.get(key)
        if size is not None and (size < 16 or size & (size - 1)):
            raise ValueError(f"{key} must be a power of two >= 16, got {size}")
    return _HstuAttention.apply(
        q, k, v, offsets, max_len, pos_weights, time_weights, timestamps, query_times, width, overrides
    )

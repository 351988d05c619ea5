"""Triton twin of :func:`recforge.kernels.target_rank.target_rank_counts`.

Each program owns ``BLOCK_B`` query rows and a contiguous range of ``BLOCK_N``-item tiles; it scores
a tile with ``tl.dot`` (fp32 accumulation, looping over ``d`` in ``BLOCK_D`` slices), compares it
with the rows' target scores and keeps only two int32 counters per row, so no ``[B, N]`` score
matrix ever exists. When the catalogue is split across programs (to fill the GPU when ``B`` is
small) each split writes its own partial counts and the host sums them: deterministic, no atomics.

Per-row exclusion lists are applied inside the tile loop: the host sorts each row's list, and each
program walks its rows' lists alongside its tiles, turning an excluded pair's score into NaN (which
fails both comparisons) before the tile is counted.

This module imports triton at import time; :mod:`recforge.kernels.target_rank` imports it lazily
and falls back to the PyTorch path when that fails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.kernels._interpret import interpreted
from recforge.kernels.target_rank import sorted_exclusions

__all__ = ["INTERPRETED", "KERNEL_DTYPES", "target_rank_counts_triton"]

#: Input dtypes the kernel reads natively (accumulation is always float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _score_tile(
    q_ptr,
    w_ptr,
    b_ptr,
    rows,
    row_mask,
    items,
    item_mask,
    D,
    stride_qb,
    stride_qd,
    stride_wn,
    stride_wd,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One helper for both the target pass and the catalogue pass: a tied item must get bit-for-bit
    # the score its target gets, so both go through the same dot shape, d-loop and bias add.
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    # int64 offsets: N * d overflows int32 for catalogues of a few tens of millions of items.
    row_off = rows.to(tl.int64) * stride_qb
    item_off = items.to(tl.int64) * stride_wn
    for d0 in range(0, D, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        dim_mask = dims < D
        q = tl.load(
            q_ptr + row_off[:, None] + dims[None, :] * stride_qd,
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + item_off[None, :] + dims[:, None] * stride_wd,
            mask=item_mask[None, :] & dim_mask[:, None],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
            w = w.to(tl.float32)
        # fp32 inputs: "ieee" keeps full fp32 products (TF32 would round them and break ties with
        # the reference); bf16/fp16 products are exact in fp32 anyway.
        acc = tl.dot(q, w, acc, input_precision="ieee")
    if HAS_BIAS:
        bias = tl.load(b_ptr + items, mask=item_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    return acc


@triton.jit
def _target_rank_kernel(
    q_ptr,
    w_ptr,
    b_ptr,
    t_ptr,
    ex_items_ptr,
    ex_start_ptr,
    ex_end_ptr,
    greater_ptr,
    equal_ptr,
    B,
    N,
    D,
    tiles_per_split,
    stride_qb,
    stride_qd,
    stride_wn,
    stride_wd,
    HAS_BIAS: tl.constexpr,
    HAS_EXCLUDE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_b = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    targets = tl.load(t_ptr + rows, mask=row_mask, other=0)

    # Target scores: a tile whose column c is row c's target item (BLOCK_N >= BLOCK_B), scored
    # like any catalogue tile; the diagonal is each row's target score.
    cols = tl.arange(0, BLOCK_N)
    gather_mask = (cols < BLOCK_B) & (pid_b * BLOCK_B + cols < B)
    gathered = tl.load(t_ptr + pid_b * BLOCK_B + cols, mask=gather_mask, other=0)
    diag_scores = _score_tile(
        q_ptr, w_ptr, b_ptr, rows, row_mask, gathered, gather_mask, D,
        stride_qb, stride_qd, stride_wn, stride_wd,
        HAS_BIAS, UPCAST, BLOCK_B, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    on_diag = tl.arange(0, BLOCK_B)[:, None] == cols[None, :]
    target_score = tl.sum(tl.where(on_diag, diag_scores, 0.0), axis=1)

    n_greater = tl.zeros((BLOCK_B,), dtype=tl.int32)
    n_equal = tl.zeros((BLOCK_B,), dtype=tl.int32)
    first_item = split * tiles_per_split * BLOCK_N
    if HAS_EXCLUDE:
        # Each row's exclusion ids are sorted; ex_pos is the row's next one at or past this split's
        # first item (found on the host), ex_next its id (-1 once the list is spent: never an item).
        ex_pos = tl.load(ex_start_ptr + split * B + rows, mask=row_mask, other=0)
        ex_end = tl.load(ex_end_ptr + rows, mask=row_mask, other=0)
        ex_next = tl.load(ex_items_ptr + ex_pos, mask=ex_pos < ex_end, other=-1)
    for t in range(0, tiles_per_split):
        items = first_item + t * BLOCK_N + cols
        item_mask = items < N
        scores = _score_tile(
            q_ptr, w_ptr, b_ptr, rows, row_mask, items, item_mask, D,
            stride_qb, stride_qd, stride_wn, stride_wd,
            HAS_BIAS, UPCAST, BLOCK_B, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        if HAS_EXCLUDE:
            # Masking inside the tile: an excluded pair's score becomes NaN, which fails both
            # comparisons below. It is exact by construction, whereas subtracting the excluded
            # items' counts afterwards would need their scores computed apart, bit-for-bit like
            # this dot (else a tie is split or made). Each step takes every row's next excluded id
            # inside this tile, so the steps per tile are the most any row excludes in it (usually
            # 0 or 1), each a compare-select far cheaper than the dot. Register cost, measured by
            # tests/gpu_aot_compile.py: NaN-starting the accumulator before the d-loop, or picking
            # the excluded scores out of the tile to subtract, spilled more than this on sm_80.
            tile_end = first_item + (t + 1) * BLOCK_N
            hit = (ex_next >= 0) & (ex_next < tile_end)
            while tl.max(hit.to(tl.int32), axis=0) > 0:
                excluded = tl.where(hit, ex_next, -1)  # -1 matches no item
                scores = tl.where(items[None, :] == excluded[:, None], float("nan"), scores)
                ex_pos += hit.to(tl.int64)
                ex_next = tl.load(ex_items_ptr + ex_pos, mask=ex_pos < ex_end, other=-1)
                hit = (ex_next >= 0) & (ex_next < tile_end)
        # The target's own column is skipped (it is counted as one tie on the host), so rounding
        # can never rank the target against itself. NaN scores fail both comparisons.
        keep = item_mask[None, :] & (items[None, :] != targets[:, None])
        n_greater += tl.sum(((scores > target_score[:, None]) & keep).to(tl.int32), axis=1)
        n_equal += tl.sum(((scores == target_score[:, None]) & keep).to(tl.int32), axis=1)

    out = split * B + rows
    tl.store(greater_ptr + out, n_greater, mask=row_mask)
    tl.store(equal_ptr + out, n_equal, mask=row_mask)


INTERPRETED = interpreted(_target_rank_kernel)


def _block_sizes(n_rows: int, dim: int, on_gpu: bool, upcast: bool = False) -> tuple[int, int, int]:
    # tl.dot needs every tile side >= 16. On the GPU, 64 x 128 fp32 accumulators are 64 registers
    # per thread at 4 warps; the interpreter pays per op, so small tiles keep its numpy calls cheap
    # and exercise the d-loop and partial tiles in tests.
    if not on_gpu:
        return 16, 32, 16
    block_b = 64 if n_rows > 32 else max(16, triton.next_power_of_2(max(n_rows, 1)))
    # An fp32 dot in "ieee" precision is unrolled into FMAs: with 64-wide d-steps ptxas spills
    # 1.6 KB per thread (sm_90, 4 warps); 16-wide steps at 8 warps fit in registers (see
    # tests/gpu_aot_compile.py). Half types go to tensor cores and fit at 64.
    block_d = 16 if upcast else min(64, max(16, triton.next_power_of_2(dim)))
    return block_b, 128, block_d


def _num_warps(on_gpu: bool, upcast: bool, exclude: bool = False) -> int:
    # Half tiles with exclusions spilled 72 bytes per thread at 4 warps (sm_80, 64 x 128 tiles, see
    # tests/gpu_aot_compile.py), the plain kernel already 40-56; 8 warps halve each thread's share
    # of the tiles and bring it to none. The launch without exclusions is left as it was.
    return 8 if on_gpu and (upcast or exclude) else 4


def target_rank_counts_triton(
    queries: Tensor,
    item_weights: Tensor,
    item_bias: Tensor | None,
    targets: Tensor,
    *,
    exclude_items: Tensor | None = None,
    exclude_offsets: Tensor | None = None,
    n_splits: int | None = None,
    block_sizes: tuple[int, int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the kernel on already validated inputs (see ``target_rank_counts``).

    Args:
        queries, item_weights, item_bias, targets: ``[B, d]``, ``[N, d]``, ``[N]`` or None, ``[B]``.
        exclude_items, exclude_offsets: ``[E]`` and ``[B+1]`` jagged exclusion lists (any order,
            duplicates allowed), or both None.
        n_splits: programs sharing one row block's catalogue (``None``: enough to fill the GPU).
        block_sizes: ``(BLOCK_B, BLOCK_N, BLOCK_D)`` override, for tests and tuning.

    Returns:
        ``(n_greater, n_equal)``, ``[B]`` int64; ``n_equal`` includes the target itself.
    """
    n_rows, dim = queries.shape
    n_items = item_weights.shape[0]
    device = queries.device
    if n_rows == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty.clone()
    on_gpu = device.type == "cuda" and not INTERPRETED
    # Mixed or fp32 inputs are read as fp32; matching half types go to tl.dot as they are (exact
    # products, fp32 accumulation), except bf16 under the interpreter, whose dot multiplies bf16's
    # raw uint16 storage (Triton 3.x): upcasting gives the same products.
    upcast = (
        queries.dtype != item_weights.dtype
        or queries.dtype == torch.float32
        or (queries.dtype == torch.bfloat16 and not on_gpu)
    )
    block_b, block_n, block_d = block_sizes or _block_sizes(n_rows, dim, on_gpu, upcast)
    if block_n < block_b or min(block_b, block_n, block_d) < 16:
        raise ValueError(f"need 16 <= BLOCK_B <= BLOCK_N and BLOCK_D >= 16, got {block_sizes}")

    row_blocks = triton.cdiv(n_rows, block_b)
    n_tiles = triton.cdiv(n_items, block_n)
    if n_splits is None:
        if on_gpu:
            # ~4 programs per SM hides load latency; each split re-scores its rows' targets (one
            # extra tile), so splits keep >= 8 tiles to bound that overhead at 1/8.
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            n_splits = min(triton.cdiv(4 * sms, row_blocks), triton.cdiv(n_tiles, 8))
        else:
            n_splits = 1
    n_splits = max(1, min(int(n_splits), n_tiles))
    tiles_per_split = triton.cdiv(n_tiles, n_splits)
    n_splits = triton.cdiv(n_tiles, tiles_per_split)  # no program left with nothing to do

    targets = targets.to(device=device, dtype=torch.int64).contiguous()
    greater = torch.empty((n_splits, n_rows), dtype=torch.int32, device=device)
    equal = torch.empty((n_splits, n_rows), dtype=torch.int32, device=device)
    # the bias is read with unit stride; without one, any pointer will do (HAS_BIAS skips it)
    bias = item_bias.contiguous() if item_bias is not None else item_weights
    has_exclude = False
    if exclude_items is not None:
        lists = sorted_exclusions(exclude_items, exclude_offsets, targets, n_items)
        ex_rows, ex_items, ex_offsets = lists
        has_exclude = ex_items.numel() > 0  # lists holding only targets or nothing change nothing
    if has_exclude:
        # where each (split, row) starts in its row's sorted list: the first id at or past the
        # split's first item, i.e. the number of (row, item) keys below (row, first item)
        split_first = torch.arange(n_splits, device=device) * (tiles_per_split * block_n)
        row_keys = torch.arange(n_rows, device=device) * n_items
        ex_start = torch.searchsorted(
            ex_rows * n_items + ex_items, (split_first[:, None] + row_keys[None, :]).reshape(-1)
        )  # [n_splits * B]
        ex_end = ex_offsets[1:].contiguous()
    else:  # the kernel never reads these three: any int64 pointer will do
        ex_items = ex_start = ex_end = targets
    _target_rank_kernel[(row_blocks, n_splits)](
        queries, item_weights, bias, targets, ex_items, ex_start, ex_end, greater, equal,
        n_rows, n_items, dim, tiles_per_split,
        queries.stride(0), queries.stride(1), item_weights.stride(0), item_weights.stride(1),
        HAS_BIAS=item_bias is not None, HAS_EXCLUDE=has_exclude, UPCAST=upcast,
        BLOCK_B=block_b, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=_num_warps(on_gpu, upcast, has_exclude),
    )  # fmt: skip
    n_greater = greater.sum(dim=0, dtype=torch.int64)
    n_equal = equal.sum(dim=0, dtype=torch.int64) + 1
    return n_greater, n_equal

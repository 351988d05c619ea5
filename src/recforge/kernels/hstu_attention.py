"""Causal HSTU attention over jagged histories with the research code's relative bias (spec §1.3-1.4).

Rows of a jagged batch (row ``b`` owns elements ``offsets[b]:offsets[b+1]``, position 0 the oldest)
attend causally within themselves. For query position i and key position j ≤ i of one row, per
head:

    s_ij   = q_i · k_j + pos_weights[width − 1 + j − i] + time_weights[bucket(τ_i − t_j)]
    out_i  = Σ_{j ≤ i} SiLU(s_ij) / width · v_j

with ``t_j`` the key's timestamp, ``τ_i`` the query's time (the caller passes the time of the event
position i predicts: the next history item's, the target's at the last position) and

    bucket(Δ) = clamp(floor(ln(max(|Δ|, 1)) / 0.301), 0, NB),   NB + 1 = len(time_weights)

computed as the reference does (natural log in float32 of the clamped integer difference). No
1/sqrt(d) scaling, no softmax: the SiLU scores are divided by the fixed ``width`` (the reference's
padded width N = max_sequence_length + 11), not by the row's length, so a row's output does not
depend on how long the other rows of its batch are. The biases are shared by the heads.

:func:`hstu_attention_reference` is plain differentiable torch over the padded ``B·H·L²`` scores:
the slow obvious twin, the oracle of the others. ``kernel="pytorch"`` runs its blocked forms, the
same sums over query blocks against only the keys a block can see, never a ``B·H·L²`` tensor:
:func:`hstu_attention_blocked` where a gradient is wanted (its backward recomputes each block's
scores instead of keeping them) and :func:`hstu_attention_inference` where none is (in place).
:func:`hstu_attention_last` gives only each row's last query (the evaluation's user vector needs
no other in the last layer). :func:`time_bucket_grid` is the time-bucket grid of a batch, which
every layer shares (only the weights differ): computed once and passed to each layer as
``buckets``. ``kernel="triton"`` runs :mod:`recforge.kernels.hstu_attention_triton`, imported
lazily, falling back to the PyTorch path with one warning per process when Triton cannot run.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from recforge.kernels.jagged import jagged_positions
from recforge.kernels.twin import KernelImpl, TritonTwin

__all__ = [
    "LOG_BUCKET_DIVISOR",
    "hstu_attention",
    "hstu_attention_blocked",
    "hstu_attention_inference",
    "hstu_attention_last",
    "hstu_attention_reference",
    "time_bucket_grid",
    "time_buckets",
]

TRITON = TritonTwin("recforge.kernels.hstu_attention_triton")

#: The reference's bucket width. 0.301 is log10(2), but it divides a *natural* log: a bucket spans a
#: factor of e^0.301 ≈ 1.35 in time, not 2; kept, since the trained time weights assume it.
LOG_BUCKET_DIVISOR = 0.301


def time_buckets(delta: Tensor, num_buckets: int) -> Tensor:
    """Bucket of each time difference (seconds): int64 in ``[0, num_buckets]``, same shape.

    ``floor(ln(max(|Δ|, 1)) / 0.301)`` in float32, as the reference computes it, so that a
    difference on a bucket boundary falls where it falls there: 1 min -> 13, 1 h -> 27,
    1 day -> 37, 30 days -> 49, 1 year -> 57.
    """
    # in place on one float32 copy ([B, L, L] for a batch: each pass is memory-bound). float32(|Δ|)
    # = |float32(Δ)|, so converting before abs and clamp rounds exactly as the reference does.
    scaled = delta.to(torch.float32, copy=True).abs_().clamp_(min=1).log_().div_(LOG_BUCKET_DIVISOR)
    return scaled.long().clamp_(0, num_buckets)


# Pairs per block of the time-bucket grid's computation: 8 MB of int64 differences.
_GRID_BLOCK_PAIRS = 1 << 20
# An inference block holds about this many scores: 4 MB of float32, so that a block's scores stay
# in cache through the bias, SiLU and mask passes before its product with V.
_BLOCK_SCORES = 1 << 20
# query rows per block (a multiple of the SIMD width); rows of the batch per block follow
_QUERY_ROWS = 64
#: The blocked training path keeps its blocks' pre-activations for the backward while they take
#: at most this many bytes in one call (HSTU-large's ml-1m batch: 29 MB a layer), and recomputes
#: them past it, so that long histories or large batches stay at ``O(B·H·L·d)`` plus one block.
KEEP_SCORES_BYTES = 64 << 20


def _padder(offsets: Tensor, total: int, max_len: int):
    """(slot of each element in a padded ``[B·max_len]`` grid, values -> ``[B, max_len, ...]``)."""
    batch = offsets.numel() - 1
    rows, positions = jagged_positions(offsets, total)
    slot = rows * max_len + positions

    def padded(values: Tensor) -> Tensor:
        grid = values.new_zeros((batch * max_len, *values.shape[1:]))
        return grid.index_copy(0, slot, values).view(batch, max_len, *values.shape[1:])

    return slot, padded


def time_bucket_grid(
    offsets: Tensor, max_len: int, timestamps: Tensor, query_times: Tensor, num_buckets: int,
    out: Tensor | None = None,
) -> Tensor:
    """``[B, max_len, max_len]`` int32: entry ``[b, i, j]`` is ``bucket(τ_i − t_j)`` of row b
    (:func:`time_buckets`); entries with i or j past the row's end are junk that only masked
    pairs read. The same for every layer of a batch: compute it once and pass it as ``buckets``.
    ``out``: a contiguous int32 tensor of that shape to write it into (a reused buffer)."""
    _, padded = _padder(offsets, timestamps.numel(), max_len)
    queries, keys = padded(query_times).unsqueeze(2), padded(timestamps).unsqueeze(1)
    shape = (queries.shape[0], max_len, max_len)
    grid = torch.empty(shape, dtype=torch.int32, device=timestamps.device) if out is None else out
    if grid.shape != shape or grid.dtype != torch.int32:
        raise ValueError(f"out must be int32 {shape}, got {grid.dtype} {tuple(grid.shape)}")
    # A few rows at a time: the whole batch's int64 differences and their float32 copy would be
    # 12 bytes a pair (470 MB for 512 histories of 200), allocated and freed at every batch, which
    # glibc's default settings return to the kernel each time (issue 22).
    rows = max(1, _GRID_BLOCK_PAIRS // max(1, max_len * max_len))
    for start in range(0, grid.shape[0], rows):
        end = start + rows
        # float -> int32 truncates as .long() does; every bucket is in [0, num_buckets]
        grid[start:end] = time_buckets(queries[start:end] - keys[start:end], num_buckets)
    return grid


class _RelativeBias(torch.autograd.Function):
    """``pos_weights[rel] + time_weights[buckets]`` ``[B, L, L]``, with the weights' gradients
    taken by ``bincount`` (one pass) instead of the indexing's accumulating scatter into 129 and
    2N − 1 slots, which in a CPU profile took about as long as the attention's matmuls."""

    @staticmethod
    def forward(ctx, pos_weights: Tensor, time_weights: Tensor, rel: Tensor, buckets: Tensor) -> Tensor:
        ctx.save_for_backward(rel, buckets)
        ctx.sizes = pos_weights.numel(), time_weights.numel()
        return pos_weights[rel].unsqueeze(0) + time_weights[buckets]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        rel, buckets = ctx.saved_tensors
        n_pos, n_time = ctx.sizes
        grad_pos = grad_time = None
        if ctx.needs_input_grad[0]:
            grad_pos = torch.bincount(rel.reshape(-1), weights=grad.sum(0).reshape(-1), minlength=n_pos)
        if ctx.needs_input_grad[1]:
            grad_time = torch.bincount(buckets.reshape(-1), weights=grad.reshape(-1), minlength=n_time)
        return grad_pos, grad_time, None, None


class _Unpad(torch.autograd.Function):
    """``grid.index_select(0, slot)``: the valid rows of a padded grid. The slots are distinct, so
    the gradient is a copy into zeros, not index_select's scatter-add (in a CPU profile the
    largest single step of the attention's backward)."""

    @staticmethod
    def forward(ctx, grid: Tensor, slot: Tensor) -> Tensor:
        ctx.save_for_backward(slot)
        ctx.rows = grid.shape[0]
        return grid.index_select(0, slot)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (slot,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy_(0, slot, grad), None


def hstu_attention_reference(
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
    buckets: Tensor | None = None,
) -> Tensor:
    """The PyTorch reference of :func:`hstu_attention` (validated inputs; ``buckets``, when
    given, is :func:`time_bucket_grid` of these times).

    Pads q, k, v to ``[B, max_len, H, ·]`` with max_len the *batch's* longest row, not the global
    ``width`` the reference pads to: padding is exact here because every row is left-aligned, so
    causality alone keeps a valid query off the padded keys (the fixed divisor ``width`` is what
    the reference's padding contributes to the result, and it is kept). Memory
    ``B · H · max_len²`` for the scores (several such tensors are kept for backward); padded
    query rows are computed and dropped, and get zero gradient.
    """
    total, heads, _ = q.shape
    batch = offsets.numel() - 1
    slot, padded = _padder(offsets, total, max_len)
    scores = torch.einsum("bihd,bjhd->bhij", padded(q), padded(k))  # [B, H, L, L]
    steps = torch.arange(max_len, device=q.device)
    rel = width - 1 + steps.unsqueeze(0) - steps.unsqueeze(1)  # [i, j]: index of distance j − i
    if buckets is None:  # padded slots get time 0: junk buckets, but only masked pairs read them
        buckets = time_bucket_grid(offsets, max_len, timestamps, query_times, time_weights.numel() - 1)
    bias = _RelativeBias.apply(pos_weights, time_weights, rel, buckets)  # [B, L, L]
    causal = torch.ones(max_len, max_len, dtype=scores.dtype, device=q.device).tril()
    weights = F.silu(scores + bias.unsqueeze(1).to(scores.dtype)) / width * causal
    out = torch.einsum("bhij,bjhd->bihd", weights, padded(v))  # [B, L, H, dv]
    return _Unpad.apply(out.reshape(batch * max_len, heads, v.shape[2]), slot)


def _blocks(batch: int, heads: int, max_len: int):
    """The block schedule of the blocked paths: ``(i0, i1, b0, b1)``, query positions
    ``i0:i1`` (``_QUERY_ROWS`` at a time) of batch rows ``b0:b1`` (as many as keep the block's
    ``heads · (i1 − i0) · i1`` scores near ``_BLOCK_SCORES``)."""
    for i0 in range(0, max_len, _QUERY_ROWS):
        i1 = min(max_len, i0 + _QUERY_ROWS)
        per_block = max(1, _BLOCK_SCORES // (heads * (i1 - i0) * i1))
        for b0 in range(0, batch, per_block):
            yield i0, i1, b0, min(batch, b0 + per_block)


class _Block:
    """One query block's pre-activations ``s = q·kᵀ + bias`` against the keys it can see
    (``j < i1``), and the mask of the pairs past the diagonal, which lie only in the block's
    own columns ``i0:i1``."""

    def __init__(self, qp: Tensor, kp: Tensor, pos_weights: Tensor, time_weights: Tensor,
                 buckets: Tensor, width: int):
        self.qp, self.kp, self.pos_weights, self.time_weights = qp, kp, pos_weights, time_weights
        self.buckets, self.width = buckets, width
        self._rows = -1

    def rows(self, i0: int, i1: int) -> None:
        """Cache what depends on the query rows only: the position bias and the mask."""
        if self._rows == i0:
            return
        steps = torch.arange(i1, device=self.qp.device)
        self.rel = self.width - 1 + steps.unsqueeze(0) - steps[i0:i1].unsqueeze(1)  # [n, i1]
        self.pos_block = self.pos_weights[self.rel]
        self.above = torch.ones(i1 - i0, i1 - i0, dtype=torch.bool, device=self.qp.device).triu_(1)
        self._rows = i0

    def scores(self, i0: int, i1: int, b0: int, b1: int) -> Tensor:
        """``[b, H, n, i1]`` pre-activations of batch rows b0:b1, query rows i0:i1."""
        self.rows(i0, i1)
        s = torch.matmul(self.qp[b0:b1, :, i0:i1], self.kp[b0:b1, :, :i1].transpose(2, 3))
        # summed in the weights' dtype, then cast, as the reference does. index_select over the
        # flattened block, not time_weights[grid]: the same gather, 3x faster on CPU (advanced
        # indexing's general path was 12 % of an HSTU-large training step)
        grid = self.buckets[b0:b1, i0:i1, :i1]
        bias = self.time_weights.index_select(0, grid.reshape(-1)).view(grid.shape).add_(self.pos_block)
        return s.add_(bias.to(s.dtype).unsqueeze(1))

    def mask_(self, t: Tensor, i0: int) -> Tensor:
        t[..., i0:].masked_fill_(self.above, 0.0)
        return t


def _padded_heads(padded, *tensors: Tensor) -> list[Tensor]:
    """Jagged ``[T, H, d]`` -> padded ``[B, H, L, d]``, contiguous."""
    return [padded(t).transpose(1, 2).contiguous() for t in tensors]


def _jagged(grid: Tensor, slot: Tensor) -> Tensor:
    """Padded ``[B, H, L, d]`` -> jagged ``[T, H, d]``."""
    batch, heads, max_len, d = grid.shape
    return grid.transpose(1, 2).reshape(batch * max_len, heads, d).index_select(0, slot)


def _blocked_forward(block: _Block, vp: Tensor, width: int, kept: list[Tensor] | None = None) -> Tensor:
    """The blocked attention's padded output ``[B, H, L, dv]``; with ``kept`` a list, each
    block's pre-activations are appended to it in :func:`_blocks` order (for the backward)."""
    batch, heads, max_len, dv = vp.shape
    out = vp.new_empty((batch, heads, max_len, dv))
    for i0, i1, b0, b1 in _blocks(batch, heads, max_len):
        a = block.scores(i0, i1, b0, b1)
        if kept is None:
            w = F.silu(a, inplace=True).div_(width)
        else:
            kept.append(a)
            w = F.silu(a).div_(width)
        out[b0:b1, :, i0:i1] = torch.matmul(block.mask_(w, i0), vp[b0:b1, :, :i1])
    return out


def _scores_bytes(batch: int, heads: int, max_len: int, itemsize: int) -> int:
    """Bytes of every block's pre-activations together (each block sees keys ``j < i1``)."""
    return sum((b1 - b0) * heads * (i1 - i0) * i1 for i0, i1, b0, b1 in _blocks(batch, heads, max_len)) * itemsize


@torch.no_grad()
def hstu_attention_inference(
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
    buckets: Tensor | None = None,
) -> Tensor:
    """:func:`hstu_attention_reference` without autograd, by blocks: the fast twin for evaluation.

    The padded batch is cut into blocks of ``_QUERY_ROWS`` query positions and as many rows of
    the batch as keep a block's scores near ``_BLOCK_SCORES``; a block computes its scores only
    against the keys it can see (``j < i1``, about half the reference's ``L²``), adds the bias,
    SiLU, divides by ``width`` and masks in place, and multiplies by V. Memory: the padded
    inputs plus one block, not ``B·H·L²``. Same sums as the reference; the order of the float
    operations within a dot product may differ (round-off, not a result).
    """
    total, heads, _ = q.shape
    dv = v.shape[2]
    if total == 0 or max_len == 0:
        return v.new_zeros((total, heads, dv))
    slot, padded = _padder(offsets, total, max_len)
    if buckets is None:
        buckets = time_bucket_grid(offsets, max_len, timestamps, query_times, time_weights.numel() - 1)
    qp, kp, vp = _padded_heads(padded, q, k, v)
    block = _Block(qp, kp, pos_weights, time_weights, buckets, width)
    return _jagged(_blocked_forward(block, vp, width), slot)


class _BlockedAttention(torch.autograd.Function):
    """The blocked attention with its own backward. It keeps each block's pre-activations
    (about ``B·H·L²/2``) while they fit :data:`KEEP_SCORES_BYTES`, and past that recomputes
    them in the backward: memory ``O(B·H·L·d)`` plus one block, where the reference keeps
    several ``B·H·L²`` tensors for its backward. Per block, with ``a`` the pre-activation,
    ``w = SiLU(a) / width`` masked and ``g`` the output's gradient: ``dV += wᵀg``,
    ``da = (g·Vᵀ) · SiLU'(a) / width`` masked, ``dQ = da·K``, ``dK += daᵀQ``, and the bias
    gradient ``Σ_heads da`` binned by position distance and by time bucket."""

    @staticmethod
    def forward(ctx, q, k, v, pos_weights, time_weights, offsets, max_len, buckets, width):
        slot, padded = _padder(offsets, q.shape[0], max_len)
        qp, kp, vp = _padded_heads(padded, q, k, v)
        batch, heads = qp.shape[:2]
        keep = _scores_bytes(batch, heads, max_len, qp.element_size()) <= KEEP_SCORES_BYTES
        # the pre-activations, where they fit: the backward then skips recomputing q·kᵀ and the
        # bias (with the gather in _Block.scores, one HSTU-large layer's forward and backward went
        # from 83-90 to 68 ms on 2 CPU threads); else it recomputes them
        ctx.kept = [] if keep else None
        out = _blocked_forward(_Block(qp, kp, pos_weights, time_weights, buckets, width), vp, width, ctx.kept)
        ctx.save_for_backward(qp, kp, vp, pos_weights, time_weights, buckets, slot)
        ctx.width = width
        return _jagged(out, slot)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        qp, kp, vp, pos_weights, time_weights, buckets, slot = ctx.saved_tensors
        width = ctx.width
        batch, heads, max_len, _ = qp.shape
        dv = vp.shape[3]
        g = grad.new_zeros((batch * max_len, heads, dv)).index_copy_(0, slot, grad.to(vp.dtype))
        g = g.view(batch, max_len, heads, dv).transpose(1, 2).contiguous()  # [B, H, L, dv]
        dq, dk, dvp = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
        # the bias gradients are sums of many terms: accumulated in float64, cast at the end
        d_pos = torch.zeros(pos_weights.numel(), dtype=torch.float64, device=qp.device)
        d_time = torch.zeros(time_weights.numel(), dtype=torch.float64, device=qp.device)
        block = _Block(qp, kp, pos_weights, time_weights, buckets, width)
        # taken, not read: the loop overwrites them in place, so a second backward through a
        # retained graph must recompute them
        kept, ctx.kept = ctx.kept, None
        for index, (i0, i1, b0, b1) in enumerate(_blocks(batch, heads, max_len)):
            if kept is None:
                a = block.scores(i0, i1, b0, b1)  # [b, H, n, i1]
            else:
                block.rows(i0, i1)
                a, kept[index] = kept[index], None
            sig = torch.sigmoid(a)
            g_blk = g[b0:b1, :, i0:i1]
            w = block.mask_(a * sig / width, i0)
            dvp[b0:b1, :, :i1] += torch.matmul(w.transpose(2, 3), g_blk)
            # SiLU'(a) = σ(a)·(1 + a·(1 − σ(a))), in place over a's storage
            d_act = a.mul_(1 - sig).add_(1).mul_(sig).div_(width)
            da = block.mask_(torch.matmul(g_blk, vp[b0:b1, :, :i1].transpose(2, 3)).mul_(d_act), i0)
            dq[b0:b1, :, i0:i1] = torch.matmul(da, kp[b0:b1, :, :i1])
            dk[b0:b1, :, :i1] += torch.matmul(da.transpose(2, 3), qp[b0:b1, :, i0:i1])
            if not (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
                continue
            d_bias = da.sum(1)  # [b, n, i1]
            if ctx.needs_input_grad[3]:
                d_pos += torch.bincount(block.rel.reshape(-1), weights=d_bias.sum(0).reshape(-1).double(),
                                        minlength=d_pos.numel())
            if ctx.needs_input_grad[4]:
                d_time += torch.bincount(buckets[b0:b1, i0:i1, :i1].reshape(-1),
                                         weights=d_bias.reshape(-1).double(), minlength=d_time.numel())
        return (
            _jagged(dq, slot) if ctx.needs_input_grad[0] else None,
            _jagged(dk, slot) if ctx.needs_input_grad[1] else None,
            _jagged(dvp, slot) if ctx.needs_input_grad[2] else None,
            d_pos.to(pos_weights.dtype) if ctx.needs_input_grad[3] else None,
            d_time.to(time_weights.dtype) if ctx.needs_input_grad[4] else None,
            None, None, None, None,
        )


def hstu_attention_blocked(
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
    buckets: Tensor | None = None,
) -> Tensor:
    """:func:`hstu_attention_reference` by query blocks, differentiable in q, k, v and both
    weights (``_BlockedAttention``): the CPU training path, never a ``B·H·L²`` tensor (the
    blocks' pre-activations, about half of one, are kept for the backward up to
    :data:`KEEP_SCORES_BYTES`)."""
    if q.shape[0] == 0 or max_len == 0:  # nothing to attend: the reference's empty graph
        return hstu_attention_reference(q, k, v, offsets, max_len, pos_weights, time_weights,
                                        timestamps, query_times, width, buckets)
    if buckets is None:
        buckets = time_bucket_grid(offsets, max_len, timestamps, query_times, time_weights.numel() - 1)
    return _BlockedAttention.apply(q, k, v, pos_weights, time_weights, offsets, max_len, buckets, width)


@torch.no_grad()
def hstu_attention_last(
    q_last: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    max_len: int,
    pos_weights: Tensor,
    time_weights: Tensor,
    timestamps: Tensor,
    query_time: Tensor,
    width: int,
    buckets: Tensor | None = None,
) -> Tensor:
    """Each row's *last* query only: row b's output at its position ``L_b − 1`` ``[B, H, dv]``.

    ``q_last [B, H, dqk]`` is that position's query, ``k [T, H, dqk]`` and ``v [T, H, dv]`` the
    row's keys and values as in :func:`hstu_attention`, ``query_time [B]`` the last position's
    query time (the target's); ``buckets`` as :func:`time_bucket_grid` of the batch, if at hand.
    Every row needs at least one element. No autograd (evaluation); what the full op gives at
    the last positions, for ``L`` times less attention.
    """
    total, heads, _ = k.shape
    dv = v.shape[2]
    batch = offsets.numel() - 1
    if batch == 0:
        return v.new_zeros((0, heads, dv))
    lengths = offsets[1:] - offsets[:-1]
    if bool((lengths < 1).any()):
        raise ValueError("hstu_attention_last needs every row to have at least one element")
    _, padded = _padder(offsets, total, max_len)
    kp, vp = (padded(t).transpose(1, 2) for t in (k, v))  # [B, H, L, d]
    last = lengths - 1  # [B]
    steps = torch.arange(max_len, device=k.device)
    if buckets is None:
        delta = query_time.unsqueeze(1) - padded(timestamps)  # [B, L]
        row_buckets = time_buckets(delta, time_weights.numel() - 1)
    else:
        row_buckets = buckets[torch.arange(batch, device=k.device), last].long()  # [B, L]
    # j − last ranges over [−last, max_len − 1 − last]: inside the table's 2·width − 1 entries
    rel = width - 1 + steps.unsqueeze(0) - last.unsqueeze(1)  # [B, L]
    bias = pos_weights[rel] + time_weights[row_buckets]
    scores = torch.matmul(kp, q_last.unsqueeze(3)).squeeze(3)  # [B, H, L]
    scores.add_(bias.to(scores.dtype).unsqueeze(1))
    F.silu(scores, inplace=True)
    scores.div_(width)
    scores.masked_fill_((steps.unsqueeze(0) > last.unsqueeze(1)).unsqueeze(1), 0.0)
    return torch.matmul(scores.unsqueeze(2), vp).squeeze(2)  # [B, H, dv]


def _validate(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_len: int, pos_weights: Tensor,
    time_weights: Tensor, timestamps: Tensor, query_times: Tensor, width: int,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("pos_weights", pos_weights),
                    ("time_weights", time_weights)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, H, d], got shape {tuple(t.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [T, H, dqk], got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [T, H, dv] with T, H = {tuple(q.shape[:2])}, got {tuple(v.shape)}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 0 <= max_len <= width:
        raise ValueError(f"max_len must be an int in [0, width={width}], got {max_len!r}")
    if pos_weights.shape != (2 * width - 1,):
        raise ValueError(f"pos_weights must be 1-D [2·width − 1] = [{2 * width - 1}], "
                         f"got shape {tuple(pos_weights.shape)}")
    if time_weights.dim() != 1 or time_weights.numel() < 1:
        raise ValueError(f"time_weights must be 1-D [num_buckets + 1], got shape {tuple(time_weights.shape)}")
    total = q.shape[0]
    for name, t in (("offsets", offsets), ("timestamps", timestamps), ("query_times", query_times)):
        if not isinstance(t, Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    for name, t in (("timestamps", timestamps), ("query_times", query_times)):
        if t.numel() != total:
            raise ValueError(f"{name} must be [T] with T={total} (one per element), got {tuple(t.shape)}")
    devices = {t.device for t in (q, k, v, offsets, pos_weights, time_weights, timestamps, query_times)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if offsets.numel() < 1:
        raise ValueError("offsets must be [B+1] (at least one element, 0)")
    # one host sync: a bad offset would make rows overlap or read past the values
    first, last = int(offsets[0]), int(offsets[-1])
    lengths = offsets[1:] - offsets[:-1]
    if first != 0 or last != total or bool((lengths < 0).any()):
        raise ValueError(f"offsets must rise from 0 to T={total}, got {first} .. {last}"
                         + (" with a decrease" if bool((lengths < 0).any()) else ""))
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_len:
        raise ValueError(f"a row has {longest} elements but max_len={max_len}: pass the longest row's length")


def hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    *,
    max_len: int,
    pos_weights: Tensor,
    time_weights: Tensor,
    timestamps: Tensor,
    query_times: Tensor,
    width: int,
    kernel: KernelImpl = "pytorch",
    buckets: Tensor | None = None,
) -> Tensor:
    """Jagged causal HSTU attention with relative position and time biases (module docstring).

    Args:
        q, k: ``[T, H, dqk]`` and v: ``[T, H, dv]``, SiLU already applied; one dtype.
        offsets: ``[B+1]`` integer, from 0 to T; rows may be empty.
        max_len: the longest row's length (``≤ width``); the PyTorch path pads to it.
        pos_weights: ``[2·width − 1]``; entry ``width − 1 + j − i`` biases query i, key j.
        time_weights: ``[NB + 1]``; entry ``bucket(τ_i − t_j)`` biases query i, key j.
        timestamps: ``[T]`` integer, each element's time (seconds).
        query_times: ``[T]`` integer, the time each element's query is asked at.
        width: the fixed divisor of the SiLU scores and the position weights' half-size.
        kernel: ``"pytorch"`` or ``"triton"``; ``"triton"`` falls back to ``"pytorch"`` (one
            warning per process) when Triton cannot take these tensors.
        buckets: :func:`time_bucket_grid` of these offsets and times, when the caller has it
            (a model computes it once for all its layers); the PyTorch paths read it, the
            Triton kernel buckets in registers and ignores it.

    Returns:
        ``[T, H, dv]`` in v's dtype, differentiable in q, k, v, pos_weights and time_weights (the
        buckets are integers: no gradient reaches the times).
    """
    _validate(q, k, v, offsets, max_len, pos_weights, time_weights, timestamps, query_times, width)
    return TRITON.dispatch(
        "hstu_attention", kernel, (q, k, v, pos_weights, time_weights),
        triton=lambda module: module.hstu_attention_triton(
            q.contiguous(), k.contiguous(), v.contiguous(), offsets, max_len,
            pos_weights, time_weights, timestamps, query_times, width,
        ),
        reference=lambda: (hstu_attention_blocked if _wants_grad(q, k, v, pos_weights, time_weights)
                           else hstu_attention_inference)(
            q, k, v, offsets, max_len, pos_weights, time_weights, timestamps, query_times, width,
            buckets,
        ),
    )


def _wants_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

"""HSTU (Zhai et al., ICML'24) with the semantics of the research code behind the published tables.

After ``generative_recommenders/research/modeling/sequential/hstu.py`` with its ml-1m / ml-20m /
Books ``hstu-sampled-softmax-*-final.gin`` configs (spec §1.2-1.4), on jagged histories:

* input: ``item_emb · sqrt(D) + pos_emb[p]`` (p counted from the oldest item), dropout;
* per layer (``SequentialTransductionUnitJagged``): ``x̂ = LN(x)``; ``[U, V, Q, K] =
  SiLU(x̂ · W_uvqk)`` (one bias-free projection, SiLU on all four);
  ``A = hstu_attention(Q, K, V)`` (causal, SiLU(q·k + rab)/N, rab = position + log-bucketed time
  bias, per layer); ``x = x + Linear(dropout(U ⊙ LN(A)))``; both LNs without affine
  parameters, eps 1e-6;
* no final LayerNorm; outputs L2-normalised (norm clamped at ``l2_norm_eps``).

N, the *width*, is ``max_sequence_length + extra_positions`` (200 + 11 = 211 for MovieLens, 50 + 11
for Books): the reference's padded width, which sizes the position table and the position bias
and divides every attention score, whatever a history's length.

Plain nn.Module, no Lightning. Histories come jagged (flat ids plus offsets) with their items'
timestamps and, per position, the time of the event it predicts
(:class:`recforge.contracts.TimedSequenceModel`).
"""
from __future__ import annotations

import math
from typing import Annotated

import torch
from torch import nn
from torch.nn import functional as F

from recforge.config_values import Range
from recforge.contracts import TimedSequenceModel
from recforge.kernels.hstu_attention import hstu_attention, hstu_attention_last, time_bucket_grid
from recforge.kernels.hstu_output import hstu_output
from recforge.kernels.twin import KernelChoice, KernelImpl, kernel_of
from recforge.models.item_sequence import ItemSequenceEncoder
from recforge.utils.reused_buffer import ReusedBuffer

# The reference's epsilon for both LayerNorms of a layer (SequentialTransductionUnitJagged's).
_LN_EPS = 1e-6


class HSTULayer(nn.Module):
    """One HSTU layer (``SequentialTransductionUnitJagged`` with ``linear_config="uvqk"``,
    ``normalization="rel_bias"``, ``concat_ua=False``), on jagged rows ``[ΣL, D]`` throughout.

    Parameters: ``uvqk [D, 2·h·dv + 2·h·dqk]`` (x̂ @ uvqk; columns U, V, Q, K; no bias),
    ``o`` Linear h·dv -> D with bias, ``pos_weights [2·width − 1]``, ``time_weights
    [num_time_buckets + 1]`` (the relative bias, shared by the heads).
    """

    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        dqk: int,
        dv: int,
        width: int,
        num_time_buckets: int,
        linear_dropout_rate: float,
        attention_kernel: KernelImpl = "pytorch",
        output_kernel: KernelImpl = "pytorch",
    ) -> None:
        super().__init__()
        self.embedding_dim, self.num_heads, self.dqk, self.dv = embedding_dim, num_heads, dqk, dv
        self.width = width
        self.linear_dropout_rate = linear_dropout_rate
        self.attention_kernel, self.output_kernel = attention_kernel, output_kernel
        self.uvqk = nn.Parameter(torch.empty(embedding_dim, 2 * num_heads * (dv + dqk)))
        self.o = nn.Linear(num_heads * dv, embedding_dim)
        self.pos_weights = nn.Parameter(torch.empty(2 * width - 1))
        self.time_weights = nn.Parameter(torch.empty(num_time_buckets + 1))
        # where the projection goes when no backward needs it (HSTU gives its layers one)
        self.scratch = ReusedBuffer()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference's init: ``uvqk``, ``pos_weights`` and ``time_weights`` N(0, 0.02);
        ``o.weight`` xavier-uniform, ``o.bias`` Linear's default U(±1/sqrt(h·dv)). (HSTU's
        xavier re-init skips everything under ``_hstu``, so these stand.)"""
        for param in (self.uvqk, self.pos_weights, self.time_weights):
            nn.init.normal_(param, mean=0.0, std=0.02)
        nn.init.xavier_uniform_(self.o.weight)
        bound = 1.0 / math.sqrt(self.o.in_features)
        nn.init.uniform_(self.o.bias, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        timestamps: torch.Tensor,
        query_times: torch.Tensor,
        buckets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x ``[ΣL, D]``, offsets ``[B+1]``, timestamps and query_times ``[ΣL]`` -> ``[ΣL, D]``;
        ``buckets``: the batch's :func:`time_bucket_grid`, shared by the layers, if at hand."""
        total = x.shape[0]
        h, dqk, dv = self.num_heads, self.dqk, self.dv
        normed = F.layer_norm(x, (self.embedding_dim,), eps=_LN_EPS)
        if torch.is_grad_enabled() or normed.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
            projected = F.silu(normed @ self.uvqk)
        else:
            # no backward, glibc's malloc (CUDA's allocator caches by itself), no autocast (which
            # picks the product's dtype): the layers' shared scratch, activated in place
            scratch = self.scratch.take((total, self.uvqk.shape[1]), normed.dtype, normed.device)
            projected = F.silu(torch.mm(normed, self.uvqk, out=scratch), inplace=True)
        u, v, q, k = projected.split([h * dv, h * dv, h * dqk, h * dqk], dim=1)
        attn = hstu_attention(
            q.reshape(total, h, dqk), k.reshape(total, h, dqk), v.reshape(total, h, dv), offsets,
            max_len=max_len, pos_weights=self.pos_weights, time_weights=self.time_weights,
            timestamps=timestamps, query_times=query_times, width=self.width,
            kernel=self.attention_kernel, buckets=buckets,
        ).reshape(total, h * dv)
        return self._output(attn, u, x)

    def forward_last(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        timestamps: torch.Tensor,
        query_times: torch.Tensor,
        buckets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward`'s rows at each row's last position only, ``[B, D]``, without autograd
        (the evaluation's last layer): V and K of every position, U and Q of the last ones, and
        one query per row through the attention. Every row needs at least one element."""
        total, batch = x.shape[0], offsets.numel() - 1
        h, dqk, dv = self.num_heads, self.dqk, self.dv
        last = offsets[1:] - 1
        normed = F.layer_norm(x, (self.embedding_dim,), eps=_LN_EPS)
        w_u, w_v, w_q, w_k = self.uvqk.split([h * dv, h * dv, h * dqk, h * dqk], dim=1)
        normed_last = normed.index_select(0, last)
        u, q = F.silu(normed_last @ w_u, inplace=True), F.silu(normed_last @ w_q, inplace=True)
        v, k = F.silu(normed @ w_v, inplace=True), F.silu(normed @ w_k, inplace=True)
        attn = hstu_attention_last(
            q.reshape(batch, h, dqk), k.reshape(total, h, dqk), v.reshape(total, h, dv), offsets,
            max_len, self.pos_weights, self.time_weights, timestamps,
            query_times.index_select(0, last), self.width, buckets,
        ).reshape(batch, h * dv)
        return self._output(attn, u, x.index_select(0, last))

    def _output(self, attn: torch.Tensor, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if attn.dtype != x.dtype:
            # Autocast (trainer.precision=...-mixed) hands over attn and u from its low-precision
            # matmuls; the fused output takes one dtype: the residual stream's, the precision
            # autocast itself keeps for LayerNorm and the residual add
            attn, u = attn.to(x.dtype), u.to(x.dtype)
        return hstu_output(
            attn, u, x, self.o.weight, self.o.bias,
            dropout_p=self.linear_dropout_rate if self.training else 0.0, eps=_LN_EPS,
            kernel=self.output_kernel,
        )


class HSTU(ItemSequenceEncoder):
    """HSTU encoder over jagged, timed histories, with the item table it shares with the loss.

    ``forward(items [ΣL], offsets [B+1], timestamps [ΣL], query_times [ΣL]) -> [ΣL, D]``: row
    ``offsets[b] + p`` is user b's vector after reading its items 0..p (oldest first),
    L2-normalised; it scores the item *after* position p, which happens at ``query_times[p]``
    (the next item's time; the target's at the last position). :meth:`last_positions` takes each
    row's last vector ``[B, D]`` (the evaluation query).

    Item ids are catalogue indices ``[0, n_items)``: the reference's padding row 0 has no
    counterpart (jagged rows need no padding id), so a table built with ``n_items`` equal to the
    reference's row count (max id + 1, e.g. 3,953 for ml-1m) has its parameter count (ml-1m:
    234,400 in all, 36,750 without the table; HSTU-large 313,000 and 115,350).

    Init (reference): item table truncated normal std 0.02 at ±2 std; position table
    xavier-normal (HSTU's re-init of everything outside the layers and the item table overwrites
    its own truncated normal); layers as :meth:`HSTULayer.reset_parameters`.

    ``attention={"kernel": ...}`` / ``output={"kernel": ...}`` (``model.attention.kernel=triton``)
    pick the PyTorch or the Triton implementation of
    :func:`recforge.kernels.hstu_attention.hstu_attention` and
    :func:`recforge.kernels.hstu_output.hstu_output` (same results; Triton falls back to PyTorch
    with one warning where it cannot run). Linear dropout masks come from the output op's own
    hash of a seed drawn from torch's CPU generator, so ``torch.manual_seed`` repeats them.
    """

    implements = (TimedSequenceModel,)
    name = "HSTU"

    def __init__(
        self,
        n_items: int,
        embedding_dim: Annotated[int, Range(ge=1)] = 50,
        num_blocks: Annotated[int, Range(ge=1)] = 2,
        num_heads: Annotated[int, Range(ge=1)] = 1,
        dqk: Annotated[int, Range(ge=1)] = 50,
        dv: Annotated[int, Range(ge=1)] = 50,
        dropout_rate: Annotated[float, Range(ge=0, lt=1)] = 0.2,
        linear_dropout_rate: Annotated[float, Range(ge=0, lt=1)] = 0.2,
        max_sequence_length: Annotated[int, Range(ge=1)] = 200,
        extra_positions: Annotated[int, Range(ge=0)] = 11,
        num_time_buckets: Annotated[int, Range(ge=1)] = 128,
        l2_norm_eps: Annotated[float, Range(gt=0)] = 1e-6,
        attention: KernelChoice | None = None,
        output: KernelChoice | None = None,
    ) -> None:
        attention_kernel = kernel_of("model.attention", attention)
        output_kernel = kernel_of("model.output", output)
        width = int(max_sequence_length) + int(extra_positions)
        super().__init__(n_items, embedding_dim, width, max_sequence_length, dropout_rate, l2_norm_eps)
        self.width = width
        self.layers = nn.ModuleList(
            HSTULayer(self.embedding_dim, int(num_heads), int(dqk), int(dv), width,
                      int(num_time_buckets), float(linear_dropout_rate), attention_kernel,
                      output_kernel)
            for _ in range(int(num_blocks))
        )
        # Without autograd (evaluation) a batch's time-bucket grid and each layer's projection
        # (70-80 MB apiece for 512 ml-1m histories) are written into storage kept from the last
        # batch: the layers run one after the other, so they share one. Released on train().
        self.scratch, self.grid_scratch = ReusedBuffer(), ReusedBuffer()
        for layer in self.layers:
            layer.scratch = self.scratch
        self.reset_parameters()

    def train(self, mode: bool = True) -> HSTU:
        if mode:
            self.scratch.release()
            self.grid_scratch.release()
        return super().train(mode)

    def reset_parameters(self) -> None:
        """Re-draw every parameter as the reference does (see the class docstring; the truncated
        normal is the exact one, as in :meth:`recforge.models.sasrec.SASRec.reset_parameters`)."""
        std = 0.02
        nn.init.trunc_normal_(self.item_emb.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.xavier_normal_(self.pos_emb.weight)
        for layer in self.layers:
            layer.reset_parameters()

    def forward(
        self,
        items: torch.Tensor,
        offsets: torch.Tensor,
        timestamps: torch.Tensor | None = None,
        query_times: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """items ``[ΣL]`` int64 in [0, n_items), offsets ``[B+1]`` int64, timestamps and
        query_times ``[ΣL]`` int64 (seconds) -> ``[ΣL, D]`` unit rows.

        Rows may be empty (a batch of only empty rows gives ``[0, D]``). Refused, in one line
        naming the field: missing times, times out of order within a history or a query time
        before its position's item (either would put a pair in a wrong time bucket without
        notice, the bucket being of |Δ|), and histories longer than the width (the data module
        truncates to the most recent ``max_sequence_length`` items).
        """
        x, max_len, buckets = self._inputs(items, offsets, timestamps, query_times)
        for layer in self.layers:
            x = layer(x, offsets, max_len, timestamps, query_times, buckets)
        return self.output(x)

    def _inputs(
        self, items: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None,
        query_times: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """Checked inputs -> (the first layer's input, the longest row, the time-bucket grid
        every layer reads; None where the Triton kernel buckets in registers instead)."""
        total = items.numel()
        batch_size = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        max_len = int(lengths.max()) if batch_size > 0 and total > 0 else 0
        if max_len > self.width:
            raise ValueError(
                f"a history has {max_len} items but HSTU's width is {self.width} "
                f"(max_sequence_length={self.max_sequence_length} plus extra_positions): truncate "
                "histories to their most recent max_sequence_length items"
            )
        _check_times(timestamps, query_times, offsets, total)
        x, max_len, _, _ = self.embed_inputs(items, offsets)
        first = self.layers[0]
        on_triton = first.attention_kernel == "triton" and items.is_cuda
        buckets = None if on_triton or total == 0 else time_bucket_grid(
            offsets, max_len, timestamps, query_times, first.time_weights.numel() - 1,
            out=self.grid_scratch.take((batch_size, max_len, max_len), torch.int32, items.device))
        return x, max_len, buckets

    def encode_last(
        self, items: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
        query_times: torch.Tensor,
    ) -> torch.Tensor:
        """The arguments of :meth:`forward` -> each row's query ``[B, D]`` (unit rows): what
        :meth:`forward` gives at the last positions. Without autograd (evaluation) the last
        layer computes only those rows (:meth:`HSTULayer.forward_last`); every row needs at
        least one item."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            return self.last_positions(self(items, offsets, timestamps, query_times), offsets)
        if offsets.numel() > 1 and bool((offsets[1:] <= offsets[:-1]).any()):
            raise ValueError("encode_last needs every history to have at least one item")
        x, max_len, buckets = self._inputs(items, offsets, timestamps, query_times)
        for layer in self.layers[:-1]:
            x = layer(x, offsets, max_len, timestamps, query_times, buckets)
        return self.output(self.layers[-1].forward_last(x, offsets, max_len, timestamps,
                                                        query_times, buckets))


def _check_times(
    timestamps: torch.Tensor | None, query_times: torch.Tensor | None, offsets: torch.Tensor,
    total: int,
) -> None:
    """Refuse times the time bias would bucket wrongly without a sign (see HSTU.forward)."""
    for name, t in (("timestamps", timestamps), ("query_times", query_times)):
        if t is None:
            raise ValueError(
                f"HSTU needs {name} (its attention is biased by time): pass the batch's item "
                "timestamps and each position's query time (the next item's, the target's last)"
            )
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool \
                or t.shape != (total,):
            raise ValueError(f"{name} must be an integer tensor [ΣL] = [{total}] (Unix seconds), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if total == 0:
        return
    row_start = torch.zeros(total, dtype=torch.bool, device=timestamps.device)
    row_start[offsets[:-1][offsets[:-1] < total]] = True
    backwards = (timestamps[1:] < timestamps[:-1]) & ~row_start[1:]
    if bool(backwards.any()):
        at = int(backwards.nonzero()[0, 0]) + 1
        row = int(torch.searchsorted(offsets, torch.tensor(at, device=offsets.device), right=True)) - 1
        p = at - int(offsets[row])
        raise ValueError(
            f"timestamps must be non-decreasing within each history: row {row} has "
            f"{int(timestamps[at])} at position {p} after {int(timestamps[at - 1])} at position "
            f"{p - 1} (sort each user's events by time)"
        )
    early = query_times < timestamps
    if bool(early.any()):
        at = int(early.nonzero()[0, 0])
        row = int(torch.searchsorted(offsets, torch.tensor(at, device=offsets.device), right=True)) - 1
        raise ValueError(
            f"query_times must not precede their position's timestamp: row {row}, position "
            f"{at - int(offsets[row])} asks at {int(query_times[at])} about an item of "
            f"{int(timestamps[at])} (a target_timestamps value before its history's last item?)"
        )

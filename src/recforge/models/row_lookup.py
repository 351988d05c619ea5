"""Two row lookups from one item table that reach it as one sparse gradient.

GRU4Rec's shared embedding reads the output matrix ``Wy`` twice per training step: the input items'
rows and the scored columns' rows. The reference does it as one ``Embedding`` call on the
concatenated indices, then slices; its gradient is one sparse tensor whose rows are the
concatenated indices in that order, and the optimizer sums duplicate rows in that order (which the
exact-trajectory test depends on, down to the last bit).

Slicing the lookup costs, in backward, a zero-filled copy of the whole ``[B + C, d]`` block per
slice plus their sum (a sixth of a CPU training step at B=32, C=2080). :func:`shared_row_lookup`
gathers the two sets directly and builds the same sparse gradient from the two incoming gradients.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor


class _SharedRowLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(first, second)
        ctx.weight_shape = weight.shape
        return weight.index_select(0, first), weight.index_select(0, second)

    @staticmethod
    def backward(ctx, grad_first: Tensor | None, grad_second: Tensor | None):
        first, second = ctx.saved_tensors
        d = ctx.weight_shape[1]
        if grad_first is None:
            grad_first = grad_second.new_zeros((len(first), d))
        if grad_second is None:
            grad_second = grad_first.new_zeros((len(second), d))
        indices = torch.cat([first, second]).unsqueeze(0)
        values = torch.cat([grad_first, grad_second])
        grad = torch.sparse_coo_tensor(indices, values, ctx.weight_shape, check_invariants=False)
        return grad, None, None


def shared_row_lookup(weight: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    """``(weight[first], weight[second])``, with the sparse gradient of ``weight[cat(first, second)]``.

    Args:
        weight: ``[n, d]`` table (a leaf parameter trained with sparse gradients).
        first: ``[B]`` row indices; second: ``[C]`` row indices (repeats allowed in and across both).

    Returns:
        ``[B, d]`` and ``[C, d]`` rows. Backward gives ``weight`` an uncoalesced sparse COO gradient
        with indices ``cat(first, second)`` and values ``cat(grad_first, grad_second)``: exactly what
        ``nn.Embedding(sparse=True)`` gives for one lookup of the concatenated indices.
    """
    return _SharedRowLookup.apply(weight, first, second)


class _UniqueRowLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, rows: Tensor, keep: Tensor | None) -> Tensor:
        ctx.save_for_backward(rows, keep)
        ctx.weight = weakref.ref(weight)
        ctx.weight_shape = weight.shape
        return weight.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        rows, keep = ctx.saved_tensors
        if keep is not None:
            rows, grad_rows = rows[keep], grad_rows[keep]
        return distinct_rows_gradient(ctx.weight(), rows, grad_rows, ctx.weight_shape), None, None


def distinct_rows_gradient(weight: Tensor | None, rows: Tensor, values: Tensor, shape: torch.Size) -> Tensor:
    """The sparse COO gradient ``values [R, ...]`` at ``rows [R]`` (distinct, sorted) of a
    ``shape`` table, flagged coalesced. ``weight``: the table, if alive: its gradient keeps the
    flag after accumulation (see :func:`watch_distinct_rows`)."""
    indices = rows.unsqueeze(0)
    grad = torch.sparse_coo_tensor(indices, values, shape, check_invariants=False, is_coalesced=True)
    if weight is not None:
        # Autograd stores a parameter's first gradient as a new sparse tensor over the same
        # indices and values, without the coalesced flag; _mark_distinct puts it back.
        weight._distinct_grad_indices = (indices.data_ptr(), indices.shape[1])
    return grad


def watch_distinct_rows(weight: Tensor) -> None:
    """Have ``weight``'s accumulated gradient flagged coalesced when it is exactly one
    :func:`distinct_rows_gradient` (once per parameter; a no-op after the first call)."""
    if weight.requires_grad and not getattr(weight, "_distinct_grad_hooked", False):
        weight.register_post_accumulate_grad_hook(_mark_distinct)
        weight._distinct_grad_hooked = True


def _mark_distinct(weight: Tensor) -> None:
    """After accumulation: flag the gradient coalesced if it is exactly one distinct-row lookup's.

    A gradient summed with another (accumulation over steps, a second lookup) has other indices
    and stays unflagged, so the optimizer still coalesces it.
    """
    # (data pointer, length) of the distinct-row indices the last lookup's gradient was built on
    built = getattr(weight, "_distinct_grad_indices", None)
    weight._distinct_grad_indices = None
    grad = weight.grad
    if built is None or grad is None or not grad.is_sparse or grad.is_coalesced():
        return
    indices = grad._indices()
    if (indices.data_ptr(), indices.shape[1]) == built:
        grad._coalesced_(True)


def unique_row_lookup(weight: Tensor, rows: Tensor, keep: Tensor | None = None) -> Tensor:
    """``weight[rows]`` for sorted, distinct ``rows``, with an already coalesced sparse gradient.

    The fast GRU4Rec step looks every table row up once (duplicates are resolved by the caller
    through the inverse indices), so the gradient's rows are distinct and sorted by construction:
    flagged coalesced, it spares the optimizer the sort and the duplicate sum that
    :func:`shared_row_lookup`'s gradient needs.

    Args:
        weight: ``[n, d]`` table (a leaf parameter trained with sparse gradients).
        rows: ``[U]`` strictly increasing row indices (``torch.unique``'s output).
        keep: ``[U]`` bool, or None for all: the rows the gradient lists. A row left out is not
            touched by a lazy optimizer (no momentum step), as a row the lookup never read; its
            gradient must be zero (the caller's promise: read, but not used).

    Returns:
        ``[U, d]`` rows; backward gives ``weight`` a sparse COO gradient over ``rows[keep]``,
        flagged coalesced when it is the parameter's only gradient.
    """
    watch_distinct_rows(weight)
    return _UniqueRowLookup.apply(weight, rows, keep)

"""Gradient clipping that also handles sparse (row-wise embedding) gradients.

``torch.nn.utils.clip_grad_norm_`` cannot take the norm of a sparse gradient; GRU4Rec's item
tables produce sparse ones. Sparse gradients are coalesced first (duplicate rows summed), so the
norm is that of the dense gradient they stand for.

A table whose rows are split across processes (``hardware=model_parallel*``, issue 19) holds only
its shard's gradient on each process: the norm adds the squares of every process's shard (one
all-reduce over the processes that split it) to those of the parameters each process holds whole,
so that every process scales by the same factor, the one a single process holding the whole table
would use.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _coalesced_grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
        grads.append(p.grad)
    return grads


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad._values() if grad.is_sparse else grad


def _square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    return sum((_values(g).double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float,
    split: Iterable[torch.nn.Parameter] = (), split_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale all gradients so their joint L2 norm is at most ``max_norm``; returns the norm.

    ``split``: parameters (among ``params`` or not) of which each process of ``split_group``
    holds a disjoint part, the rows of a sharded table; their squares are summed over the group.
    A collective when ``split_group`` is given: every process of the group calls it at each step.
    """
    split = list(split)
    split_ids = {id(p) for p in split}
    whole = _coalesced_grads(p for p in params if id(p) not in split_ids)
    parts = _coalesced_grads(split)
    total_sq = _square_sum(whole)
    if split_group is not None:
        parts_sq = _square_sum(parts).to(_device_of(parts + whole))
        dist.all_reduce(parts_sq, group=split_group)
        total_sq = total_sq.to(parts_sq.device) + parts_sq
    elif parts:
        total_sq = total_sq + _square_sum(parts)
    total = torch.sqrt(total_sq)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for g in whole + parts:
            _values(g).mul_(scale)
    return total


def _device_of(grads: list[torch.Tensor]) -> torch.device:
    # the collective runs where the gradients are (NCCL takes CUDA tensors only)
    return grads[0].device if grads else torch.device("cpu")


def clip_grad_value_(params: Iterable[torch.nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient entry into ``[-clip_value, clip_value]``."""
    for g in _coalesced_grads(params):
        _values(g).clamp_(-clip_value, clip_value)

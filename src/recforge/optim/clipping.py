"""Gradient clipping that also handles sparse (row-wise embedding) gradients.

``torch.nn.utils.clip_grad_norm_`` cannot take the norm of a sparse gradient; GRU4Rec's item
tables produce sparse ones. Sparse gradients are coalesced first (duplicate rows summed), so the
norm is that of the dense gradient they stand for.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


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


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale all gradients so their joint L2 norm is at most ``max_norm``; returns the norm."""
    grads = _coalesced_grads(params)
    if not grads:
        return torch.tensor(0.0)
    total = torch.sqrt(sum(_values(g).double().pow(2).sum() for g in grads))
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for g in grads:
            _values(g).mul_(scale)
    return total


def clip_grad_value_(params: Iterable[torch.nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient entry into ``[-clip_value, clip_value]``."""
    for g in _coalesced_grads(params):
        _values(g).clamp_(-clip_value, clip_value)

"""The lazy row-wise step of GRU4Rec's Adagrad with momentum (spec §1.6) for sparse gradients.

For each row ``r`` that appears in the gradient, with ``g`` the sum of its duplicate rows:

    G[r] ← G[r] + g²;  u = g / (−sqrt(G[r] + ε) / lr);  v[r] ← μ·v[r] + u;  θ[r] ← θ[r] + v[r]

(``θ[r] ← θ[r] + u`` without momentum). Rows absent from the gradient are not touched: no
accumulator change, no velocity decay, no step. :class:`recforge.optim.adagrad_momentum.IndexedAdagradM`
calls :func:`sparse_adagrad_momentum_` for every parameter whose gradient is sparse.

``kernel="pytorch"`` is the reference below: coalesce (which sums the duplicates), then a handful of
indexed ops. ``kernel="triton"`` (:mod:`recforge.kernels.rowwise_adagrad_triton`) sorts the row
indices and does the rest in one launch, one program per distinct row, summing its duplicates in
their original order and reading and writing each parameter, accumulator and velocity row once.
On a GPU the reference is a dozen small launches per step; the update itself moves a few hundred
KiB. When Triton cannot run, the call falls back to the reference with one warning per process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.kernels.twin import KernelImpl, TritonTwin

__all__ = ["sparse_adagrad_momentum_", "sparse_adagrad_momentum_reference_"]

TRITON = TritonTwin("recforge.kernels.rowwise_adagrad_triton")


def _validate(param: Tensor, grad_sum: Tensor, velocity: Tensor | None, grad: Tensor, momentum: float) -> None:
    if not grad.is_sparse or grad.sparse_dim() != 1:
        raise ValueError(
            f"grad must be a sparse COO tensor with one sparse dimension (rows), got layout "
            f"{grad.layout} with shape {tuple(grad.shape)}"
        )
    if grad.shape != param.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)}, the parameter {tuple(param.shape)}")
    if grad_sum.shape != param.shape:
        raise ValueError(f"grad_sum has shape {tuple(grad_sum.shape)}, the parameter {tuple(param.shape)}")
    if momentum > 0 and (velocity is None or velocity.shape != param.shape):
        got = None if velocity is None else tuple(velocity.shape)
        raise ValueError(f"momentum {momentum} needs a velocity of shape {tuple(param.shape)}, got {got}")


# The arithmetic follows the reference code's order of float operations (divide by
# -sqrt(G+ε)/lr rather than multiply by lr/sqrt(G+ε)): training is chaotic enough that one-ulp
# differences grow into visibly different trajectories within a few dozen steps, and the
# exact-trajectory tests need the same rounding.
#
# The rows of a coalesced gradient are unique, so adding into them in place rounds exactly like
# "gather, add, copy back"; index_add_ and index_select are several times cheaper on CPU than
# advanced indexing and index_copy_, which only the velocity (scaled, then added) still needs.
@torch.no_grad()
def sparse_adagrad_momentum_reference_(
    param: Tensor, grad_sum: Tensor, velocity: Tensor | None, grad: Tensor,
    lr: float, momentum: float, eps: float,
) -> None:
    """The PyTorch reference of :func:`sparse_adagrad_momentum_` (same arguments, no ``kernel``)."""
    grad = grad.coalesce()
    rows = grad._indices()[0]
    values = grad._values()
    grad_sum.index_add_(0, rows, values.pow(2))
    neg_scaled_denom = grad_sum.index_select(0, rows).add_(eps).sqrt_().mul_(-1.0 / lr)
    if momentum > 0:
        # addcdiv_ adds values / denominator rounded as one division, as add_(values / denom)
        # does, without the [rows, d] quotient in between (~30 µs of a GRU4Rec step)
        rows_velocity = velocity.index_select(0, rows).mul_(momentum).addcdiv_(values, neg_scaled_denom)
        velocity.index_copy_(0, rows, rows_velocity)
        param.index_add_(0, rows, rows_velocity)
    else:
        param.index_add_(0, rows, values / neg_scaled_denom)


def _layout_reason(param: Tensor, grad_sum: Tensor, velocity: Tensor | None) -> str | None:
    """Why the kernel cannot update these tensors in place, or None when it can."""
    tensors = [t for t in (param, grad_sum, velocity) if t is not None]
    if any(not t.is_contiguous() for t in tensors):
        return "the kernel needs contiguous parameter and state tensors"
    if len({t.device for t in tensors}) > 1:
        return "parameter and state tensors are on different devices"
    return None


@torch.no_grad()
def sparse_adagrad_momentum_(
    param: Tensor,
    grad_sum: Tensor,
    velocity: Tensor | None,
    grad: Tensor,
    *,
    lr: float,
    momentum: float = 0.0,
    eps: float = 1e-6,
    kernel: KernelImpl = "pytorch",
) -> None:
    """Apply one lazy row-wise Adagrad-momentum step in place.

    Args:
        param: ``[N, ...]`` the parameter (an item table), updated in place.
        grad_sum: ``[N, ...]`` Adagrad's running sum of squared gradients, updated in place.
        velocity: ``[N, ...]`` the momentum buffer, updated in place; ``None`` when ``momentum`` is 0.
        grad: sparse COO ``[N, ...]`` with one sparse dimension, coalesced or not (duplicate rows
            are summed before the update).
        lr, momentum, eps: the step size, heavy-ball momentum μ and Adagrad's ε (inside the root).
        kernel: ``"pytorch"`` (the reference) or ``"triton"``, which falls back to the reference
            with one warning per process where Triton cannot run.
    """
    _validate(param, grad_sum, velocity, grad, momentum)
    state = velocity if momentum > 0 else None
    TRITON.dispatch(
        "sparse_adagrad_momentum_", kernel, (param, grad_sum, grad._values()),
        triton=lambda module: module.sparse_adagrad_momentum_triton_(
            param, grad_sum, state, grad._indices()[0], grad._values(),
            lr=lr, momentum=momentum, eps=eps,
        ),
        reference=lambda: sparse_adagrad_momentum_reference_(
            param, grad_sum, velocity, grad, lr, momentum, eps
        ),
        layout_reason=lambda _module: _layout_reason(param, grad_sum, state),
    )

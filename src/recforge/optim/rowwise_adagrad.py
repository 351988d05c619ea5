"""Row-wise Adagrad: one accumulator per embedding row, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD``
(the embedding optimizer TorchRec's DLRM fuses into the backward) and DLRM's ``rwsadagrad``.

For a row ``r`` of a parameter viewed as ``[rows, D]`` (a table ``[N, D]``; a vector is ``N`` rows
of one value), with ``g`` the row's gradient, its duplicates summed:

    G[r] ← G[r] + mean_d(g'[d]²)              g' = g + λ·θ[r] under L2 decay, else g
    m    = lr / (sqrt(G[r]) + ε)              (ε outside the root)
    θ[r] ← c·θ[r] − m·g                       c = 1 − m·λ (L2), 1 − lr·λ (decoupled), 1 (no decay)

This is FBGEMM's rule (``fbgemm_gpu/codegen/genscript/optimizers.py``, ``rowwise_adagrad()``: the
mean of the squared gradient over the row's D values, ``multiplier = learning_rate /
(sqrtf(new_sum_square_grads) + eps)``, ``weight_decay_mode`` 1 = L2 and 2 = decoupled), and
without decay also the sparse branch of facebookresearch/dlrm's ``optim/rwsadagrad.py``. The
defaults follow FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (lr 0.01, eps 1e-8, no decay).

A sparse gradient (``nn.Embedding(sparse=True)``) updates only the rows it holds, decay included:
absent rows keep their values and accumulators. A dense gradient updates every row. (dlrm's
``rwsadagrad`` falls back to element-wise Adagrad for dense gradients; here the rule stays row-wise.)
"""
from __future__ import annotations

from typing import Annotated, Literal

import torch
from torch import Tensor

from recforge.config_values import Range

__all__ = ["RowWiseAdagrad"]


def _rows(t: Tensor) -> Tensor:
    """``t`` as a ``[rows, D]`` view (a vector: ``[N, 1]``; a scalar: ``[1, 1]``)."""
    return t.view(t.shape[0] if t.dim() else 1, -1)


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row of each parameter; lazy on sparse gradients.

    Args:
        params: parameters or parameter groups (embedding tables ``[N, D]``; any other shape is
            read as ``[shape[0], -1]``).
        lr, eps: step size and the ε added to ``sqrt(G)`` (outside the root, as FBGEMM).
        weight_decay: λ; 0 turns decay off.
        weight_decay_mode: ``l2`` (λ·θ joins the gradient, accumulator included) or ``decoupled``
            (θ shrinks by lr·λ, the accumulator sees the raw gradient), FBGEMM's modes 1 and 2.

    State per parameter: ``sum`` ``[rows]`` (float32, float64 for a float64 parameter), zeros
    from construction.
    """

    def __init__(
        self,
        params,
        lr: Annotated[float, Range(gt=0)] = 0.01,
        eps: Annotated[float, Range(ge=0)] = 1e-8,
        weight_decay: Annotated[float, Range(ge=0)] = 0.0,
        weight_decay_mode: Literal["l2", "decoupled"] = "l2",
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if weight_decay_mode not in ("l2", "decoupled"):
            raise ValueError(f"weight_decay_mode must be 'l2' or 'decoupled', got {weight_decay_mode!r}")
        super().__init__(
            params, dict(lr=lr, eps=eps, weight_decay=weight_decay, weight_decay_mode=weight_decay_mode)
        )
        # the accumulators exist from the start, as torch's Adagrad's: a checkpoint loader that
        # shapes its target from the current state (torch.distributed.checkpoint's) finds them
        for group in self.param_groups:
            for p in group["params"]:
                self._sum(p)

    def _sum(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "sum" not in state:
            # FBGEMM keeps the row accumulator in float32 even for half-precision tables.
            dtype = torch.promote_types(p.dtype, torch.float32)
            state["sum"] = torch.zeros(_rows(p).shape[0], dtype=dtype, device=p.device)
        return state["sum"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    self._sparse_step(p, p.grad, self._sum(p), group)
                else:
                    self._dense_step(p, p.grad, self._sum(p), group)
        return loss

    @staticmethod
    def _update_rows(
        weights: Tensor, grads: Tensor, sums: Tensor, group: dict
    ) -> tuple[Tensor, Tensor]:
        """The new accumulators ``[k]`` and row values ``[k, D]`` of ``k`` rows, from their values
        ``weights [k, D]``, gradients ``grads [k, D]`` and accumulators ``sums [k]``."""
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        l2 = decay != 0 and group["weight_decay_mode"] == "l2"
        g = grads.to(sums.dtype)
        w = weights.to(sums.dtype)
        seen = g + decay * w if l2 else g
        new_sums = sums + seen.pow(2).mean(dim=1)
        multiplier = (lr / (new_sums.sqrt() + eps)).unsqueeze(1)
        if decay == 0:
            new_w = w - multiplier * g
        elif l2:
            new_w = (1.0 - multiplier * decay) * w - multiplier * g
        else:
            new_w = (1.0 - lr * decay) * w - multiplier * g
        return new_sums, new_w.to(weights.dtype)

    def _sparse_step(self, p: Tensor, grad: Tensor, sums: Tensor, group: dict) -> None:
        if grad.sparse_dim() != 1:
            raise ValueError(
                f"RowWiseAdagrad takes sparse gradients with one sparse dimension (rows), got "
                f"{grad.sparse_dim()} for a parameter of shape {tuple(p.shape)}"
            )
        grad = grad.coalesce()  # sums duplicate rows: the update is not linear in the gradient
        rows = grad._indices()[0]
        if rows.numel() == 0:
            return
        table = _rows(p)
        new_sums, new_rows = self._update_rows(
            table.index_select(0, rows), grad._values().reshape(rows.numel(), -1), sums.index_select(0, rows), group
        )
        sums.index_copy_(0, rows, new_sums)
        table.index_copy_(0, rows, new_rows)

    def _dense_step(self, p: Tensor, grad: Tensor, sums: Tensor, group: dict) -> None:
        table = _rows(p)
        new_sums, new_rows = self._update_rows(table, grad.reshape(table.shape), sums, group)
        sums.copy_(new_sums)
        table.copy_(new_rows)

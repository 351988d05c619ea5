"""GRU4Rec's optimizer: Adagrad (ε inside the root) with heavy-ball momentum, lazy on sparse rows.

Spec §1.6. For a dense parameter:
    G ← G + g²;  u = g / sqrt(G + ε);  v ← μ·v − lr·u;  θ ← θ + v      (θ ← θ − lr·u when μ = 0)
For a sparse gradient (item tables) the duplicate rows are summed first, then only the touched
rows are updated: their accumulator, their velocity and their values. Rows not in the mini-batch
keep their velocity untouched (no decay, no step), as the reference does.
"""
from __future__ import annotations

import torch


class IndexedAdagradM(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.05, momentum: float = 0.0, eps: float = 1e-6) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps))

    def _state(self, p: torch.Tensor, momentum: float) -> dict:
        state = self.state[p]
        if "sum" not in state:
            state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if momentum > 0:
                state["velocity"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, eps = group["lr"], group["momentum"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, mu)
                if p.grad.is_sparse:
                    self._sparse_step(p, p.grad.coalesce(), state, lr, mu, eps)
                else:
                    self._dense_step(p, p.grad, state, lr, mu, eps)
        return loss

    # The arithmetic below follows the reference's order of float operations (divide by
    # -sqrt(G+ε)/lr rather than multiply by lr/sqrt(G+ε), ...): training is chaotic enough that
    # one-ulp differences grow into visibly different trajectories within a few dozen steps, and
    # the exact-trajectory test needs the same rounding.
    @staticmethod
    def _dense_step(p, grad, state, lr, mu, eps) -> None:
        acc = state["sum"]
        acc.add_(grad.pow(2))
        denom = acc.add(eps).sqrt_()
        if mu > 0:
            velocity = state["velocity"]
            velocity.mul_(mu).addcdiv_(grad, denom, value=-lr)
            p.add_(velocity)
        else:
            p.addcdiv_(grad, denom, value=-lr)

    # The rows of a coalesced gradient are unique, so adding into them in place rounds exactly like
    # "gather, add, copy back"; index_add_ and index_select are several times cheaper on CPU than
    # advanced indexing and index_copy_, which only the velocity (scaled, then added) still needs.
    @staticmethod
    def _sparse_step(p, grad, state, lr, mu, eps) -> None:
        rows = grad._indices()[0]
        values = grad._values()
        state["sum"].index_add_(0, rows, values.pow(2))
        neg_scaled_denom = state["sum"].index_select(0, rows).add_(eps).sqrt_().mul_(-1.0 / lr)
        if mu > 0:
            velocity = state["velocity"].index_select(0, rows)
            velocity.mul_(mu).add_(values / neg_scaled_denom)
            state["velocity"].index_copy_(0, rows, velocity)
            p.index_add_(0, rows, velocity)
        else:
            p.index_add_(0, rows, values / neg_scaled_denom)

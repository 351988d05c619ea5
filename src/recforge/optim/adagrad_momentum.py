"""GRU4Rec's optimizer: Adagrad (ε inside the root) with heavy-ball momentum, lazy on sparse rows.

Spec §1.6. For a dense parameter:
    G ← G + g²;  u = g / sqrt(G + ε);  v ← μ·v − lr·u;  θ ← θ + v      (θ ← θ − lr·u when μ = 0)
For a sparse gradient (item tables) the duplicate rows are summed first, then only the touched
rows are updated: their accumulator, their velocity and their values. Rows not in the mini-batch
keep their velocity untouched (no decay, no step), as the reference does.
"""
from __future__ import annotations

from typing import Annotated

import torch

from recforge.config_values import Range
from recforge.kernels.rowwise_adagrad import sparse_adagrad_momentum_
from recforge.kernels.twin import KernelImpl, check_kernel


class IndexedAdagradM(torch.optim.Optimizer):
    """Adagrad with heavy-ball momentum; lazy and row-wise for sparse gradients.

    Args:
        params: parameters or parameter groups; those whose gradient is sparse get the lazy
            row-wise step.
        lr, momentum, eps: step size, heavy-ball momentum μ in [0, 1) and Adagrad's ε.
        kernel: ``pytorch`` or ``triton``, the implementation of the row-wise step
            (:mod:`recforge.kernels.rowwise_adagrad`); dense parameters always take PyTorch ops.
    """

    def __init__(
        self,
        params,
        lr: Annotated[float, Range(gt=0)] = 0.05,
        momentum: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        eps: Annotated[float, Range(gt=0)] = 1e-6,
        kernel: KernelImpl = "pytorch",
    ) -> None:
        self.kernel = check_kernel(kernel, "optimizer.kernel")
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
            dense = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, mu)
                if p.grad.is_sparse:
                    sparse_adagrad_momentum_(
                        p, state["sum"], state.get("velocity"), p.grad,
                        lr=lr, momentum=mu, eps=eps, kernel=self.kernel,
                    )
                else:
                    dense.append(p)
            if dense:
                self._dense_step(dense, [self.state[p] for p in dense], lr, mu, eps)
        return loss

    # The arithmetic follows the reference's order of float operations, as the row-wise step
    # does (see recforge.kernels.rowwise_adagrad): the exact-trajectory tests need the same rounding.
    # The foreach ops run the same per-tensor kernels as the reference's loop (no fusion on CPU),
    # in a handful of calls for all the dense parameters.
    @staticmethod
    def _dense_step(params, states, lr, mu, eps) -> None:
        grads = [p.grad for p in params]
        sums = [state["sum"] for state in states]
        torch._foreach_add_(sums, torch._foreach_pow(grads, 2))
        denoms = torch._foreach_add(sums, eps)
        torch._foreach_sqrt_(denoms)
        if mu > 0:
            velocities = [state["velocity"] for state in states]
            torch._foreach_mul_(velocities, mu)
            torch._foreach_addcdiv_(velocities, grads, denoms, value=-lr)
            torch._foreach_add_(params, velocities)
        else:
            torch._foreach_addcdiv_(params, grads, denoms, value=-lr)

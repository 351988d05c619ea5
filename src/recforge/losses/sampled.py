"""Next-item losses over sampled columns (GRU4Rec, spec §1.4).

Every loss takes ``scores [B', C]`` where column i holds row i's target (the first B' columns are
the mini-batch's own targets, any further columns are shared sampled negatives). Accidental hits are
kept, as in the reference. The sum over rows is divided by the *configured* batch size, so the
shrinking batch at the end of an epoch does not weigh its rows more.
"""
from __future__ import annotations

from typing import Annotated

import torch
from torch import nn
from torch.nn import functional as F

from recforge.config_values import Range
from recforge.contracts import NEXT_ITEM_COLUMNS
from recforge.kernels.sampled_loss import (
    bprmax_value_and_grad,
    check_column_counts,
    negatives_softmax,
    sampled_bprmax,
    sampled_bprmax_fused,
    sampled_softmax_xe,
    softmax_xe_value_and_grad,
)
from recforge.kernels.twin import KernelImpl



class SampledLoss(nn.Module):
    """Base: declares what score matrix it consumes, and the smallest useful batch."""

    consumes = NEXT_ITEM_COLUMNS

    @property
    def uses_log_q(self) -> bool:
        """Whether the loss reads the columns' log sampling weights (the task skips them if not)."""
        return False

    def min_batch_rows(self, n_extra_negatives: int) -> int:
        # Without extra samples the other rows' targets are the only negatives.
        return 1 if n_extra_negatives > 0 else 2

    def activation(self, scores: torch.Tensor) -> torch.Tensor:
        """The final activation applied to scores before the loss (monotone: ranking unchanged)."""
        return scores

    def fast(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The loss of the fast training step (``task.fast_step``): the same function, its float
        operations free to be fused or reordered. A loss without a faster form is itself."""
        return self(scores, batch_size, log_q=log_q)

    #: whether :meth:`fast_value_and_grad` is written out (else the fast step takes autograd)
    has_value_and_grad: bool = False

    #: whether the fused fast step hands :meth:`fast_value_and_grad` each distinct sampled
    #: negative once, with its count, rather than every draw: where the loss's passes over the
    #: columns cost more than finding the distinct draws (measured per loss, issue 18)
    prefers_counted_columns: bool = False

    def fast_value_and_grad(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`fast`'s value and its gradient w.r.t. ``scores``, computed at once without a
        graph, for a step that writes out its own backward (GRU4Rec's fused fast step).

        ``counts [C]``, if given: column j stands for ``counts[j]`` identical columns (the
        distinct sampled negatives with their multiplicities, the targets' columns 1). The value
        is that of the columns repeated so, and each column's gradient the sum over its copies."""
        raise NotImplementedError(f"{type(self).__name__} has no written-out gradient")


class CrossEntropy(SampledLoss):
    """Softmax cross-entropy over the columns, with optional logq correction.

    ``logq > 0`` subtracts ``logq * log q_j`` from column j before the softmax, where q_j is the
    column's sampling weight (raw popularity for in-batch targets, popularity^alpha for samples).
    """

    def __init__(self, logq: Annotated[float, Range(ge=0)] = 0.0, kernel: KernelImpl = "pytorch") -> None:
        super().__init__()
        self.logq = float(logq)
        self.kernel = kernel

    @property
    def uses_log_q(self) -> bool:
        return self.logq > 0.0

    def forward(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.logq > 0.0 and log_q is None:
            raise ValueError("loss.logq > 0 needs the columns' log sampling weights")
        return sampled_softmax_xe(scores, log_q, self.logq, batch_size, kernel=self.kernel)

    def fast(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        """PyTorch's fused log-softmax cross-entropy: one pass forward, ``softmax - onehot`` back.

        The reference's ``-log(p_ii + 1e-24)`` differs from ``-log p_ii`` only where the target's
        probability is below ~1e-24 (a target 55 nats under its row's best column); there the
        reference's gradient vanishes and this one does not.
        """
        scores = self._corrected(scores, log_q)
        targets = torch.arange(scores.shape[0], device=scores.device)
        return F.cross_entropy(scores, targets, reduction="sum") / batch_size

    def _corrected(
        self, scores: torch.Tensor, log_q: torch.Tensor | None, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The scores the fast forms' softmax reads: ``scores - logq * log q`` (a shift by
        constants, so the gradient w.r.t. the scores is the same), and ``+ log c`` for a column
        counted c times (the softmax over its c copies; its mass, so its gradient, is theirs
        summed), in one pass over the matrix."""
        shift = None
        if self.logq != 0.0:
            if log_q is None:
                raise ValueError("loss.logq > 0 needs the columns' log sampling weights")
            shift = self.logq * log_q
        if counts is not None:
            shift = -counts.log() if shift is None else shift - counts.log()
        return scores if shift is None else scores - shift.unsqueeze(0)

    has_value_and_grad = True

    def fast_value_and_grad(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_column_counts(scores, counts)
        return softmax_xe_value_and_grad(self._corrected(scores, log_q, counts), batch_size)


class _ELUScored(SampledLoss):
    """A loss whose final activation is ELU(alpha=elu_param); 0 keeps the scores linear."""

    def __init__(self, elu_param: Annotated[float, Range(ge=0)]) -> None:
        super().__init__()
        self.elu_param = float(elu_param)

    def activation(self, scores: torch.Tensor) -> torch.Tensor:
        return F.elu(scores, alpha=self.elu_param) if self.elu_param > 0 else scores


class BPRMax(_ELUScored):
    """BPR-max: -log sum_j s_ij σ(r_ii - r_ij) + bpreg sum_j s_ij r_ij², j over negatives only.

    s_ij is a softmax over row i's negatives (the target column excluded); its weights are not
    detached. With ``elu_param > 0`` the scores first pass through ELU(alpha=elu_param).
    """

    def __init__(
        self,
        bpreg: Annotated[float, Range(ge=0)] = 1.0,
        elu_param: Annotated[float, Range(ge=0)] = 0.5,
        kernel: KernelImpl = "pytorch",
    ) -> None:
        super().__init__(elu_param)
        self.bpreg = float(bpreg)
        self.kernel = kernel

    def forward(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        return sampled_bprmax(scores, self.bpreg, self.elu_param, batch_size, kernel=self.kernel)

    def fast(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The same loss with its backward written out (:func:`sampled_bprmax_fused`)."""
        return sampled_bprmax_fused(scores, self.bpreg, self.elu_param, batch_size)

    has_value_and_grad = True
    # [32, 2080] of the preset against the ~1,500 distinct columns, 1 thread: the written-out
    # value and gradient 502 -> 390 µs, finding the distinct draws 31 µs. (Cross-entropy's
    # softmax: 138 -> 120 µs, less than that search saves, so it takes every draw.)
    prefers_counted_columns = True

    def fast_value_and_grad(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return bprmax_value_and_grad(scores, self.bpreg, self.elu_param, batch_size, counts=counts)


class TOP1Max(_ELUScored):
    """TOP1-max: sum_j s_ij (σ(r_ij - r_ii) + σ(r_ij²)), j over negatives only (spec §1.4).

    s_ij is the same negatives-only softmax as in BPR-max, not detached. With ``elu_param > 0``
    the scores first pass through ELU(alpha=elu_param); 0 keeps them linear.
    """

    def __init__(self, elu_param: Annotated[float, Range(ge=0)] = 0.0) -> None:
        super().__init__(elu_param)

    def forward(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        r = self.activation(scores)
        s = negatives_softmax(r)
        target = torch.diagonal(r).unsqueeze(1)
        # The target column carries weight 0 in s, so summing over all columns is the sum over
        # negatives.
        loss = (s * (torch.sigmoid(r - target) + torch.sigmoid(r * r))).sum(dim=1)
        return loss.sum() / batch_size


class TOP1(SampledLoss):
    """Legacy TOP1: mean_j [σ(r_ij - r_ii) + σ(r_ij²)] - σ(r_ii²)/C, j over all C columns.

    The subtracted term removes the target's own score regulariser from the mean; its pairwise
    term σ(0) = 1/2 stays in, as in the reference. Not recommended (vanishing gradients).
    """

    def forward(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        n_cols = scores.shape[1]
        target = torch.diagonal(scores).unsqueeze(1)
        per_row = (torch.sigmoid(scores - target) + torch.sigmoid(scores * scores)).mean(dim=1)
        loss = per_row - torch.sigmoid(target.squeeze(1) ** 2) / n_cols
        return loss.sum() / batch_size


class BPR(SampledLoss):
    """Legacy BPR: -sum_j log σ(r_ii - r_ij), j over all columns including i.

    A *sum* over the columns, not a mean: the spec writes Σ_j, and the reference (Theano
    ``gru4rec.py`` at the commit the spec read) sums the whole matrix before the cost is divided by
    the batch size (older Theano versions took a mean over every entry instead). The j = i term is
    the constant log 2, kept so values match the reference. Not recommended (vanishing gradients).
    """

    def forward(
        self, scores: torch.Tensor, batch_size: int, log_q: torch.Tensor | None = None
    ) -> torch.Tensor:
        target = torch.diagonal(scores).unsqueeze(1)
        # logsigmoid instead of log(sigmoid(.)): the same value, but it does not underflow to
        # -inf for a badly ranked target (Theano rewrites log(sigmoid) into softplus the same way).
        return -F.logsigmoid(target - scores).sum() / batch_size

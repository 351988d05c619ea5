"""Click-through-rate losses: binary cross-entropy on logits."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from recforge.contracts import CTR_LOGITS


class BinaryCrossEntropy(nn.Module):
    """Mean BCE of click logits ``[B]`` against labels ``[B]`` in {0, 1} (log loss)."""

    consumes = CTR_LOGITS

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))

"""Index arithmetic on jagged tensors (values plus offsets), shared by models, kernels and ranking."""
from __future__ import annotations

import torch


def jagged_positions(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and position (0 = the row's first element) of every element of a jagged tensor.

    offsets ``[B+1]`` integer (offsets[0] = 0), total = ΣL -> (rows ``[ΣL]``, positions ``[ΣL]``),
    both int64.
    """
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total
    )
    positions = torch.arange(total, device=offsets.device) - offsets[:-1][rows]
    return rows, positions

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


def next_item_positives(
    items: torch.Tensor, offsets: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The item each position of a jagged batch predicts: ``[ΣL]`` int64.

    Position p < L-1 of row b predicts the row's item p+1; its last position predicts
    ``targets[b]`` (the reference writes the target into ``past_ids`` at column L and supervises
    ``ids[1..L]``). items ``[ΣL]``, offsets ``[B+1]``, targets ``[B]``; empty rows are skipped.
    """
    positives = items.roll(-1)
    nonempty = offsets[1:] > offsets[:-1]
    positives[offsets[1:][nonempty] - 1] = targets[nonempty]
    return positives

"""Compute kernels (PyTorch references; Triton twins behind the same functions)."""

from recforge.kernels.sampled_loss import sampled_bprmax, sampled_softmax_xe
from recforge.kernels.target_rank import target_rank_counts

__all__ = ["sampled_bprmax", "sampled_softmax_xe", "target_rank_counts"]

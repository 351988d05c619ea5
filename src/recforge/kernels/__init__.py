"""Compute kernels (PyTorch references; Triton twins behind the same functions)."""

from recforge.kernels.rowwise_adagrad import sparse_adagrad_momentum_
from recforge.kernels.sampled_loss import sampled_bprmax, sampled_softmax_xe
from recforge.kernels.target_rank import target_rank_counts

__all__ = ["sampled_bprmax", "sampled_softmax_xe", "sparse_adagrad_momentum_", "target_rank_counts"]

"""Compute kernels (PyTorch references; Triton twins behind the same functions)."""

from recforge.kernels.target_rank import target_rank_counts

__all__ = ["target_rank_counts"]

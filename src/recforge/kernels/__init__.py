"""Compute kernels (PyTorch references; Triton twins behind the same functions, ``kernel=``)."""

from recforge.kernels.dot_interaction import dot_interaction
from recforge.kernels.hstu_attention import hstu_attention
from recforge.kernels.hstu_output import hstu_output
from recforge.kernels.rowwise_adagrad import sparse_adagrad_momentum_
from recforge.kernels.sampled_loss import sampled_bprmax, sampled_softmax_xe
from recforge.kernels.target_rank import target_rank_counts

__all__ = [
    "dot_interaction",
    "hstu_attention",
    "hstu_output",
    "sampled_bprmax",
    "sampled_softmax_xe",
    "sparse_adagrad_momentum_",
    "target_rank_counts",
]

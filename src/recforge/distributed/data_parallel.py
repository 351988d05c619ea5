"""Data parallelism on a data_parallel x tensor_parallel mesh whose tables are row-sharded (issue 19).

On Lightning's 2-D mesh (``ModelParallelStrategy``: rank = dp_index * tp_size + tp_index) each
data-parallel rank reads its own share of the batches, and the ``tensor_parallel`` ranks of one
data-parallel index read the same batches and split the tables' rows between them
(:class:`recforge.distributed.sharded_table.RowShardedEmbedding`). The gradients therefore meet in
two ways:

* the dense layers (dense arch, interaction, over arch) are replicated on every rank: PyTorch's
  DDP, through its composable ``replicate`` (no wrapper, so parameter names and checkpoints stay
  those of the plain model), averages them over all ranks. The ranks of one table-sharding group
  contribute identical gradients, so that average is the average over the data-parallel shares;
  taking it over all ranks keeps every copy of the dense layers bit-identical.
* a table shard is replicated only across ``data_parallel`` (the ranks holding the same rows):
  its gradient is averaged over that group. A sparse gradient goes through
  :func:`recforge.optim.sparse_grad_sync.average_sparse_grads_` (DDP's and gloo's sparse
  all-reduce are what that module avoids), a dense one through DTensor's ``Partial("avg")`` ->
  ``Replicate``.

With one data-parallel rank nothing here communicates: the table-sharding group's copies of the
dense layers compute the same gradients from the same batches.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from recforge.distributed.sharded_table import RowShardedEmbedding
from recforge.optim.sparse_grad_sync import average_sparse_grads_

__all__ = ["average_over_replicas_", "replicate_dense"]


def replicate_dense(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average ``model``'s gradients over every rank of ``mesh``, its sharded tables left out,
    when ``mesh`` has more than one data-parallel rank; in place, once (Lightning calls
    ``configure_model`` once per stage). ``mesh``: Lightning's 2-D mesh."""
    if mesh["data_parallel"].size() == 1 or isinstance(model, DDP):
        return
    tables = [m for m in model.modules() if isinstance(m, RowShardedEmbedding)]
    # DDP's default group: every rank (Lightning's mesh is the world). Its reducer is built at the
    # first forward, once the strategy has moved the model to its device; Lightning moves the batches.
    replicate(model, ignored_modules=tables)


def average_over_replicas_(tables: Iterable[RowShardedEmbedding], replicas: DeviceMesh) -> None:
    """Replace the gradient of each table's shard by its average over ``replicas`` (1-D: the ranks
    that hold the same rows). A collective: every rank of ``replicas`` calls it with its tables in
    the same order. Sparse gradients stay sparse (uncoalesced, duplicates left to the optimizer)."""
    if replicas.size() == 1:
        return
    tables = list(tables)
    average_sparse_grads_([t.weight for t in tables if t.sparse], group=replicas.get_group())
    for table in tables:
        if table.sparse:
            continue
        weight = table.weight
        grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
        weight.grad = DTensor.from_local(grad, replicas, [Partial("avg")], run_check=False).redistribute(
            replicas, [Replicate()]).to_local()

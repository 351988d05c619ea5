"""Data parallelism on a data_parallel x tensor_parallel mesh whose tables are row-sharded (issue 19).

On Lightning's 2-D mesh (``ModelParallelStrategy``: rank = dp_index * tp_size + tp_index) each
data-parallel rank reads its own share of the batches, and the ``tensor_parallel`` ranks of one
data-parallel index read the same batches and split the tables' rows between them
(:class:`recforge.distributed.sharded_table.RowShardedEmbedding`). The gradients therefore meet in
two ways:

* the dense layers (dense arch, interaction, over arch) are replicated on every rank:
  :func:`replicate_dense` makes rank 0's copy everyone's once (as DDP does when it wraps a module),
  and after every backward :func:`average_dense_grads_` averages their gradients over the
  data-parallel ranks, laid end to end in one DTensor redistribution. The ranks of one
  table-sharding group compute identical gradients from the same batches, so every copy of the
  dense layers stays bit-identical. No wrapper: parameter names and checkpoints stay those of the
  plain model. (DDP's composable ``replicate`` did this before; it is private API. DDP overlaps its
  all-reduce with the backward; DLRM's dense layers are a few MB, one all-reduce after it.)
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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from recforge.distributed.sharded_table import RowShardedEmbedding
from recforge.optim.sparse_grad_sync import average_sparse_grads_

__all__ = ["average_dense_grads_", "average_over_replicas_", "dense_parameters", "replicate_dense"]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters outside its sharded tables: the ones every rank holds whole."""
    in_tables = {id(p) for m in model.modules() if isinstance(m, RowShardedEmbedding) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in in_tables]


def _end_to_end(tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """The tensors laid end to end in one flat tensor per dtype (one collective each)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    return [(group, torch.cat([t.reshape(-1) for t in group])) for group in by_dtype.values()]


def _copy_back(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for tensor in group:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


@torch.no_grad()
def replicate_dense(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give every rank of ``mesh`` (Lightning's 2-D mesh) rank 0's values of ``model``'s dense
    parameters, as DDP does when it wraps a module: DTensor's ``distribute_tensor`` to a replica on
    every rank, from the first rank of each mesh dimension. A collective; idempotent. Seeded runs
    start identical anyway; this makes it so whatever drew the weights."""
    if mesh["data_parallel"].size() == 1:
        return
    for group, flat in _end_to_end([p.data for p in dense_parameters(model)]):
        _copy_back(group, distribute_tensor(flat, mesh, [Replicate()] * mesh.ndim).to_local())


@torch.no_grad()
def average_dense_grads_(params: list[nn.Parameter], mesh: DeviceMesh) -> None:
    """Replace the gradient of each of ``params`` (:func:`dense_parameters`) by its mean over the
    data-parallel ranks, as DDP does in backward: the gradients laid end to end, one DTensor
    ``Partial("avg")`` -> ``Replicate`` over ``mesh["data_parallel"]`` per dtype. The ranks of one
    table-sharding group hold identical gradients (the same batches), so every copy of the dense
    layers stays identical. A parameter without a gradient takes part with zeros and then has one
    (every rank must join the same collective). A collective: every rank calls it with the same
    parameters in the same order. Nothing to do with one data-parallel rank."""
    replicas = mesh["data_parallel"]
    if replicas.size() == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for group, flat in _end_to_end([p.grad for p in params]):
        mean = DTensor.from_local(flat, replicas, [Partial("avg")], run_check=False).redistribute(
            replicas, [Replicate()]).to_local()
        _copy_back(group, mean)


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

"""An embedding table whose rows are split across the ranks of one device-mesh dimension (issue 19).

Row-wise sharding as DTensor's ``Shard(0)`` lays a tensor out (``torch.chunk``'s split: the first
ranks hold ``ceil(N / world)`` rows each, the last ones what is left), with the lookup of
``RowwiseParallel`` on ``nn.Embedding``: every rank of the mesh gets the same ids, looks up the rows
it owns (zeros for the others), and one all-reduce over the mesh (DTensor's ``Partial`` ->
``Replicate``) gives every rank the whole result. Each output row is non-zero on one rank only, so
the sum adds exact zeros: the lookup equals the unsharded table's bit for bit.

What differs from ``RowwiseParallel``: the gradient. DTensor carries no sparse gradient (its
sharding rules have none for ``_sparse_coo_tensor_with_dims_and_tensors``), and a dense one is the
size of the shard at every step. Here the table's parameter is the local shard itself, a plain
tensor ``[local rows, d]``, and backward gives it the sparse COO gradient of the rows this rank
owns (the others are zero here), which recforge's sparse optimizers (sparse SGD,
:class:`recforge.optim.rowwise_adagrad.RowWiseAdagrad`) apply to the touched rows only, keeping
their per-row state with the shard. Backward needs no communication because the gradient reaching
the lookup is the same on every rank of the mesh: they all see the same batch and run the same
dense layers on it (the tensor-parallel half of a data-parallel x table-sharding mesh). The
copies of a shard on other data-parallel ranks, which read other batches, are averaged with it
after backward (:mod:`recforge.distributed.data_parallel`).

The whole table is a DTensor in ``state_dict()`` (``Shard(0)`` of the full shape, the local shard
as its storage), so that torch.distributed.checkpoint saves each rank's rows once and loads them at
another world size; ``load_state_dict`` takes that DTensor, or the whole table as a plain tensor
(a single-process checkpoint), and keeps this rank's rows.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["RowShardedEmbedding", "row_range"]


def row_range(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, end)`` that rank ``rank`` of ``world`` owns: ``torch.chunk``'s split, as
    DTensor's ``Shard(0)`` (``ceil(num_rows / world)`` per rank; the last ranks may hold fewer, or none)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}")
    chunk = -(-num_rows // world)
    start = min(num_rows, rank * chunk)
    return start, min(num_rows, start + chunk)


class _Lookup(torch.autograd.Function):
    """ids ``[...]`` (global rows, the same on every rank) -> ``[..., d]`` on every rank; the
    gradient of this rank's shard is the sparse rows it owns. With ``offsets`` (``[n_bags + 1]``,
    the last one included) the ids are bags' values and each bag is summed: ``[n_bags, d]``."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, start: int, mesh: DeviceMesh, sparse: bool,
                offsets: Tensor | None) -> Tensor:
        local = ids - start
        owned = (local >= 0) & (local < weight.shape[0])
        rows = torch.where(owned, local, torch.zeros_like(local))
        if offsets is None:
            partial = nn.functional.embedding(rows, weight)
            partial.masked_fill_(~owned.unsqueeze(-1), 0.0)
            # gradient row of each id: its own output row
            source = None
        else:
            # a weight of 0 drops another rank's value from its bag's sum here
            partial = nn.functional.embedding_bag(rows, weight, offsets, mode="sum", include_last_offset=True,
                                                  per_sample_weights=owned.to(weight.dtype))
            # gradient row of each value: its bag's output row
            source = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=ids.device),
                                             offsets.diff(), output_size=ids.numel())
        if mesh.size() > 1:
            partial = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(
                mesh, [Replicate()]).to_local()
        ctx.save_for_backward(rows, owned, source)
        ctx.weight_shape, ctx.sparse = weight.shape, sparse
        return partial

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, owned, source = ctx.saved_tensors
        keep = owned.reshape(-1)
        # the unsharded table's sparse gradient restricted to this rank's rows, in the same order
        # (uncoalesced: the optimizer sums duplicates, as for nn.Embedding(sparse=True))
        index = rows.reshape(-1)[keep]
        per_row = grad.reshape(-1, grad.shape[-1])
        values = per_row[keep] if source is None else per_row.index_select(0, source[keep])
        if ctx.sparse:
            weight_grad = torch.sparse_coo_tensor(index.unsqueeze(0), values, ctx.weight_shape,
                                                  check_invariants=False)
        else:
            weight_grad = values.new_zeros(ctx.weight_shape).index_add_(0, index, values)
        return None, weight_grad, None, None, None, None


class RowShardedEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows split across ``mesh`` (1-D).

    ``weight`` is this rank's shard ``[end - start, d]``, rows ``[start, end)`` of the whole
    (:func:`row_range`); uninitialised at construction (the owner fills it). ``forward(ids)``:
    ids ``[...]`` int64 in ``[0, num_embeddings)``, identical on every rank of ``mesh`` ->
    ``[..., d]``, identical on every rank; :meth:`bags` sums bags of ids. ``sparse``: the shard's gradient as sparse COO rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh: DeviceMesh, sparse: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if mesh.ndim != 1:
            raise ValueError(f"a table is sharded over one mesh dimension, got a {mesh.ndim}-D mesh")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.mesh, self.sparse = mesh, bool(sparse)
        self.start, self.end = row_range(self.num_embeddings, mesh.size(), mesh.get_local_rank())
        self.weight = nn.Parameter(torch.empty(self.end - self.start, self.embedding_dim, dtype=dtype, device=device))
        self._register_state_dict_hook(_weight_as_dtensor)
        self._register_load_state_dict_pre_hook(_weight_from_saved, with_module=True)

    def forward(self, ids: Tensor) -> Tensor:
        return _Lookup.apply(ids, self.weight, self.start, self.mesh, self.sparse, None)

    def bags(self, values: Tensor, offsets: Tensor) -> Tensor:
        """Sum-pooled bags, as ``embedding_bag(values, weight, offsets, mode="sum",
        include_last_offset=True)`` over the whole table: ``values [n]`` global rows, ``offsets
        [n_bags + 1]`` -> ``[n_bags, d]`` on every rank. A bag whose rows live on several ranks is
        summed in another order than unsharded (float round-off)."""
        return _Lookup.apply(values, self.weight, self.start, self.mesh, self.sparse, offsets)

    def whole(self, local: Tensor | None = None) -> DTensor:
        """The whole table ``[num_embeddings, d]`` as a DTensor over ``mesh`` whose local part is
        ``local`` (default: the shard itself, no copy)."""
        local = self.weight.detach() if local is None else local
        shape = torch.Size([self.num_embeddings, *local.shape[1:]])
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.end}) of "
                f"{self.mesh.size()} ranks, sparse={self.sparse}")


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def _weight_as_dtensor(module: RowShardedEmbedding, state: dict[str, Any], prefix: str, local_metadata) -> None:
    key = prefix + "weight"
    if key in state and not isinstance(state[key], DTensor):
        state[key] = module.whole(state[key])


def _weight_from_saved(module: RowShardedEmbedding, state: dict[str, Any], prefix: str, *args) -> None:
    """Turn the saved table into this rank's rows: a DTensor (any mesh) or the whole table."""
    key = prefix + "weight"
    if key not in state:
        return
    saved = state[key]
    whole_shape = (module.num_embeddings, module.embedding_dim)
    if tuple(saved.shape) != whole_shape:
        raise ValueError(f"{key}: a table of shape {tuple(saved.shape)} in the checkpoint, "
                         f"{whole_shape} in the model")
    if isinstance(saved, DTensor):
        if saved.device_mesh == module.mesh and tuple(saved.placements) == (Shard(0),):
            state[key] = saved.to_local()
            return
        saved = saved.full_tensor()
    state[key] = saved[module.start:module.end]

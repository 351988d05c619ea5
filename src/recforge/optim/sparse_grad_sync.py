"""Averaging sparse (item-table) gradients across DDP ranks with dense collectives.

DDP's reducer averages a sparse gradient through the process group's sparse all-reduce. Over gloo
(torch 2.13, CPU) that path corrupted the heap in about one training run in four (glibc "malloc():
unaligned tcache chunk detected", segfaults in backward); NCCL has no general sparse all-reduce.
The task therefore keeps its sparse-gradient parameters out of DDP and averages them itself: every
rank all-gathers the others' row indices and values (dense, padded to the largest row count) and
concatenates them. The result is the uncoalesced sum of every rank's gradient divided by the world
size, i.e. DDP's average, with duplicate rows left for the optimizer to sum (as it does anyway).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def sparse_parameter_names(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the weights of its sparse-gradient embeddings (tables
    and bags)."""
    return [
        f"{name}.weight" if name else "weight"
        for name, sub in module.named_modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
    ]


def average_sparse_grads_(params: Iterable[nn.Parameter], group=None) -> None:
    """Replace each parameter's sparse gradient by its average over the ranks of ``group``.

    Every rank must call this with the same parameters in the same order (a collective). A
    parameter without a gradient on this rank takes part with zero rows. Gradients must have one
    sparse dimension (rows), as ``nn.Embedding(sparse=True)`` gives.
    """
    world = dist.get_world_size(group)
    params = list(params)
    local = []
    for p in params:
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            raise ValueError(f"expected a sparse gradient for a parameter of shape {tuple(p.shape)}, got a dense one")
        if grad is None:
            local.append((torch.zeros(0, dtype=torch.long, device=p.device), p.new_zeros((0, *p.shape[1:]))))
        else:
            local.append((grad._indices()[0], grad._values()))
    if not params:
        return
    # one collective for every parameter's row count, then two per parameter for its rows
    count = torch.tensor([rows.shape[0] for rows, _ in local], dtype=torch.long, device=params[0].device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts_by_param = torch.stack(counts).t().tolist()  # [param][rank]
    for p, (rows, values), rank_counts in zip(params, local, counts_by_param):
        longest = max(rank_counts)
        padded_rows = rows.new_zeros(longest)
        padded_rows[: rows.shape[0]] = rows
        padded_values = values.new_zeros((longest, *values.shape[1:]))
        padded_values[: values.shape[0]] = values
        all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
        all_values = [torch.empty_like(padded_values) for _ in range(world)]
        dist.all_gather(all_rows, padded_rows, group=group)
        dist.all_gather(all_values, padded_values, group=group)
        rows = torch.cat([r[:n] for r, n in zip(all_rows, rank_counts)])
        values = torch.cat([v[:n] for v, n in zip(all_values, rank_counts)]) / world
        p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, p.shape, check_invariants=False)

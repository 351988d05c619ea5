"""DLRM's dot interaction (Naumov et al. 2019; spec §2): pairwise dot products of the feature vectors.

With the bottom MLP's output ``dense [B, d]`` and the pooled embeddings ``embeddings [B, F_e, d]``,
stack them as ``T = [dense, e_1, ..., e_Fe]`` (``[B, F, d]``, F = F_e + 1, the dense vector first),
take the Gram matrix ``Z = T Tᵀ`` (``[B, F, F]``) and keep its strictly lower triangle, or with
``itself=True`` the lower triangle including the diagonal, in the reference's order: row by row,
``(1,0), (2,0), (2,1), (3,0), ...`` (``Z[i, j]`` for ``i > j``, i ascending, then j ascending).
The output is ``concat(dense, those values)``: ``[B, d + F(F-1)/2]`` (27 vectors: 351 values) or
``[B, d + F(F+1)/2]`` (378).

``kernel="pytorch"`` is the reference below (the CPU path and the tests' oracle): the same
concatenate, ``bmm``, gather and concatenate as facebookresearch/dlrm's ``interact_features``, so
it reproduces that code to float round-off. ``kernel="triton"``
(:mod:`recforge.kernels.dot_interaction_triton`) fuses the Gram matrix, the triangle gather and the
concatenation into one kernel and its backward into another, without materialising ``T``, ``Z``
or the index tensors. When Triton cannot run it falls back to the reference with one warning per
process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.kernels.twin import KernelImpl, TritonTwin

__all__ = [
    "dot_interaction",
    "dot_interaction_reference",
    "interaction_width",
    "n_pairs",
    "pair_indices",
    "stacked_dot_interaction",
]

TRITON = TritonTwin("recforge.kernels.dot_interaction_triton")


def n_pairs(n_features: int, itself: bool = False) -> int:
    """How many interaction values ``F`` stacked vectors give: ``F(F-1)/2``, or ``F(F+1)/2``."""
    return n_features * (n_features + 1) // 2 if itself else n_features * (n_features - 1) // 2


def interaction_width(dim: int, n_features: int, itself: bool = False) -> int:
    """Output width of :func:`dot_interaction` for ``F`` stacked vectors of width ``dim``."""
    return dim + n_pairs(n_features, itself)


_PAIR_CACHE: dict[tuple[int, bool, torch.device], Tensor] = {}


def pair_indices(n_features: int, itself: bool = False, device: torch.device | str = "cpu") -> Tensor:
    """Flat positions ``i·F + j`` in a row of ``Z`` of the kept pairs, in output order ``[P]`` int64.

    ``torch.tril_indices(F, F, -1)`` (``0`` with ``itself``) walks the triangle row by row, which
    is the reference's order; the flat form lets one ``index_select`` gather them (its backward is
    an ``index_add``, cheaper than advanced indexing's accumulate-put). Cached per device, outside
    ``torch.compile``: traced, the lookup became a guard on the cache's keys that the trace's own
    store then broke, so the first compiled call was always compiled twice; the compiled graph
    computes the indices itself.
    """
    device = torch.device(device)
    if torch.compiler.is_compiling():
        return _pair_positions(n_features, itself, device)
    key = (n_features, bool(itself), device)
    flat = _PAIR_CACHE.get(key)
    if flat is None:
        flat = _pair_positions(n_features, itself, device)
        _PAIR_CACHE[key] = flat
    return flat


def _pair_positions(n_features: int, itself: bool, device: torch.device) -> Tensor:
    rows, cols = torch.tril_indices(n_features, n_features, offset=0 if itself else -1)
    return (rows * n_features + cols).to(device)


def dot_interaction_reference(dense: Tensor, embeddings: Tensor, itself: bool = False) -> Tensor:
    """The PyTorch reference of :func:`dot_interaction` (validated inputs of one dtype)."""
    pairs_at = pair_indices(embeddings.shape[1] + 1, itself, dense.device)
    return stacked_dot_interaction(dense, embeddings, pairs_at)[1]


def stacked_dot_interaction(dense: Tensor, embeddings: Tensor, pairs_at: Tensor) -> tuple[Tensor, Tensor]:
    """The reference's computation: the stacked vectors ``T`` ``[B, F, d]`` and the output
    ``[B, d + P]``, ``pairs_at`` being :func:`pair_indices` of ``F``. ``T`` is what a written-out
    backward reads (recforge.models.dlrm_fused_step)."""
    batch = dense.shape[0]
    stacked = torch.cat([dense.unsqueeze(1), embeddings], dim=1)  # [B, F, d]
    n_features = stacked.shape[1]
    gram = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F, F]
    pairs = gram.reshape(batch, n_features * n_features).index_select(1, pairs_at)
    return stacked, torch.cat([dense, pairs], dim=1)


def _validate(dense: Tensor, embeddings: Tensor) -> None:
    for name, t in (("dense", dense), ("embeddings", embeddings)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if dense.dim() != 2:
        raise ValueError(f"dense must be 2-D [B, d], got shape {tuple(dense.shape)}")
    batch, dim = dense.shape
    if embeddings.dim() != 3 or embeddings.shape[0] != batch or embeddings.shape[2] != dim:
        raise ValueError(
            f"embeddings must be 3-D [B, F, d] = [{batch}, F, {dim}] (dense is [B, d]), got shape "
            f"{tuple(embeddings.shape)}"
        )
    if dim == 0:
        raise ValueError("dense and embeddings need d >= 1 columns")
    if dense.device != embeddings.device:
        raise ValueError(
            f"dense and embeddings must be on one device, got {dense.device} and {embeddings.device}"
        )


def dot_interaction(
    dense: Tensor, embeddings: Tensor, itself: bool = False, kernel: KernelImpl = "pytorch"
) -> Tensor:
    """``concat(dense, lower triangle of T Tᵀ)``, T = ``[dense, embeddings]`` stacked, differentiable
    in both inputs.

    Args:
        dense: ``[B, d]`` the bottom MLP's output (first of the stacked vectors).
        embeddings: ``[B, F_e, d]`` the pooled embeddings, one per categorical feature.
        itself: keep the diagonal ``Z[i, i]`` too (the reference's ``--arch-interaction-itself``).
        kernel: ``"pytorch"`` or ``"triton"``. ``"triton"`` runs the fused kernels on CUDA
            tensors (float32, bfloat16, float16; dot products accumulate in float32), or CPU ones
            under ``TRITON_INTERPRET=1``; otherwise it falls back to ``"pytorch"`` with one warning
            per process.

    Returns:
        ``[B, d + P]`` with ``P = F(F-1)/2`` (``F(F+1)/2`` with ``itself``), ``F = F_e + 1``, in
        the dtype ``torch.cat`` promotes the two inputs to.
    """
    _validate(dense, embeddings)
    itself = bool(itself)
    # the reference's torch.cat promotes mixed inputs (a bf16 MLP output beside fp32 tables under
    # autocast); both twins compute in that one dtype
    dtype = torch.promote_types(dense.dtype, embeddings.dtype)
    dense, embeddings = dense.to(dtype), embeddings.to(dtype)
    return TRITON.dispatch(
        "dot_interaction", kernel, (dense, embeddings),
        triton=lambda module: module.dot_interaction_triton(dense, embeddings, itself),
        reference=lambda: dot_interaction_reference(dense, embeddings, itself),
        layout_reason=lambda module: module.layout_reason(dense, embeddings),
    )

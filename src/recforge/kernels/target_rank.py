"""Rank of a target item among the full catalogue, streamed in chunks.

Full-catalogue evaluation needs, for every query row, how many items score above
the target and how many tie with it. Materialising the ``[B, N]`` score matrix is
infeasible for large catalogues, so the catalogue is streamed in chunks of
``chunk_size`` items and only per-row counts are kept. Turning counts into ranks
(and choosing a tie policy) is left to :func:`recforge.metrics.ranks_from_counts`.

Each row may exclude a jagged list of items (a sequential recommender's filtered history): they are
dropped inside the tiled pass, so an excluded item is compared with nothing and memory stays
``O(B * chunk_size)``.

The code here is the PyTorch reference and the CPU path; ``kernel="triton"`` selects the Triton twin
in :mod:`recforge.kernels.target_rank_triton`, imported lazily so that this module needs only torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.kernels.jagged import jagged_positions
from recforge.kernels.twin import KernelImpl, TritonTwin

__all__ = ["sorted_exclusions", "target_rank_counts", "target_rank_counts_reference"]

TRITON = TritonTwin("recforge.kernels.target_rank_triton")


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    # Half-precision comparisons would create many spurious ties, and bf16 matmul
    # accumulation on CPU is not reliable, so counts are taken in float32.
    if dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _validate(
    queries: Tensor,
    item_weights: Tensor,
    item_bias: Tensor | None,
    targets: Tensor,
    chunk_size: int,
) -> None:
    if queries.dim() != 2:
        raise ValueError(f"queries must be 2-D [B, d], got shape {tuple(queries.shape)}")
    if item_weights.dim() != 2:
        raise ValueError(f"item_weights must be 2-D [N, d], got shape {tuple(item_weights.shape)}")
    if queries.shape[1] != item_weights.shape[1]:
        raise ValueError(
            f"embedding size mismatch: queries {tuple(queries.shape)} has d={queries.shape[1]}, "
            f"item_weights {tuple(item_weights.shape)} has d={item_weights.shape[1]}"
        )
    for name, t in (("queries", queries), ("item_weights", item_weights)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    n_items = item_weights.shape[0]
    if item_bias is not None:
        if item_bias.dim() != 1 or item_bias.shape[0] != n_items:
            raise ValueError(
                f"item_bias must be 1-D [N] with N={n_items}, got shape {tuple(item_bias.shape)}"
            )
        if not item_bias.is_floating_point():
            raise ValueError(f"item_bias must be a floating-point tensor, got dtype {item_bias.dtype}")
    if targets.dim() != 1 or targets.shape[0] != queries.shape[0]:
        raise ValueError(
            f"targets must be 1-D [B] with B={queries.shape[0]}, got shape {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    devices = {queries.device, item_weights.device, targets.device}
    if item_bias is not None:
        devices.add(item_bias.device)
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if targets.numel() > 0:
        # One host sync per call; an out-of-range target would otherwise silently
        # give a wrong rank (it would never be excluded from its own row).
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= n_items:
            raise ValueError(f"targets must lie in [0, {n_items}), got values in [{lo}, {hi}]")


def _validate_exclusions(
    exclude_items: Tensor | None, exclude_offsets: Tensor | None, n_rows: int, n_items: int, device
) -> None:
    if (exclude_items is None) != (exclude_offsets is None):
        names = ("exclude_items", "exclude_offsets")
        given, missing = names if exclude_offsets is None else names[::-1]
        raise ValueError(f"{given} was given without {missing}: pass both or neither")
    if exclude_items is None:
        return
    for name, t in (("exclude_items", exclude_items), ("exclude_offsets", exclude_offsets)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}, the queries on {device}: all inputs must be on one device"
            )
    if exclude_items.dim() != 1:
        raise ValueError(f"exclude_items must be 1-D [E], got shape {tuple(exclude_items.shape)}")
    if exclude_offsets.dim() != 1 or exclude_offsets.shape[0] != n_rows + 1:
        raise ValueError(
            f"exclude_offsets must be 1-D [B+1] with B={n_rows}, got shape {tuple(exclude_offsets.shape)}"
        )
    # A few host syncs per call; a bad offset or id would otherwise read another row's list or
    # out of bounds in the kernel.
    first, last = int(exclude_offsets[0]), int(exclude_offsets[-1])
    if first != 0:
        raise ValueError(f"exclude_offsets[0] must be 0, got {first}")
    if last != exclude_items.shape[0]:
        raise ValueError(
            f"exclude_offsets[-1] must equal len(exclude_items)={exclude_items.shape[0]}, got {last}"
        )
    if n_rows > 0 and bool((exclude_offsets[1:] < exclude_offsets[:-1]).any()):
        row = int((exclude_offsets[1:] < exclude_offsets[:-1]).nonzero()[0, 0])
        raise ValueError(
            f"exclude_offsets must be non-decreasing, got {int(exclude_offsets[row])} then "
            f"{int(exclude_offsets[row + 1])} at positions {row}, {row + 1}"
        )
    if exclude_items.numel() > 0:
        lo, hi = int(exclude_items.min()), int(exclude_items.max())
        if lo < 0 or hi >= n_items:
            raise ValueError(f"exclude_items must lie in [0, {n_items}), got values in [{lo}, {hi}]")


def sorted_exclusions(
    exclude_items: Tensor, exclude_offsets: Tensor, targets: Tensor, n_items: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Canonical form of validated jagged exclusion lists: per row sorted, deduplicated, target dropped.

    Args:
        exclude_items: ``[E]`` integer item ids in ``[0, n_items)``.
        exclude_offsets: ``[B+1]`` integer, row ``b`` owns ``exclude_items[offsets[b]:offsets[b+1]]``.
        targets: ``[B]`` integer; a row's own target is removed from its list (it is always ranked).

    Returns:
        ``(rows, items, offsets)``: ``rows`` and ``items`` ``[E']`` int64 ordered by (row, item) with
        no repeated pair and no ``(b, targets[b])``, and ``offsets`` ``[B+1]`` int64 over them.
    """
    n_rows = targets.shape[0]
    device = targets.device
    items = exclude_items.long()
    offsets = exclude_offsets.long()
    rows, _ = jagged_positions(offsets, items.shape[0])
    keep = items != targets.long()[rows]
    # one int64 key per pair: sorting it orders by row then item, and unique drops duplicates
    # (B * N stays far below 2**63 for any catalogue that fits in memory)
    keys = torch.unique(rows[keep] * n_items + items[keep], sorted=True)
    rows = keys // n_items
    items = keys - rows * n_items
    offsets = torch.zeros(n_rows + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.bincount(rows, minlength=n_rows).cumsum(0)
    return rows, items, offsets


@torch.no_grad()
def target_rank_counts(
    queries: Tensor,
    item_weights: Tensor,
    item_bias: Tensor | None,
    targets: Tensor,
    chunk_size: int = 8192,
    kernel: KernelImpl = "pytorch",
    *,
    exclude_items: Tensor | None = None,
    exclude_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Count catalogue items scoring above / equal to each row's target.

    The score of item ``j`` for row ``i`` is ``queries[i] @ item_weights[j] (+ item_bias[j])``.
    Row ``i`` may exclude items (``exclude_*``): they fall in neither count of that row, whatever
    their score. A row's target is always ranked, even when its own list names it: it still
    counts as its own tie (``n_equal >= 1``), only other items are dropped.

    Args:
        queries: ``[B, d]`` float32 / float64 / bf16 / fp16.
        item_weights: ``[N, d]`` floating point.
        item_bias: ``[N]`` floating point, or ``None``.
        targets: ``[B]`` integer item ids in ``[0, N)``.
        chunk_size: items scored per step; peak extra memory is ``O(B * chunk_size)``
            (the PyTorch path; the Triton kernel picks its own tiles).
        kernel: ``"pytorch"`` or ``"triton"``. ``"triton"`` runs the fused kernel on CUDA
            tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; otherwise (no Triton, CPU
            without the interpreter, float64 inputs) it falls back to ``"pytorch"`` with one
            warning per process.
        exclude_items: ``[E]`` integer item ids in ``[0, N)``, the rows' exclusion lists end to
            end (any order within a row; duplicates count once), or ``None``.
        exclude_offsets: ``[B+1]`` integer, non-decreasing from 0 to ``E``: row ``i`` excludes
            ``exclude_items[exclude_offsets[i]:exclude_offsets[i + 1]]``. Both or neither.

    Returns:
        ``(n_greater, n_equal)``, both ``[B]`` int64: items scoring strictly higher
        than the target, and items scoring exactly equal to it *including the
        target itself* (so ``n_equal >= 1``). Items whose score is NaN fall in
        neither count, and so do a row's excluded items other than its target.
    """
    _validate(queries, item_weights, item_bias, targets, chunk_size)
    _validate_exclusions(
        exclude_items, exclude_offsets, queries.shape[0], item_weights.shape[0], queries.device
    )
    # Mixed precision (trainer.precision=bf16-mixed) evaluates under autocast, whose matmuls would
    # score in bf16 whatever _compute_dtype chose: the counts are taken in that dtype, as the
    # Triton twin takes them
    with torch.autocast(queries.device.type, enabled=False):
        return TRITON.dispatch(
            "target_rank_counts", kernel,
            [t for t in (queries, item_weights, item_bias) if t is not None],
            triton=lambda module: module.target_rank_counts_triton(
                queries, item_weights, item_bias, targets,
                exclude_items=exclude_items, exclude_offsets=exclude_offsets,
            ),
            reference=lambda: _target_rank_counts_chunked(
                queries, item_weights, item_bias, targets, chunk_size, exclude_items, exclude_offsets
            ),
        )


def _target_rank_counts_chunked(
    queries: Tensor,
    item_weights: Tensor,
    item_bias: Tensor | None,
    targets: Tensor,
    chunk_size: int,
    exclude_items: Tensor | None,
    exclude_offsets: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The PyTorch path of :func:`target_rank_counts` on validated inputs, chunk by chunk."""
    dtypes = [queries.dtype, item_weights.dtype]
    if item_bias is not None:
        dtypes.append(item_bias.dtype)
    dtype = _compute_dtype(*dtypes)
    device = queries.device
    n_rows, n_items = queries.shape[0], item_weights.shape[0]
    targets = targets.long()
    q = queries.to(dtype)

    def chunk_scores(start: int, stop: int) -> Tensor:
        # Cast per chunk so a low-precision catalogue is never copied whole.
        scores = q @ item_weights[start:stop].to(dtype).T  # [B, C]
        if item_bias is not None:
            scores = scores + item_bias[start:stop].to(dtype)
        return scores

    # The target's score is read from the same matmul that scores its chunk, so it is
    # bit-identical to how every other item is scored (a separate dot product rounds
    # differently and can split true ties, or break ties the reference keeps). That needs a
    # first pass over the chunks holding targets; a catalogue within one chunk is scored once.
    starts = range(0, n_items, chunk_size)
    single = n_items <= chunk_size
    target_scores = torch.empty(n_rows, dtype=dtype, device=device)
    cached = None
    for start in starts:
        stop = min(start + chunk_size, n_items)
        rows = ((targets >= start) & (targets < stop)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        scores = chunk_scores(start, stop)
        cached = scores if single else None
        target_scores[rows] = scores[rows, targets[rows] - start]
    threshold = target_scores.unsqueeze(1)  # [B, 1]

    # Its own column is still skipped and counted as exactly one tie, so even a NaN target
    # score ranks the target once.
    n_greater = torch.zeros(n_rows, dtype=torch.int64, device=device)
    n_equal = torch.ones(n_rows, dtype=torch.int64, device=device)
    cols = torch.arange(min(chunk_size, max(n_items, 1)), device=device)
    # A chunk's count fits 16 bits (up to 32,767 columns): summing the [B, C] masks into int16
    # casts 2 bytes an element where the default int64 casts 8 (3x faster on CPU; issue 22)
    count_dtype = torch.int16 if cols.numel() <= torch.iinfo(torch.int16).max else torch.int32
    if exclude_items is not None:
        # Excluded pairs are dropped from each chunk's keep mask, next to the target's column, so
        # the comparisons run on the very scores computed for the chunk (no separate scoring that
        # could round differently); pairs ordered by item give each chunk a contiguous slice.
        ex_rows, ex_items, _ = sorted_exclusions(exclude_items, exclude_offsets, targets, n_items)
        order = torch.argsort(ex_items, stable=True)
        ex_rows, ex_items = ex_rows[order], ex_items[order]
        bounds = torch.searchsorted(
            ex_items, torch.tensor([*starts, n_items], dtype=torch.int64, device=device)
        ).tolist()  # [n_chunks + 1], one host sync
    for k, start in enumerate(starts):
        stop = min(start + chunk_size, n_items)
        scores = cached if cached is not None else chunk_scores(start, stop)
        is_target = cols[: stop - start].unsqueeze(0) == (targets - start).unsqueeze(1)  # [B, C]
        keep = ~is_target
        if exclude_items is not None and bounds[k + 1] > bounds[k]:
            pairs = slice(bounds[k], bounds[k + 1])
            keep[ex_rows[pairs], ex_items[pairs] - start] = False
        n_greater += ((scores > threshold) & keep).sum(dim=1, dtype=count_dtype)
        n_equal += ((scores == threshold) & keep).sum(dim=1, dtype=count_dtype)

    return n_greater, n_equal


@torch.no_grad()
def target_rank_counts_reference(scores: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Obvious full-matrix twin of :func:`target_rank_counts` (test oracle).

    Args:
        scores: ``[B, N]`` score matrix.
        targets: ``[B]`` integer item ids in ``[0, N)``.

    Returns:
        ``(n_greater, n_equal)``, both ``[B]`` int64; ``n_equal`` includes the target.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-D [B, N], got shape {tuple(scores.shape)}")
    if targets.dim() != 1 or targets.shape[0] != scores.shape[0]:
        raise ValueError(
            f"targets must be 1-D [B] with B={scores.shape[0]}, got shape {tuple(targets.shape)}"
        )
    target_scores = scores.gather(1, targets.long().unsqueeze(1))  # [B, 1]
    n_greater = (scores > target_scores).sum(dim=1, dtype=torch.int64)
    n_equal = (scores == target_scores).sum(dim=1, dtype=torch.int64)
    return n_greater, n_equal

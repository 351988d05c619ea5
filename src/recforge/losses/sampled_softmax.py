"""Softmax losses over cosine similarities for per-position next-item prediction (SASRec, HSTU).

Spec §1.5, after the generative-recommenders research code (``SampledSoftmaxLoss`` with the
``LocalNegativesSampler``, ``item_l2_norm=True``, ``l2_norm_eps=1e-6``, temperature 0.05):

    s(q, j) = q · e_j / max(‖e_j‖, eps) / temperature
    ℓ_p     = −log softmax([s(q_p, pos_p), s(q_p, neg_p1), …, s(q_p, neg_pR)])[0]
    loss    = Σ_p w_p ℓ_p / Σ_p w_p

with q_p the (already L2-normalised) user vector of position p, e the raw item table, and R
negatives per position drawn uniformly with replacement from the catalogue ``[0, n_items)``. A
negative that equals the position's positive gets the logit −5e4 (the reference's constant,
set after the division by the temperature): exp(−5e4 − max) is 0 in every float format, so it is
exactly "excluded from the softmax", gets no gradient, and stays finite in fp16/bf16 where a
−inf would turn a fully masked row (impossible here: the positive is never masked) into NaN.

Both losses take the *raw* item table so gradients reach it (the same table the encoder reads
its inputs from: the reference's supervision embeddings come from that lookup too).

Inputs (layout ``SEQUENCE_POSITIONS``): queries ``[P, D]``, positives ``[P]`` int64, item_table
``[n_items, D]``, optional weights ``[P]``; the loss is a scalar.
"""
from __future__ import annotations

import warnings
from typing import Annotated, Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from recforge.config_values import Range
from recforge.contracts import SEQUENCE_POSITIONS

HIT_LOGIT = -5e4
"""Logit of a sampled negative equal to its position's positive (the reference's value)."""

# Elements of one chunk's work block in _GatheredDots ([chunk, C, D] gathered rows, or the
# [chunk, n_items] scores of the dense form): ~8 MB in fp32, cache-sized.
_CHUNK_ELEMENTS = 1 << 21
# The dense form scores every item: n_items / C times the multiply-adds of the gathered form, but
# as matrix products, where the gathered form's gradient is a scatter-add of P·C rows of D (on CPU
# about 40M elements/s against some 50 GFLOP/s of matmul). It is chosen while
# n_items <= _DENSE_RATIO · C: ml-1m and ml-20m with 128 negatives, not Amazon Books.
_DENSE_RATIO = 256


class _GatheredDots(torch.autograd.Function):
    """``out[p, c] = queries[p] · table[ids[p, c]]`` without keeping ``[P, C, D]`` around.

    Autograd through ``table[ids]`` followed by a bmm stores the gathered ``[P, C, D]`` block
    (the reference gathers and normalises it: two such blocks, ~60% of an HSTU step, spec §5)
    and builds another in backward. Here both passes walk over row chunks. Two forms of the same
    sums, picked by the table's size against the columns (``_DENSE_RATIO``):

    * gathered: ``[chunk, C, D]`` rows gathered, a batched dot; backward re-gathers for the
      queries' gradient and scatter-adds ``[chunk·C, D]`` rows into the table's;
    * dense: the chunk's scores against the whole table, ``[chunk, n]`` (one matmul), of which the
      ids' columns are taken; backward scatters the gradient into ``[chunk, n]`` (chunk·C adds)
      and multiplies it with the table and the queries (two matmuls).
    """

    @staticmethod
    def forward(
        ctx: Any, queries: torch.Tensor, table: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        n_pos, n_cols = ids.shape
        dense = table.shape[0] <= _DENSE_RATIO * n_cols
        width = table.shape[0] if dense else n_cols * table.shape[1]
        chunk = max(1, _CHUNK_ELEMENTS // max(1, width))
        out = queries.new_empty(n_pos, n_cols)
        for start in range(0, n_pos, chunk):
            stop = min(start + chunk, n_pos)
            if dense:
                torch.gather(queries[start:stop] @ table.T, 1, ids[start:stop], out=out[start:stop])
            else:
                rows = table[ids[start:stop]]  # [c, C, D]
                torch.bmm(rows, queries[start:stop].unsqueeze(2), out=out[start:stop].unsqueeze(2))
        ctx.save_for_backward(queries, table, ids)
        ctx.chunk, ctx.dense = chunk, dense
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        queries, table, ids = ctx.saved_tensors
        n_pos, dim = queries.shape
        grad_q = torch.empty_like(queries) if ctx.needs_input_grad[0] else None
        grad_t = torch.zeros_like(table) if ctx.needs_input_grad[1] else None
        for start in range(0, n_pos, ctx.chunk):
            stop = min(start + ctx.chunk, n_pos)
            g = grad_out[start:stop]  # [c, C]
            if ctx.dense:
                spread = g.new_zeros(stop - start, table.shape[0]).scatter_add_(1, ids[start:stop], g)
                if grad_q is not None:
                    torch.mm(spread, table, out=grad_q[start:stop])
                if grad_t is not None:
                    grad_t.addmm_(spread.T, queries[start:stop])
                continue
            if grad_q is not None:
                rows = table[ids[start:stop]]  # [c, C, D]
                torch.bmm(g.unsqueeze(1), rows, out=grad_q[start:stop].unsqueeze(1))
            if grad_t is not None:
                contrib = g.unsqueeze(2) * queries[start:stop].unsqueeze(1)  # [c, C, D]
                grad_t.index_add_(0, ids[start:stop].reshape(-1), contrib.reshape(-1, dim))
        return grad_q, grad_t, None


def _normalized_rows(
    item_table: torch.Tensor, ids: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, ids into it) where the table's rows are the needed items, L2-normalised.

    Normalising the whole catalogue once costs ``n_items · D``; normalising per use costs one
    row per id. Whole table when it is the smaller (every training batch on the spec's
    datasets), else only the distinct ids (small batches against a big catalogue).
    """
    if item_table.shape[0] <= ids.numel():
        return F.normalize(item_table, dim=-1, eps=eps), ids
    unique, inverse = torch.unique(ids, return_inverse=True)
    return F.normalize(item_table.index_select(0, unique), dim=-1, eps=eps), inverse


def _weighted_mean(per_position: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return per_position.mean()
    weights = weights.to(per_position.dtype)
    return (per_position * weights).sum() / weights.sum()


def _check_inputs(
    queries: torch.Tensor, positives: torch.Tensor, item_table: torch.Tensor
) -> None:
    if queries.dim() != 2 or positives.shape != queries.shape[:1] or item_table.dim() != 2 \
            or item_table.shape[1] != queries.shape[1]:
        raise ValueError(
            f"expected queries [P, D], positives [P], item_table [n_items, D]; got "
            f"{tuple(queries.shape)}, {tuple(positives.shape)}, {tuple(item_table.shape)}"
        )


class SampledSoftmax(nn.Module):
    """Sampled softmax over the positive and R uniform negatives per position (spec §1.5).

    ``forward(queries [P, D], positives [P], item_table [n_items, D], weights=None,
    negatives=None) -> scalar``. Negatives ``[P, R]`` (``[R]`` with ``shared_negatives``) are
    drawn here unless given.

    * ``n_negatives`` R: 128 (ML), 512 (Books) in the reference's final configs.
    * ``shared_negatives=False`` (the reference): R independent draws per position.
      ``True``: one draw of R items serves every position of the call (a cheaper ``[P, D] x
      [D, R]`` product; not the reference's estimator).
    * ``seed``: the owned generator's seed (``manual_seed`` re-seeds, e.g. per DDP rank). The
      generator lives on the device of the positives and its position is in ``state_dict``
      (``_extra_state``), so a resumed run draws what an uninterrupted one would.

    Negatives are scored through :class:`_GatheredDots` (chunked gather + batched dot), never
    holding the gathered ``[P, R, D]`` block.
    """

    consumes = SEQUENCE_POSITIONS

    def __init__(
        self,
        n_negatives: Annotated[int, Range(ge=1)] = 128,
        temperature: Annotated[float, Range(gt=0)] = 0.05,
        l2_norm_eps: Annotated[float, Range(gt=0)] = 1e-6,
        shared_negatives: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.n_negatives = int(n_negatives)
        self.temperature = float(temperature)
        self.l2_norm_eps = float(l2_norm_eps)
        self.shared_negatives = bool(shared_negatives)
        self.seed = int(seed)
        self._generator: torch.Generator | None = None
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ negatives
    def manual_seed(self, seed: int) -> None:
        """Restart the negatives' stream from ``seed``."""
        self.seed = int(seed)
        self._generator = None
        self._pending_state = None

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The generator drawing on ``device`` (created, seeded or restored on first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        g = self._generator
        if g is not None and g.device == device:
            return g
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        pending, self._pending_state = self._pending_state, None
        if pending is not None and pending["rng_state"] is not None:
            if pending["device_type"] == device.type:
                g.set_state(pending["rng_state"])
            else:
                warnings.warn(
                    f"negatives' generator state was saved on {pending['device_type']} but draws "
                    f"now run on {device.type}: restarting the stream from seed {self.seed}",
                    stacklevel=2,
                )
        elif self._generator is not None:
            warnings.warn(
                f"negatives now drawn on {device.type} instead of {self._generator.device.type}: "
                f"restarting the stream from seed {self.seed}",
                stacklevel=2,
            )
        self._generator = g
        return g

    def sample_negatives(
        self, n_positions: int, n_items: int, device: torch.device | str
    ) -> torch.Tensor:
        """Uniform draws with replacement from ``[0, n_items)``: ``[n_positions, R]`` int64
        (``[R]`` with ``shared_negatives``)."""
        size = (self.n_negatives,) if self.shared_negatives else (n_positions, self.n_negatives)
        return torch.randint(0, n_items, size, generator=self.generator(device), device=device)

    def get_extra_state(self) -> dict[str, Any]:
        if self._pending_state is not None:  # loaded, not used yet
            return dict(self._pending_state, seed=self.seed)
        g = self._generator
        return {
            "seed": self.seed,
            "device_type": None if g is None else g.device.type,
            "rng_state": None if g is None else g.get_state(),
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generator = None
        self._pending_state = {
            "device_type": state.get("device_type"),
            "rng_state": state.get("rng_state"),
        }

    # ------------------------------------------------------------------ loss
    def forward(
        self,
        queries: torch.Tensor,
        positives: torch.Tensor,
        item_table: torch.Tensor,
        weights: torch.Tensor | None = None,
        negatives: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """queries ``[P, D]`` (unit rows), positives ``[P]``, item_table ``[n_items, D]`` raw,
        weights ``[P]`` or None (= all 1), negatives ``[P, R']`` / ``[R']`` or None (drawn) ->
        scalar loss."""
        _check_inputs(queries, positives, item_table)
        n_pos = positives.numel()
        if negatives is None:
            negatives = self.sample_negatives(n_pos, item_table.shape[0], positives.device)
        if n_pos == 0:
            return (queries.sum() + item_table.sum()) * 0.0
        if negatives.dim() == 1:  # shared by every position
            ids = torch.cat([positives, negatives])
            table, idx = _normalized_rows(item_table, ids, self.l2_norm_eps)
            pos_rows, neg_rows = table[idx[:n_pos]], table[idx[n_pos:]]
            pos_logits = (queries * pos_rows).sum(dim=1, keepdim=True)
            logits = torch.cat([pos_logits, queries @ neg_rows.T], dim=1)
            hits = positives.unsqueeze(1) == negatives.unsqueeze(0)
        else:
            ids = torch.cat([positives.unsqueeze(1), negatives], dim=1)  # [P, 1 + R]
            table, idx = _normalized_rows(item_table, ids, self.l2_norm_eps)
            # Under autocast the queries may come in bf16/fp16 and the table in fp32: the
            # Function's out= matmuls need one dtype, the wider one (autocast is off inside).
            dtype = torch.promote_types(queries.dtype, table.dtype)
            with torch.autocast(queries.device.type, enabled=False):
                logits = _GatheredDots.apply(queries.to(dtype), table.to(dtype), idx)
            hits = negatives == positives.unsqueeze(1)
        logits = logits / self.temperature
        mask = torch.cat([hits.new_zeros(n_pos, 1), hits], dim=1)
        logits = logits.masked_fill(mask, HIT_LOGIT)
        per_position = torch.logsumexp(logits, dim=1) - logits[:, 0]
        return _weighted_mean(per_position, weights)

    def extra_repr(self) -> str:
        return (f"n_negatives={self.n_negatives}, temperature={self.temperature}, "
                f"shared_negatives={self.shared_negatives}, seed={self.seed}")


class FullSoftmax(nn.Module):
    """Softmax over the whole catalogue, same cosine / temperature as :class:`SampledSoftmax`.

    ``forward(queries [P, D], positives [P], item_table [n_items, D], weights=None) -> scalar``.
    Builds the ``[P, n_items]`` logits: for small catalogues (ml-1m: 3,953 columns).
    """

    consumes = SEQUENCE_POSITIONS

    def __init__(
        self,
        temperature: Annotated[float, Range(gt=0)] = 0.05,
        l2_norm_eps: Annotated[float, Range(gt=0)] = 1e-6,
    ) -> None:
        super().__init__()
        self.temperature = float(temperature)
        self.l2_norm_eps = float(l2_norm_eps)

    def forward(
        self,
        queries: torch.Tensor,
        positives: torch.Tensor,
        item_table: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """queries ``[P, D]``, positives ``[P]``, item_table ``[n_items, D]`` raw, weights ``[P]``
        or None -> scalar loss."""
        _check_inputs(queries, positives, item_table)
        if positives.numel() == 0:
            return (queries.sum() + item_table.sum()) * 0.0
        items = F.normalize(item_table, dim=-1, eps=self.l2_norm_eps)
        logits = queries @ items.T / self.temperature
        per_position = F.cross_entropy(logits, positives, reduction="none")
        return _weighted_mean(per_position, weights)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"

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
# as matrix products, where the gathered form's gradient is a scatter-add of P·C rows of D. It is
# chosen (where the sparse form is not) while n_items <= _DENSE_RATIO · C.
_DENSE_RATIO = 256
# The sparse form's devices and dtypes: torch's CSR kernels (sampled_addmm, CSR @ dense) on the CPU
# in fp32/fp64. There it beats both other forms at every catalogue size (issue 17: with P = 11.8k
# positions, C = 129, D = 256 on 2 cores, forward + backward ~0.55 s against the dense form's ~8.4 s
# at ml-20m's 27,278 items and ~1.1 s at 3,410; the dense form grows with n_items).
_SPARSE_DEVICES = ("cpu",)
_SPARSE_DTYPES = (torch.float32, torch.float64)
# Tests force one form ("gathered", "dense" or "sparse") through this; None = chosen by _form.
_FORCE_FORM: str | None = None


def _form(table: torch.Tensor, n_cols: int) -> str:
    """Which of _GatheredDots' forms scores ``n_cols`` ids per row against ``table``.

    The sparse form needs more table rows than ids per row: torch 2.13's CPU ``sampled_addmm``
    raises (``torch.copy_: only sparse compressed tensors with the same number of specified
    elements``) on a pattern with more entries than its dense shape has, which only a catalogue
    smaller than the negatives per position makes (tests' toy tables); such tables get the dense
    or gathered form even where ``_FORCE_FORM`` asks for the sparse one.
    """
    sparse_ok = table.shape[0] > n_cols
    if _FORCE_FORM is not None and (_FORCE_FORM != "sparse" or sparse_ok):
        return _FORCE_FORM
    if sparse_ok and table.device.type in _SPARSE_DEVICES and table.dtype in _SPARSE_DTYPES:
        return "sparse"
    return "dense" if table.shape[0] <= _DENSE_RATIO * n_cols else "gathered"


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A CSR matrix from its parts, without torch's one-off "CSR support is in beta" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


def _transposed_csr(ids: torch.Tensor, values: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``S^T`` as CSR ``[n_rows, P]``, where ``S [P, n_rows]`` holds ``values[p, c]`` at
    ``(p, ids[p, c])`` (repeated ids stay separate entries: a product sums them)."""
    n_pos, n_cols = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by item, positions ascending within one
    crow = torch.zeros(n_rows + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(torch.bincount(flat, minlength=n_rows), 0, out=crow[1:])
    positions = torch.div(order, n_cols, rounding_mode="floor")
    return _csr(crow, positions, values.reshape(-1)[order], (n_rows, n_pos))


class _GatheredDots(torch.autograd.Function):
    """``out[p, c] = queries[p] · table[ids[p, c]]`` without keeping ``[P, C, D]`` around.

    Autograd through ``table[ids]`` followed by a bmm stores the gathered ``[P, C, D]`` block
    (the reference gathers and normalises it: two such blocks, ~60% of an HSTU step, spec §5)
    and builds another in backward. Three forms of the same sums (``_form`` picks one):

    * sparse (CPU, fp32/fp64): ``S`` is the ``[P, n]`` CSR pattern with C entries per row at the
      ids' columns. Forward: ``sampled_addmm`` computes only those ``P·C`` dot products.
      Backward: the gradient on that pattern, ``grad_q = S_g @ table`` and
      ``grad_table = S_g^T @ queries`` (two sparse-dense products, ``P·C·D`` multiply-adds
      each, nothing of size ``P·n``);
    * gathered: row chunks, ``[chunk, C, D]`` rows gathered, a batched dot; backward re-gathers
      for the queries' gradient and scatter-adds ``[chunk·C, D]`` rows into the table's;
    * dense: the chunk's scores against the whole table, ``[chunk, n]`` (one matmul), of which the
      ids' columns are taken; backward scatters the gradient into ``[chunk, n]`` (chunk·C adds)
      and multiplies it with the table and the queries (two matmuls): ``n / C`` times the
      multiply-adds, so its cost grows with the catalogue.

    :func:`_gathered_dots_reference` is the plain autograd twin all three are tested against.
    """

    @staticmethod
    def forward(
        ctx: Any, queries: torch.Tensor, table: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        n_pos, n_cols = ids.shape
        form = _form(table, n_cols)
        ctx.save_for_backward(queries, table, ids)
        ctx.form = form
        if form == "sparse":
            ctx.chunk = n_pos
            if n_pos == 0 or n_cols == 0:
                return queries.new_zeros(n_pos, n_cols)
            crow = torch.arange(0, n_pos * n_cols + 1, n_cols, dtype=torch.int64, device=ids.device)
            pattern = _csr(crow, ids.reshape(-1), queries.new_zeros(n_pos * n_cols), (n_pos, table.shape[0]))
            scores = torch.sparse.sampled_addmm(pattern, queries.contiguous(), table.T, beta=0.0)
            return scores.values().view(n_pos, n_cols)
        dense = form == "dense"
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
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        queries, table, ids = ctx.saved_tensors
        n_pos, dim = queries.shape
        if ctx.form == "sparse":
            return _sparse_dots_backward(ctx.needs_input_grad, grad_out, queries, table, ids)
        grad_q = torch.empty_like(queries) if ctx.needs_input_grad[0] else None
        grad_t = torch.zeros_like(table) if ctx.needs_input_grad[1] else None
        for start in range(0, n_pos, ctx.chunk):
            stop = min(start + ctx.chunk, n_pos)
            g = grad_out[start:stop]  # [c, C]
            if ctx.form == "dense":
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


def _sparse_dots_backward(
    needs: tuple[bool, ...], grad_out: torch.Tensor, queries: torch.Tensor, table: torch.Tensor,
    ids: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """The sparse form's gradients: ``S_g @ table`` and ``S_g^T @ queries``."""
    n_pos, n_cols = ids.shape
    grad_out = grad_out.contiguous()
    if n_pos == 0 or n_cols == 0:
        return (torch.zeros_like(queries) if needs[0] else None,
                torch.zeros_like(table) if needs[1] else None, None)
    grad_q = grad_t = None
    if needs[0]:
        crow = torch.arange(0, n_pos * n_cols + 1, n_cols, dtype=torch.int64, device=ids.device)
        spread = _csr(crow, ids.reshape(-1), grad_out.reshape(-1), (n_pos, table.shape[0]))
        grad_q = spread @ table.contiguous()
    if needs[1]:
        grad_t = _transposed_csr(ids, grad_out, table.shape[0]) @ queries.contiguous()
    return grad_q, grad_t, None


def _gathered_dots_reference(queries: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The plain autograd twin of :class:`_GatheredDots`: gather ``[P, C, D]``, multiply, sum."""
    return (table[ids] * queries.unsqueeze(1)).sum(dim=-1)


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

    Negatives are scored through :class:`_GatheredDots` (on the CPU the ``P·(1 + R)`` dot products
    on a sparse pattern, elsewhere chunked gathers or products), never holding the gathered
    ``[P, R, D]`` block.
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

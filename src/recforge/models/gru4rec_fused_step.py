"""GRU4Rec's fast training step with its whole backward written out (``task.fast_step=true``).

On a CPU the fast step's time is mostly not arithmetic: a B=32 step is some 40 MFLOP, and autograd
records and replays about forty nodes, each several ATen calls (issue 18). For the published
configuration (the shared embedding, one ``nn.GRUCell`` layer, sparse item tables, a loss with a
written-out gradient: cross-entropy or BPR-max) this module computes the step's loss *and* every
parameter's gradient in one autograd node, from the formulas below, in a third of the calls.
:meth:`recforge.models.gru4rec.GRU4Rec.train_step` with ``distinct_rows=True`` is its twin (the
same function through autograd); the two agree to float round-off (tests/gru4rec/test_fused_step.py).

Forward, with ``rows`` the distinct table rows the step reads and ``W = Wy[rows]``, ``b = By[rows]``:

    x = W[input rows] ⊙ m_e                                 (embedding dropout mask m_e, scaled)
    [i_r, i_z, i_n] = x·W_ihᵀ + b_ih,  [h_r, h_z, h_n] = h·W_hhᵀ + b_hh
    r = σ(i_r + h_r),  z = σ(i_z + h_z),  n = tanh(i_n + r ⊙ h_n),  h' = (h − n) ⊙ z + n
    o = h' ⊙ m_h;  S = o·Wᵀ + bᵀ  [B, U];  the loss reads S's columns ``S[:, column rows]`` [B, C]

Backward from the loss's gradient G [B, C] (the state ``h`` carried in is detached):

    dS = G summed into its columns' rows [B, U];  dW = dSᵀ·o;  db = Σ_rows dS;  do = dS·W
    dh' = do ⊙ m_h;  dn = dh' ⊙ (1 − z);  dz = dh' ⊙ (h − n);  da_n = dn ⊙ (1 − n²)
    da_r = (da_n ⊙ h_n) ⊙ r(1 − r);  da_z = dz ⊙ z(1 − z)
    dgi = [da_r, da_z, da_n],  dgh = [da_r, da_z, da_n ⊙ r]
    dW_ih = dgiᵀ·x,  db_ih = Σ dgi,  dW_hh = dghᵀ·h,  db_hh = Σ dgh
    dW[input rows] += (dgi·W_ih) ⊙ m_e

``Wy`` and ``By`` get sparse gradients over distinct, sorted rows (``By``'s over the scored rows
only, as the autograd step's: a row that is only an input has no bias in any score), flagged
coalesced for the optimizer as :func:`recforge.models.row_lookup.unique_row_lookup` flags them.
Dropout masks are drawn as ``F.dropout`` draws them (one ``bernoulli_`` of the same shape), so a
seeded run drops the same elements in both twins.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from recforge.models.row_lookup import distinct_rows_gradient, watch_distinct_rows

ValueAndGrad = Callable[[Tensor], tuple[Tensor, Tensor]]


def _dropout_mask(like: Tensor, p: float, training: bool) -> Tensor | None:
    """F.dropout's scaled keep mask (the same generator calls), None where nothing drops."""
    if not training or p == 0.0:
        return None
    if p == 1.0:
        return torch.zeros_like(like)
    return torch.empty_like(like).bernoulli_(1.0 - p).div_(1.0 - p)


class _FusedStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wy: Tensor, by: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor,
                items: Tensor, hidden: Tensor, columns: Tensor, value_and_grad: ValueAndGrad,
                p_embed: float, p_hidden: float, training: bool) -> tuple[Tensor, Tensor]:
        n_in, h = len(items), w_hh.shape[1]
        rows, inverse = torch.unique(torch.cat([items, columns]), sorted=True, return_inverse=True)
        in_rows, column_rows = inverse[:n_in], inverse[n_in:]
        weights = wy.index_select(0, rows)
        bias = by.index_select(0, rows)
        x = weights.index_select(0, in_rows)
        embed_mask = _dropout_mask(x, p_embed, training)
        if embed_mask is not None:
            x = x * embed_mask
        gi = torch.addmm(b_ih, x, w_ih.t())
        gh = torch.addmm(b_hh, hidden, w_hh.t())
        rz = torch.sigmoid_(gi[:, : 2 * h] + gh[:, : 2 * h])
        r, z = rz[:, :h], rz[:, h:]
        h_n = gh[:, 2 * h :]
        n = torch.tanh_(torch.addcmul(gi[:, 2 * h :], r, h_n))
        new_hidden = (hidden - n).mul_(z).add_(n)  # ATen's gru_cell, in its order
        hidden_mask = _dropout_mask(new_hidden, p_hidden, training)
        output = new_hidden if hidden_mask is None else new_hidden * hidden_mask
        scores = torch.addmm(bias.t(), output, weights.t()).index_select(1, column_rows)
        loss, grad_scores = value_and_grad(scores)
        ctx.save_for_backward(rows, in_rows, column_rows, weights, x, hidden, output, r, z, n, h_n, w_ih,
                              grad_scores, embed_mask, hidden_mask)
        ctx.shapes = wy.shape, by.shape
        ctx.tables = weakref.ref(wy), weakref.ref(by)
        ctx.mark_non_differentiable(output)
        return loss, output

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_state: Tensor | None):
        (rows, in_rows, column_rows, weights, x, hidden, output, r, z, n, h_n, w_ih, grad_scores, embed_mask,
         hidden_mask) = ctx.saved_tensors
        wy_shape, by_shape = ctx.shapes
        grad_columns = grad_scores * grad_loss
        d_scores = grad_columns.new_zeros(len(output), len(rows)).index_add_(1, column_rows, grad_columns)
        d_weights = d_scores.t().mm(output)
        d_bias = d_scores.sum(0)
        d_new = d_scores.mm(weights)
        if hidden_mask is not None:
            d_new.mul_(hidden_mask)
        d_a_n = d_new * (1.0 - z) * (1.0 - n * n)
        d_a_r = d_a_n * h_n * r * (1.0 - r)
        d_a_z = d_new * (hidden - n) * z * (1.0 - z)
        d_gi = torch.cat([d_a_r, d_a_z, d_a_n], dim=1)
        d_gh = torch.cat([d_a_r, d_a_z, d_a_n * r], dim=1)
        d_x = d_gi.mm(w_ih)
        if embed_mask is not None:
            d_x.mul_(embed_mask)
        d_weights.index_add_(0, in_rows, d_x)
        # positions in `rows` of the scored rows, ascending (so their rows stay sorted)
        scored = rows.new_zeros(len(rows), dtype=torch.bool).index_fill_(0, column_rows, True).nonzero().squeeze(1)
        wy, by = (table() for table in ctx.tables)
        grad_wy = distinct_rows_gradient(wy, rows, d_weights, wy_shape)
        grad_by = distinct_rows_gradient(by, rows.index_select(0, scored), d_bias.index_select(0, scored).unsqueeze(1),
                                         by_shape)
        return (grad_wy, grad_by, d_gi.t().mm(x), d_gh.t().mm(hidden), d_gi.sum(0), d_gh.sum(0),
                None, None, None, None, None, None, None)


def fused_train_step(model, items: Tensor, hidden: Tensor, columns: Tensor,
                     value_and_grad: ValueAndGrad) -> tuple[Tensor, Tensor]:
    """The loss of one fast step and the new hidden state ``[B, h]`` (detached): ``model`` a
    :class:`recforge.models.gru4rec.GRU4Rec` whose ``fused_step_supported`` holds, ``items [B]``,
    ``hidden [B, h]``, ``columns [C]`` (targets then negatives), ``value_and_grad`` the loss of
    the scores ``[B, C]`` and its gradient (``SampledLoss.fast_value_and_grad`` bound to the batch)."""
    cell = model.cells[0]
    wy, by = model.Wy.weight, model.By.weight
    watch_distinct_rows(wy)
    watch_distinct_rows(by)
    return _FusedStep.apply(
        wy, by, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh, items, hidden.detach(), columns,
        value_and_grad, float(model.dropout_p_embed), float(model.dropout_p_hidden), model.training,
    )

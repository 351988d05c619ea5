"""DLRM's fast training step: forward and backward written out, plain SGD applied in the backward
(``task.fast_step=true``).

At the Kaggle configuration's batch of 128 a CPU step is two thirds the MLPs' matrix products, which
any float32 code must run; the rest is autograd's graph, the weight gradients written out and read
back by SGD, a sparse gradient tensor for the table and SGD's Python loop (issue 18;
benchmarks/README.md). As TorchRec fuses the tables' optimizer into their backward, this step
applies SGD without materialising any weight's gradient:

* the loss's forward (:func:`_step_body`) computes the loss and, for a loss gradient of 1, every
  Linear's output gradient ``dY`` (with ``dX = dY·W``, through ReLU's mask, down the layers), every
  bias gradient ``Σ dY`` and the looked-up table rows' gradient. It changes no parameter;
* the interaction's backward there is one ``bmm``: with the pairs' gradient G laid into the
  symmetric matrix ``S = G + Gᵀ`` ([B, F, F], the diagonal doubled with ``itself``), ``dT = S·T``;
* the loss's backward is the update, scaled by ``−lr·g`` (g the loss's upstream gradient): each
  weight ``W ← W − lr·g·dYᵀX`` as one ``addmm_`` into it, each bias, and the table rows
  ``E[ids] ← E[ids] − lr·g·dE``, a row looked up twice updated twice (``index_put_(accumulate=True)``,
  serial on the CPU, so the order is fixed).

Forward, for the dot interaction with ``T = [h, e_1, ..., e_Fe]`` ([B, F, d]):

    h = relu(... relu(dense·W_1ᵀ + b_1) ...)            (the bottom MLP, ReLU after every layer)
    x = [h, lower triangle of T·Tᵀ]                      (dot_interaction_reference's ops)
    logit = W_Lᵀ relu(... relu(x·W_1'ᵀ + b_1') ...) + b_L (the top MLP, the last Linear bare)
    loss = mean BCE(logit, y)                            (BinaryCrossEntropy), dlogit = (σ(logit) − y) / B

The loss and the updated parameters agree with the same model's autograd step followed by
``torch.optim.SGD`` to float round-off (tests/dlrm/test_dlrm_fused_step.py): the forward runs the
same operations, so from the same weights the loss is the same bit for bit; an update skips the
rounded gradient in between, so the weights part by round-off from the first update on.

With ``model.compile=true`` the forward is one ``torch.compile`` graph (the loss and the whole
gradient chain, which leaves inductor the elementwise work to fuse and the Python between
operators to drop), compiled on the first step.

The parameters get no ``.grad``: the optimizer object only holds the learning rates (the dense
group's and the tables'), read when the backward runs, so schedulers act on them as usual.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from recforge.errors import UserInputError
from recforge.kernels.dot_interaction import pair_indices, stacked_dot_interaction

__all__ = ["fused_sgd_step_loss", "fused_step_unsupported", "symmetric_pair_gather"]

# (dense layers' lr, tables' lr), read at backward time
Rates = Callable[[], tuple[float, float]]

_GATHER_CACHE: dict[tuple[int, int, bool, torch.device], Tensor] = {}


def symmetric_pair_gather(n_features: int, width: int, itself: bool, device: torch.device | str = "cpu") -> Tensor:
    """Columns that lay the pairs' gradient into the symmetric ``[F, F]`` matrix, ``[F·F]`` int64.

    The gradient of the interaction's output ``[B, width + P]`` is left-padded with one zero
    column; position ``i·F + j`` of ``S`` reads the padded column of pair ``(i, j)`` or ``(j, i)``
    (``width + 1 + k`` for the k-th pair in output order) and column 0 (zero) where no pair is kept
    (the diagonal without ``itself``). One ``index_select`` builds ``S`` for the whole batch."""
    device = torch.device(device)
    key = (n_features, width, bool(itself), device)
    gather = _GATHER_CACHE.get(key)
    if gather is None:
        rows, cols = torch.tril_indices(n_features, n_features, offset=0 if itself else -1)
        column = torch.arange(rows.numel()) + width + 1
        gather = torch.zeros(n_features * n_features, dtype=torch.int64)
        gather[rows * n_features + cols] = column
        gather[cols * n_features + rows] = column
        gather = gather.to(device)
        _GATHER_CACHE[key] = gather
    return gather


def _plain_linears(mlp: nn.Sequential, ends_bare: bool) -> list[nn.Linear] | None:
    """The Linears of ``Linear, ReLU, Linear, ReLU, ...`` (the last ReLU absent with ``ends_bare``),
    or None where the stack holds anything else (batch norm, dropout)."""
    layers = list(mlp)
    expected = [nn.Linear if k % 2 == 0 else nn.ReLU for k in range(len(layers))]
    if [type(layer) for layer in layers] != expected or (len(layers) % 2 == 1) != ends_bare:
        return None
    return layers[::2]


def fused_step_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the fused step (one clause, naming the setting), or None."""
    from recforge.models.dlrm import DLRM

    if not isinstance(model, DLRM):
        return f"the model is {type(model).__name__}, not recforge.models.dlrm.DLRM"
    if model.interaction_kind != "dot":
        return f"model.interaction={model.interaction_kind} (the fused step writes out the dot interaction only)"
    if model.interaction.kernel != "pytorch":
        return f"model.dot_interaction.kernel={model.interaction.kernel} (the fused step is the PyTorch path)"
    if _plain_linears(model.dense_arch.mlp, ends_bare=False) is None:
        return "model.dense_arch_batch_norm or dense_arch_dropout is set (the fused step has Linear and ReLU only)"
    if _plain_linears(model.over_arch.mlp, ends_bare=True) is None:
        return "model.over_arch_batch_norm or over_arch_dropout is set (the fused step has Linear and ReLU only)"
    if model.sparse_arch.is_sharded:
        return "the tables are sharded (hardware=model_parallel*)"
    return None


def _step_body(dense: Tensor, ids: Tensor, labels: Tensor, table: Tensor, bottom: list[tuple[Tensor, Tensor]],
               top: list[tuple[Tensor, Tensor]], pairs_at: Tensor, symmetric_at: Tensor, n_sparse: int, itself: bool):
    """The loss, and every gradient the update needs but the weights' own: each Linear's output
    gradient and input (the update's ``dYᵀX`` is left to the backward, as one ``addmm_`` into the
    weight), each bias gradient and the looked-up table rows' gradient, for a loss gradient of 1.
    No parameter is changed here: the updates wait for the backward, which scales these by
    ``−lr·g``."""
    batch, dim = dense.shape[0], table.shape[1]
    embeddings = table.index_select(0, ids).view(batch, n_sparse, dim)
    inputs_bottom = [dense]  # each Linear's input; the last entry is the bottom output h
    for weight, bias in bottom:
        inputs_bottom.append(torch.addmm(bias, inputs_bottom[-1], weight.t()).clamp_min_(0))
    h = inputs_bottom.pop()
    stacked, interaction = stacked_dot_interaction(h, embeddings, pairs_at)  # the reference's operations
    n_features = stacked.shape[1]
    inputs_top = [interaction]
    for k, (weight, bias) in enumerate(top):
        out = torch.addmm(bias, inputs_top[-1], weight.t())
        inputs_top.append(out.clamp_min_(0) if k < len(top) - 1 else out)
    logits = inputs_top.pop().view(-1)
    loss = F.binary_cross_entropy_with_logits(logits, labels)
    # backward, for a loss gradient of 1
    grad = (torch.sigmoid(logits) - labels).div_(batch).unsqueeze(1)  # [B, 1]
    grads_top, grad = _linears_backward(top, inputs_top, grad, first_needs_input_grad=True)
    # the interaction: x = [h, pairs]; dT = (G + Gᵀ)·T with G the pairs' gradient
    symmetric = F.pad(grad, (1, 0)).index_select(1, symmetric_at).view(batch, n_features, n_features)
    if itself:
        symmetric = symmetric + torch.diag_embed(symmetric.diagonal(dim1=1, dim2=2))
    grad_stacked = torch.bmm(symmetric, stacked)
    grad_rows = grad_stacked[:, 1:].reshape(-1, dim)
    grad_h = _relu_backward(grad_stacked[:, 0] + grad[:, :dim], h)
    grads_bottom, _ = _linears_backward(bottom, inputs_bottom, grad_h, first_needs_input_grad=False)
    return loss, grads_top, grads_bottom, grad_rows, inputs_top, inputs_bottom


def _linears_backward(layers: list[tuple[Tensor, Tensor]], inputs: list[Tensor], grad: Tensor,
                      first_needs_input_grad: bool) -> tuple[list[tuple[Tensor, Tensor]], Tensor | None]:
    """Back through ``layers`` (each followed by a ReLU but the last) from the last one's output
    gradient ``grad``: each layer's ``(output gradient, bias gradient)`` in layer order, and the
    first layer's input gradient (None unless ``first_needs_input_grad``)."""
    grads: list[tuple[Tensor, Tensor]] = []
    for k in range(len(layers) - 1, -1, -1):
        (weight, _), x = layers[k], inputs[k]
        grads.append((grad, grad.sum(0)))
        grad_x = grad @ weight if k > 0 or first_needs_input_grad else None
        grad = _relu_backward(grad_x, x) if k > 0 else grad_x  # x: the previous layer's ReLU output
    return grads[::-1], grad


def _relu_backward(grad: Tensor, relu_output: Tensor) -> Tensor:
    # one ATen kernel (ReLU's own backward), where grad * (output > 0) is three: compare, cast, multiply
    return torch.ops.aten.threshold_backward(grad, relu_output, 0)


# Compiled once per process, on first use (model.compile=true); the graph is torch.compile's to
# keep and guard (a new batch size compiles once more, then the batch dimension is dynamic).
_COMPILED: dict[str, Callable] = {}


def _step(compiled: bool) -> Callable:
    if not compiled:
        return _step_body
    if "step" not in _COMPILED:
        _COMPILED["step"] = torch.compile(_step_body)
    return _COMPILED["step"]


class _FusedSGDStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model: nn.Module, dense: Tensor, sparse: Tensor, labels: Tensor, rates: Rates,
                anchor: Tensor) -> Tensor:
        bottom = [(layer.weight, layer.bias) for layer in _plain_linears(model.dense_arch.mlp, ends_bare=False)]
        top = [(layer.weight, layer.bias) for layer in _plain_linears(model.over_arch.mlp, ends_bare=True)]
        table = model.sparse_arch.embedding.weight
        ids = (sparse + model.sparse_arch.offsets).reshape(-1)
        n_features, itself = model.n_sparse + 1, model.interaction.itself
        loss, grads_top, grads_bottom, grad_rows, inputs_top, inputs_bottom = _step(model.compile_dense)(
            dense, ids, labels.to(dense.dtype), table, bottom, top, pair_indices(n_features, itself, dense.device),
            symmetric_pair_gather(n_features, model.embedding_dim, itself, dense.device), model.n_sparse, itself)
        ctx.state = (table, ids, grad_rows, [*bottom, *top], [*grads_bottom, *grads_top],
                     [*inputs_bottom, *inputs_top], rates)
        return loss

    @staticmethod
    @torch.no_grad()
    def backward(ctx, grad_loss: Tensor):
        table, ids, grad_rows, layers, grads, inputs, rates = ctx.state
        ctx.state = None
        lr_dense, lr_table = rates()
        scale = float(grad_loss)
        for (weight, bias), (grad, grad_bias), x in zip(layers, grads, inputs):
            weight.addmm_(grad.t(), x, alpha=-lr_dense * scale)
            bias.add_(grad_bias, alpha=-lr_dense * scale)
        table.index_put_((ids,), grad_rows.mul(-lr_table * scale), accumulate=True)
        return (None,) * len(ctx.needs_input_grad)


def fused_sgd_step_loss(model: nn.Module, dense: Tensor, sparse: Tensor, labels: Tensor, rates: Rates) -> Tensor:
    """The mean BCE of ``model`` on one batch, whose backward applies SGD to every parameter.

    Args:
        model: a :class:`recforge.models.dlrm.DLRM` that :func:`fused_step_unsupported` accepts.
        dense: ``[B, n_dense]`` float; sparse: ``[B, n_sparse]`` int64, one id per feature
            (checked against the tables as the model's forward checks them); labels: ``[B]``.
        rates: returns ``(dense layers' lr, tables' lr)``, called once in the backward.

    Returns:
        The loss, a scalar; its ``backward()`` updates the parameters in place and leaves their
        ``.grad`` untouched (None after ``zero_grad(set_to_none=True)``).
    """
    if not torch.is_grad_enabled():  # no backward will follow: the loss alone, through the model (its checks)
        return F.binary_cross_entropy_with_logits(model(dense, sparse), labels.to(dense.dtype))
    if not isinstance(sparse, Tensor):
        raise UserInputError(
            f"task.fast_step=true takes one id per feature ([B, n_sparse] ids), got {type(sparse).__name__} "
            "(multi-hot bags take the autograd step: task.fast_step=false)")
    if torch.is_autocast_enabled(dense.device.type):
        raise UserInputError(
            "task.fast_step=true computes in the parameters' dtype, and autocast is on (trainer.precision=...-mixed): "
            "set task.fast_step=false or a full precision")
    model.check_inputs(dense, sparse)
    model.sparse_arch._check_ids(sparse)
    if model.sparse_arch._draw_from is not None:
        raise RuntimeError("a lazy table is drawn in shard_rows (the task's configure_model) first")
    # One parameter puts the node on the graph (its backward is what updates them all, in place);
    # passing all of them would only add edges the backward leaves empty.
    anchor = model.over_arch.mlp[0].weight
    return _FusedSGDStep.apply(model, dense, sparse, labels, rates, anchor)

"""GRU4Rec (Hidasi et al. 2016; Hidasi & Karatzoglou 2018): a GRU over the items of a session.

Plain nn.Module, no Lightning. The task feeds one step at a time (session-parallel, no BPTT) and
scores either a few item columns (training: targets + negatives) or the whole catalogue in tiles
(evaluation, through ``item_weights``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Literal

import torch
from torch import nn
from torch.nn import functional as F

from recforge.config_values import Range
from recforge.contracts import SessionModel
from recforge.errors import UserInputError
from recforge.models.gru4rec_fused_step import fused_train_step
from recforge.models.row_lookup import shared_row_lookup, unique_row_lookup


def _uniform_(tensor: torch.Tensor, fan_in: int, fan_out: int) -> None:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        tensor.uniform_(-bound, bound)


class _SingleBiasGRU(nn.Module):
    """The original GRU formulation (Theano GRU4Rec; Cho et al. "version 1"), shared by its cells.

    One input-side bias of size 3h and no recurrent bias; the input projection ``a = x·Wx + b`` and
    the recurrent weights ``Wh = [U_h | U_r | U_z]`` are both laid out as blocks
    [candidate | reset | update]:

        r = σ(a_r + h·U_r),  z = σ(a_z + h·U_z),  ĥ = tanh((r ⊙ h)·U_h + a_c),
        h' = (1 - z) ⊙ h + z ⊙ ĥ

    Unlike nn.GRUCell, r scales h *before* U_h and z gates the candidate, not the old state.
    Subclasses own ``Wx`` (how the input is projected) and call :meth:`_gates`.
    """

    hidden_size: int
    bias: nn.Parameter
    Wh: nn.Parameter

    def _input_weight(self) -> torch.Tensor:
        """The input weights as ``[fan_in, 3h]`` (for the per-block init)."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Uniform ±sqrt(6/(fan_in+fan_out)) per gate block, zero bias (spec §1.7)."""
        h = self.hidden_size
        wx = self._input_weight()
        # Input and recurrent blocks interleaved per gate: the draw order seeded runs depend on.
        for k in range(3):
            _uniform_(wx[:, k * h : (k + 1) * h], wx.shape[0], h)
            _uniform_(self.Wh[:, k * h : (k + 1) * h], h, h)
        nn.init.zeros_(self.bias)

    def _gates(self, a: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """a = x·Wx + b ``[B, 3h]``, hidden ``[B, h]`` -> new hidden ``[B, h]``."""
        h = self.hidden_size
        a_c, a_r, a_z = a[:, :h], a[:, h : 2 * h], a[:, 2 * h :]
        # r and z from one matmul over the [U_r | U_z] half.
        u = hidden @ self.Wh[:, h:]
        r = torch.sigmoid(a_r + u[:, :h])
        z = torch.sigmoid(a_z + u[:, h:])
        candidate = torch.tanh((r * hidden) @ self.Wh[:, :h] + a_c)
        return (1.0 - z) * hidden + z * candidate


class OneHotGRUCell(_SingleBiasGRU):
    """First GRU layer fed by a one-hot item vector, in the original single-bias formulation.

    Multiplying a one-hot vector by the input weights selects a row, so the input side is a sparse
    row lookup ``Wx[item] + b`` (``[B, 3h]``, blocks [candidate | reset | update]), and only the
    rows of the items in the mini-batch receive gradient.
    """

    def __init__(self, n_items: int, hidden_size: int, sparse: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.Wx = nn.Embedding(n_items, 3 * hidden_size, sparse=sparse)
        self.bias = nn.Parameter(torch.zeros(3 * hidden_size))
        self.Wh = nn.Parameter(torch.empty(hidden_size, 3 * hidden_size))
        self.reset_parameters()

    def _input_weight(self) -> torch.Tensor:
        return self.Wx.weight

    def forward(self, items: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """items ``[B]``, hidden ``[B, h]`` -> new hidden ``[B, h]``."""
        return self._gates(self.Wx(items) + self.bias, hidden)


class OriginalGRUCell(_SingleBiasGRU):
    """A dense-input GRU cell in the original single-bias formulation; a drop-in for nn.GRUCell.

    Called like nn.GRUCell, ``(x [B, input_size], h [B, hidden_size]) -> h'``, but with the
    Theano reference's formulas (see :class:`_SingleBiasGRU`): one 3h bias instead of two, so it
    is cheaper and has 3h fewer parameters. ``Wx`` is ``[input_size, 3h]`` (x·Wx, as in Theano).
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.Wx = nn.Parameter(torch.empty(input_size, 3 * hidden_size))
        self.bias = nn.Parameter(torch.zeros(3 * hidden_size))
        self.Wh = nn.Parameter(torch.empty(hidden_size, 3 * hidden_size))
        self.reset_parameters()

    def _input_weight(self) -> torch.Tensor:
        return self.Wx

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self._gates(torch.addmm(self.bias, x, self.Wx), hidden)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"


class GRU4Rec(nn.Module):
    """Item sequence model with one or more GRU layers and a dot-product item scorer.

    Embedding modes (spec §1.3):
      * ``constrained_embedding=True``: the input vector is the item's row of the output matrix
        ``Wy`` (one tensor serves as input embedding and output weights; the published best setup);
      * ``embedding=k > 0``: a separate input table ``E`` of width k;
      * ``embedding=0``: one-hot input (the first layer's input weights are a row lookup).

    ``cell`` picks the formulation of the layers fed by a dense vector: ``"torch"`` (nn.GRUCell,
    two biases, as the PyTorch port) or ``"original"`` (the Theano single-bias cell,
    :class:`OriginalGRUCell`). The one-hot first layer is always the original formulation, as in
    both references.

    Shapes: items ``[B]``; hidden state a list with one ``[B, h_l]`` tensor per layer; ``step``
    returns the last layer's output ``[B, d]`` (d = last layer size), ``score_columns`` ``[B, C]``.
    """

    # the constructor argument that turns the tables' sparse gradients off (named in optimizer errors)
    sparse_gradients_key = "sparse_embeddings"
    implements = (SessionModel,)

    def __init__(
        self,
        n_items: int,
        hidden_size: Annotated[int, Range(ge=1)] = 100,
        num_layers: Annotated[int, Range(ge=1)] = 1,
        layers: list[Annotated[int, Range(ge=1)]] | None = None,
        embedding: Annotated[int, Range(ge=0)] = 0,
        constrained_embedding: bool = True,
        dropout_p_embed: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        dropout_p_hidden: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        sparse_embeddings: bool = True,
        cell: Literal["torch", "original"] = "torch",
    ) -> None:
        super().__init__()
        if cell not in ("torch", "original"):
            raise ValueError(f"model.cell must be 'torch' or 'original', got {cell!r}")
        self.cell = cell
        self.layers = [int(x) for x in layers] if layers else [int(hidden_size)] * int(num_layers)
        if not self.layers or min(self.layers) < 1:
            raise ValueError(f"model.layers must be positive sizes, got {self.layers}")
        if constrained_embedding and embedding:
            raise UserInputError(
                "model.embedding must be 0 with model.constrained_embedding=true: the shared "
                "embedding is the output matrix itself (width = last layer size)"
            )
        self.n_items = n_items
        self.constrained_embedding = constrained_embedding
        self.embedding_size = int(embedding)
        self.dropout_p_embed = dropout_p_embed
        self.dropout_p_hidden = dropout_p_hidden
        d = self.layers[-1]
        self.Wy = nn.Embedding(n_items, d, sparse=sparse_embeddings)
        self.By = nn.Embedding(n_items, 1, sparse=sparse_embeddings)
        self.E: nn.Embedding | None = None
        self.onehot: OneHotGRUCell | None = None
        if constrained_embedding:
            first_in = d
        elif self.embedding_size > 0:
            self.E = nn.Embedding(n_items, self.embedding_size, sparse=sparse_embeddings)
            first_in = self.embedding_size
        else:
            self.onehot = OneHotGRUCell(n_items, self.layers[0], sparse=sparse_embeddings)
            first_in = None
        cells = []
        in_size = first_in
        for i, h in enumerate(self.layers):
            if i == 0 and self.onehot is not None:
                in_size = h
                continue
            cells.append(nn.GRUCell(in_size, h) if cell == "torch" else OriginalGRUCell(in_size, h))
            in_size = h
        self.cells = nn.ModuleList(cells)
        self.reset_parameters()

    @property
    def state_widths(self) -> list[int]:
        return list(self.layers)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the weights (and so of the hidden state the task carries)."""
        return self.Wy.weight.dtype

    def reset_parameters(self) -> None:
        """Uniform ±sqrt(6/(fan_in+fan_out)) per gate block, zero biases (spec §1.7)."""
        d = self.layers[-1]
        _uniform_(self.Wy.weight, self.n_items, d)
        nn.init.zeros_(self.By.weight)
        if self.E is not None:
            _uniform_(self.E.weight, self.n_items, self.embedding_size)
        if self.onehot is not None:
            self.onehot.reset_parameters()
        for cell in self.cells:
            if not isinstance(cell, nn.GRUCell):
                # single-bias cells own their per-block init (shared with the one-hot cell)
                cell.reset_parameters()
                continue
            h = cell.hidden_size
            for k in range(3):
                _uniform_(cell.weight_ih[k * h : (k + 1) * h], cell.input_size, h)
                _uniform_(cell.weight_hh[k * h : (k + 1) * h], h, h)
            nn.init.zeros_(cell.bias_ih)
            nn.init.zeros_(cell.bias_hh)

    def train_step(
        self, items: torch.Tensor, hidden: list[torch.Tensor], columns: torch.Tensor,
        distinct_rows: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One training step: scores ``[B, C]`` of ``columns`` after feeding ``items``.

        In the shared-embedding mode the input rows and the output columns come from one lookup,
        so their gradients reach ``Wy`` as one sparse tensor (summed once, as in the reference).

        ``distinct_rows=True`` is the fast step (``task.fast_step``): the same scores, computed
        over each distinct table row once (see :meth:`_train_step_distinct`). Its gradients sum
        the duplicate rows in another order, so it is not bit-exact with the reference.
        """
        if distinct_rows:
            return self._train_step_distinct(items, hidden, columns)
        if not self.constrained_embedding:
            output, new_hidden = self.step(items, hidden)
            return self.score_columns(output, columns), new_hidden
        if self.Wy.sparse:
            x, weights = shared_row_lookup(self.Wy.weight, items, columns)
        else:
            rows = self.Wy(torch.cat([items, columns]))
            x, weights = rows[: len(items)], rows[len(items) :]
        output, new_hidden = self._recur(self._drop_embedding(x), hidden)
        return output @ weights.T + self.By(columns).T, new_hidden

    @property
    def fused_step_supported(self) -> bool:
        """Whether :func:`recforge.models.gru4rec_fused_step.fused_train_step` computes this
        model's fast step: the shared embedding, one ``nn.GRUCell`` layer, sparse item tables."""
        return (self.constrained_embedding and len(self.cells) == 1 and isinstance(self.cells[0], nn.GRUCell)
                and self.Wy.sparse and self.By.sparse)

    def fused_train_step(
        self, items: torch.Tensor, hidden: torch.Tensor, columns: torch.Tensor,
        value_and_grad: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast step's loss and new hidden state ``[B, h]``, backward written out (where
        :attr:`fused_step_supported`): ``value_and_grad(scores [B, C]) -> (loss, d loss / d
        scores)``; see :mod:`recforge.models.gru4rec_fused_step`. :meth:`train_step` with
        ``distinct_rows=True`` followed by the loss is its autograd twin."""
        return fused_train_step(self, items, hidden, columns, value_and_grad)

    def _train_step_distinct(
        self, items: torch.Tensor, hidden: list[torch.Tensor], columns: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`train_step` over the distinct rows of ``Wy``/``By`` that the step reads.

        The 2048 popularity-sampled negatives of a step repeat: on YooChoose about half the
        columns are duplicates. Scoring the ``U`` distinct rows (``[B, U]``) and gathering the
        ``C`` columns from them costs ``U/C`` of the three ``B×C×d`` products, and the tables'
        gradients come out with distinct, sorted rows (each duplicate's share summed inside the
        products), so the optimizer has nothing left to coalesce.
        """
        n_in = len(items) if self.constrained_embedding else 0
        keys = torch.cat([items, columns]) if n_in else columns
        rows, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        weights = unique_row_lookup(self.Wy.weight, rows) if self.Wy.sparse else self.Wy.weight.index_select(0, rows)
        if self.By.sparse:
            # the bias rows of items that are only inputs add to no scored column: a lazy
            # optimizer must not see them (the exact step never looks them up)
            scored = None
            if n_in:
                scored = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
                scored[inverse[n_in:]] = True
            bias = unique_row_lookup(self.By.weight, rows, scored)
        else:
            bias = self.By.weight.index_select(0, rows)
        if n_in:
            x = weights.index_select(0, inverse[:n_in])
            output, new_hidden = self._recur(self._drop_embedding(x), hidden)
        else:
            output, new_hidden = self.step(items, hidden)
        scores = torch.addmm(bias.T, output, weights.T)
        return scores.index_select(1, inverse[n_in:]), new_hidden

    def step(
        self, items: torch.Tensor, hidden: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Advance every session by one event.

        Dropout is inverted and active in training only; the dropped-out output of a layer is both
        what the next layer sees and the state carried to the next step (as the reference does).
        """
        if self.onehot is not None:
            # the one-hot layer's output takes the embedding dropout (as in the PyTorch reference)
            x = self._drop_embedding(self.onehot(items, hidden[0]))
            output, upper = self._recur(x, hidden[1:])
            return output, [x, *upper]
        table = self.Wy if self.constrained_embedding else self.E
        return self._recur(self._drop_embedding(table(items)), hidden)

    def _drop_embedding(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout_p_embed, self.training)

    def _recur(
        self, x: torch.Tensor, hidden: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the GRU cells on input ``x``, one hidden state per cell."""
        new_hidden: list[torch.Tensor] = []
        for cell, h in zip(self.cells, hidden):
            x = F.dropout(cell(x, h), self.dropout_p_hidden, self.training)
            new_hidden.append(x)
        return x, new_hidden

    def score_columns(self, output: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Scores of the given item columns: output ``[B, d]``, columns ``[C]`` -> ``[B, C]``."""
        return output @ self.Wy(columns).T + self.By(columns).T

    def item_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole catalogue's scorer, ``([n_items, d], [n_items])``, for tiled full ranking."""
        return self.Wy.weight, self.By.weight.squeeze(1)

"""DLRM (Naumov et al. 2019) for click-through rate on Criteo-shaped rows, in torchrec's named parts.

After facebookresearch/dlrm's ``DLRM_Net`` (spec §2), split like torchrec's ``models/dlrm.py``:

* :class:`DenseArch`, the bottom MLP: ``dense [B, n_dense] -> [B, d]``, Linear + ReLU after every
  layer, the last one included (the reference's ``bot_l``; 13-512-256-64-16 on Kaggle);
  optionally batch norm and dropout in its hidden layers (BARS / FuxiCTR, see :class:`DenseArch`);
* :class:`SparseArch`: one table per categorical feature, a sum-pooled bag of ids per row
  (one id for Criteo: ``sparse [B, F_e]``; multi-hot: :class:`SparseBags`) -> ``[B, F_e, d]``;
* an interaction over the bottom output and the embeddings: :class:`DotInteraction` (the
  reference's pairwise dots, 27 vectors -> ``d + 351``), :class:`CatInteraction`
  (``[B, 27 d]``) or :class:`DCNv2Interaction` (torchrec's low-rank cross network, DLRM-DCNv2);
* :class:`OverArch`, the top MLP: Linear + ReLU between layers, a last Linear to one logit (no
  sigmoid: the loss takes logits); optionally batch norm and dropout in its hidden layers.

Plain nn.Module, no Lightning. :func:`load_reference_state_dict` loads a ``DLRM_Net`` state dict
(``emb_l.<t>``, ``bot_l.<k>``, ``top_l.<k>``), which pins the layer layout and the order of the
interaction terms against the reference (tests/dlrm/test_dlrm_oracle.py).
"""
from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from recforge.config_values import Range
from recforge.contracts import CTRModel
from recforge.data.batches import SparseBags
from recforge.distributed.sharded_table import RowShardedEmbedding
from recforge.errors import UserInputError
from recforge.kernels.dot_interaction import dot_interaction, interaction_width
from recforge.kernels.twin import KernelChoice, KernelImpl, check_kernel, kernel_of

__all__ = [
    "DLRM",
    "CatInteraction",
    "DCNv2Interaction",
    "DenseArch",
    "DotInteraction",
    "OverArch",
    "SparseArch",
    "load_reference_state_dict",
]

INTERACTIONS = ("dot", "cat", "dcnv2")

log = logging.getLogger(__name__)


def _reference_linear_init_(layer: nn.Linear) -> None:
    """The reference's Linear init: weight ~ N(0, sqrt(2/(fan_in+fan_out))), bias ~
    N(0, sqrt(1/fan_out))."""
    fan_out, fan_in = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))


def _hidden_layer(
    in_features: int, out_features: int, batch_norm: bool, dropout: float
) -> list[nn.Module]:
    """One hidden layer of either MLP: ``Linear -> [BatchNorm1d] -> ReLU -> [Dropout]``.

    The order of FuxiCTR's ``MLP_Layer`` (v1.2.1, ``fuxictr/pytorch/layers/deep.py``, what the
    BARS DLRM runs used): batch norm on the Linear's output, before the activation, and dropout on
    the activation's output. No BatchNorm1d without ``batch_norm``, no Dropout at ``dropout == 0``
    (as there), so the plain layer is the reference's ``Linear, ReLU`` pair with its indices.
    """
    layers: list[nn.Module] = [nn.Linear(in_features, out_features)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(out_features))
    layers.append(nn.ReLU())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return layers


def _reset_mlp(mlp: nn.Sequential) -> None:
    for layer in mlp:
        if isinstance(layer, nn.Linear):
            _reference_linear_init_(layer)
        elif isinstance(layer, nn.BatchNorm1d):
            layer.reset_parameters()  # weight 1, bias 0, running mean 0 and variance 1


class DenseArch(nn.Module):
    """The bottom MLP: ``dense [B, in_features] -> [B, layer_sizes[-1]]``.

    ``mlp`` is ``Sequential(Linear, ReLU, Linear, ReLU, ...)`` with a ReLU after every Linear, the
    last included, as the reference's ``bot_l`` (same indices: ``mlp.0``, ``mlp.2``, ...).

    ``batch_norm`` / ``dropout`` (BARS's FuxiCTR DLRM; both off by default): every layer but the
    last becomes ``Linear, BatchNorm1d, ReLU, Dropout(dropout)`` (see :func:`_hidden_layer`); the
    last stays ``Linear, ReLU``, as FuxiCTR's ``MLP_Layer`` puts neither on its output layer and
    its DLRM gives the bottom one ``output_activation = bottom_mlp_activations`` (ReLU).
    """

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for k, size in enumerate(layer_sizes):
            if k < len(layer_sizes) - 1:
                layers += _hidden_layer(width, size, batch_norm, dropout)
            else:
                layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*layers)
        self.out_features = width
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_mlp(self.mlp)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        """dense ``[B, in_features]`` -> ``[B, out_features]`` (non-negative)."""
        return self.mlp(dense)


class SparseArch(nn.Module):
    """The embedding tables: ``sparse [B, F_e]`` int64 -> ``[B, F_e, d]``.

    One table per categorical feature, ``cardinalities[f]`` rows each, stored as the consecutive
    row blocks of one ``nn.Embedding`` (``embedding.weight [Σ cardinalities, d]``; feature f's block
    starts at ``offsets[f]``, :meth:`table` is its view). One lookup of ``sparse + offsets`` then
    serves all features: with one id per row, the sum-pooled bag of the reference
    (``nn.EmbeddingBag(mode="sum")``) is that row itself. Multi-hot rows (:class:`SparseBags`)
    take one ``embedding_bag(mode="sum")`` over the same weight, every feature's bags at once. On CPU, forward + backward + a sparse SGD
    step took a median 0.5 ms at B = 128 against 1.6-2.0 ms for 26 ``nn.Embedding`` and 2.7-3.2 ms
    for 26 ``nn.EmbeddingBag`` (the Kaggle tables capped at 1M rows, d = 16, one thread, two runs);
    at B = 2048, where the update's row writes dominate, 12 ms against 13-14 and 14-15 ms.

    ``sparse_gradients=True`` gives the table a sparse COO gradient (``B·F_e`` rows, uncoalesced),
    which SGD, Adagrad and the row-wise optimizers apply to the touched rows only.

    Init (reference): feature f's rows ~ U(±sqrt(1/cardinalities[f])).

    An id outside its feature's ``[0, cardinalities[f])`` would read another feature's rows
    without any error, so ids are checked: on CPU with an error naming the entry, on CUDA with an
    asynchronous device assert (no host sync).
    """

    def __init__(
        self, cardinalities: Sequence[int], embedding_dim: int, sparse_gradients: bool = True,
        lazy: bool = False,
    ) -> None:
        super().__init__()
        self.cardinalities = [int(c) for c in cardinalities]
        self.embedding_dim = int(embedding_dim)
        # ``lazy``: the rows are drawn in :meth:`shard_rows`, each rank drawing only its own, so
        # that no process ever holds the whole table; until then the weight is on the meta
        # device (no memory) and this generator state is where the draws start
        self._draw_from: torch.Tensor | None = torch.get_rng_state() if lazy else None
        # an uninitialised weight: Embedding's own N(0, 1) draw would be overwritten at once, and
        # on Kaggle-sized tables (33.8M rows) it costs as much as the draw that stays
        weight = torch.empty(sum(self.cardinalities), self.embedding_dim, device="meta" if lazy else None)
        self.embedding: nn.Embedding | RowShardedEmbedding = nn.Embedding(
            *weight.shape, sparse=sparse_gradients, _weight=weight)
        starts = [0]
        for c in self.cardinalities[:-1]:
            starts.append(starts[-1] + c)
        # derived from the config, so kept out of checkpoints
        self.register_buffer("offsets", torch.tensor(starts, dtype=torch.int64), persistent=False)
        self.register_buffer(
            "sizes", torch.tensor(self.cardinalities, dtype=torch.int64), persistent=False
        )
        self.reset_parameters()

    @property
    def sparse(self) -> bool:
        """Whether the table gets sparse gradients (what the task's optimizer check reads)."""
        return self.embedding.sparse

    @property
    def is_sharded(self) -> bool:
        return isinstance(self.embedding, RowShardedEmbedding)

    def table(self, feature: int) -> torch.Tensor:
        """Feature ``feature``'s table, a view ``[cardinalities[feature], d]`` of the weight
        (of a table that is not sharded)."""
        if self.is_sharded or self._draw_from is not None:
            raise ValueError("a sharded table, or a lazy one not drawn yet, has no whole view of a feature's rows")
        start = sum(self.cardinalities[:feature])
        return self.embedding.weight[start:start + self.cardinalities[feature]]

    def reset_parameters(self) -> None:
        if self._draw_from is not None:
            # what the draws below would take from the generator, taken now (blocks, no table)
            self._draw_rows(0, 0, None, None)
            return
        if self.is_sharded:
            self._draw_rows(self.embedding.start, self.embedding.end, self.embedding.weight, None)
            return
        with torch.no_grad():
            for f, rows in enumerate(self.cardinalities):
                bound = math.sqrt(1.0 / rows)
                self.table(f).uniform_(-bound, bound)

    _DRAW_BLOCK = 1 << 16  # rows per block of the streamed draws

    @torch.no_grad()
    def _draw_rows(self, start: int, end: int, out: torch.Tensor | None, generator: torch.Generator | None) -> None:
        """The draws of :meth:`reset_parameters` (feature by feature, every row in order), made
        block by block; rows ``[start, end)`` of the whole go into ``out``. A uniform draw on the
        CPU takes its values in element order, so the blocks give the unsharded draw's values
        (tests/dlrm/test_dlrm_sharded.py checks it)."""
        first = 0
        for rows in self.cardinalities:
            bound = math.sqrt(1.0 / rows)
            for block_start in range(first, first + rows, self._DRAW_BLOCK):
                n = min(self._DRAW_BLOCK, first + rows - block_start)
                block = torch.empty(n, self.embedding_dim).uniform_(-bound, bound, generator=generator)
                lo, hi = max(block_start, start), min(block_start + n, end)
                if out is not None and lo < hi:
                    out[lo - start:hi - start].copy_(block[lo - block_start:hi - block_start])
            first += rows

    def shard_rows(self, mesh: DeviceMesh | None) -> None:
        """Split the table's rows across ``mesh`` (1-D): this rank keeps
        :func:`recforge.distributed.sharded_table.row_range` of them, and its lookups gather the
        others' (see :class:`RowShardedEmbedding`). ``None``: no split, but a ``lazy`` table is
        drawn whole here. Either way the values are those of the unsharded table
        at construction. Idempotent (Lightning calls ``configure_model`` once per stage)."""
        if self.is_sharded:
            if mesh is not None and mesh == self.embedding.mesh:
                return
            raise ValueError("the table is sharded over another mesh already")
        generator = None
        if self._draw_from is not None:
            generator = torch.Generator()
            generator.set_state(self._draw_from)
        if mesh is None:
            if generator is not None:
                weight = torch.empty(sum(self.cardinalities), self.embedding_dim)
                self._draw_rows(0, weight.shape[0], weight, generator)
                self.embedding = nn.Embedding(*weight.shape, sparse=self.embedding.sparse, _weight=weight)
                self._draw_from = None
            return
        sharded = RowShardedEmbedding(sum(self.cardinalities), self.embedding_dim, mesh, sparse=self.embedding.sparse)
        if generator is not None:
            self._draw_rows(sharded.start, sharded.end, sharded.weight.data, generator)
        else:
            with torch.no_grad():
                sharded.weight.copy_(self.embedding.weight[sharded.start:sharded.end])
        self.embedding, self._draw_from = sharded, None

    @staticmethod
    def _check_inside(inside: torch.Tensor, message: Callable[[torch.Tensor], str]) -> None:
        """Raise ``message(index of the first False)`` unless ``inside`` is all true; on CUDA an
        asynchronous device assert instead (no host sync)."""
        if inside.device.type == "cuda":
            torch._assert_async(inside.all(), "DLRM: a sparse id is outside its feature's table")
        elif not bool(inside.all()):
            raise ValueError(message((~inside).nonzero()[0]))

    def _check_ids(self, sparse: torch.Tensor) -> None:
        def message(where: torch.Tensor) -> str:
            b, f = (int(v) for v in where)
            return (f"sparse[{b}, {f}] = {int(sparse[b, f])} is outside feature {f}'s table "
                    f"[0, {self.cardinalities[f]}) (are the model's cardinalities the data's?)")

        self._check_inside((sparse >= 0) & (sparse < self.sizes), message)

    def _check_bag_ids(self, bags: SparseBags, feature: torch.Tensor) -> None:
        def message(where: torch.Tensor) -> str:
            k = int(where[0])
            f = int(feature[k])
            return (f"sparse bag value {int(bags.values[k])} of feature {f} is outside its table "
                    f"[0, {self.cardinalities[f]}) (are the model's cardinalities the data's?)")

        self._check_inside((bags.values >= 0) & (bags.values < self.sizes[feature]), message)

    def forward(self, sparse: torch.Tensor | SparseBags) -> torch.Tensor:
        """sparse ``[B, F_e]`` int64 -> ``[B, F_e, d]``: row b, feature f is feature f's row
        ``sparse[b, f]``. Or :class:`SparseBags` of ``F_e`` features for B rows -> ``[B, F_e, d]``:
        row b, feature f is the sum of feature f's rows in that bag (zeros for an empty bag), one
        ``embedding_bag`` over the whole table."""
        if self._draw_from is not None:
            raise RuntimeError("a lazy table is drawn in shard_rows (the task's configure_model) first")
        if not isinstance(sparse, SparseBags):
            self._check_ids(sparse)
            return self.embedding(sparse + self.offsets)
        n_features, batch = sparse.n_features, sparse.batch_size
        per_feature = sparse.offsets[torch.arange(1, n_features + 1, device=sparse.offsets.device) * batch] - \
            sparse.offsets[torch.arange(n_features, device=sparse.offsets.device) * batch]
        feature = torch.repeat_interleave(
            torch.arange(n_features, device=sparse.values.device), per_feature, output_size=sparse.values.numel()
        )
        self._check_bag_ids(sparse, feature)
        if self.is_sharded:
            pooled = self.embedding.bags(sparse.values + self.offsets[feature], sparse.offsets)
        else:
            pooled = nn.functional.embedding_bag(
                sparse.values + self.offsets[feature], self.embedding.weight, sparse.offsets, mode="sum",
                sparse=self.embedding.sparse, include_last_offset=True,
            )
        return pooled.view(n_features, batch, self.embedding_dim).transpose(0, 1)


class DotInteraction(nn.Module):
    """The reference's dot interaction: ``(dense [B, d], embeddings [B, F_e, d]) -> [B, d + P]``.

    Pairwise dots of the ``F = F_e + 1`` vectors (dense first), strictly lower triangle in the
    reference's order (``P = F(F-1)/2``; with ``itself`` the diagonal too, ``F(F+1)/2``),
    concatenated after ``dense``. ``kernel`` picks :func:`recforge.kernels.dot_interaction.
    dot_interaction`'s implementation. No parameters.
    """

    def __init__(
        self, embedding_dim: int, n_sparse: int, itself: bool = False, kernel: KernelImpl = "pytorch"
    ) -> None:
        super().__init__()
        self.itself, self.kernel = bool(itself), kernel
        self.out_features = interaction_width(embedding_dim, n_sparse + 1, self.itself)

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return dot_interaction(dense, embeddings, self.itself, kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"itself={self.itself}, kernel={self.kernel!r}, out_features={self.out_features}"


class CatInteraction(nn.Module):
    """The reference's ``cat``: ``(dense [B, d], embeddings [B, F_e, d]) -> [B, (F_e + 1)·d]``,
    ``dense`` then the embeddings in feature order. No parameters."""

    def __init__(self, embedding_dim: int, n_sparse: int) -> None:
        super().__init__()
        self.out_features = (n_sparse + 1) * embedding_dim

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return torch.cat([dense, embeddings.flatten(1)], dim=1)


class DCNv2Interaction(nn.Module):
    """DLRM-DCNv2's interaction (torchrec ``InteractionDCNArch`` over ``LowRankCrossNet``):
    ``(dense [B, d], embeddings [B, F_e, d]) -> [B, N]``, ``N = (F_e + 1)·d``.

    ``x0 = concat(dense, embeddings)`` flattened ``[B, N]``; per layer l,
    ``x_{l+1} = x0 ⊙ (W_l (V_l x_l) + b_l) + x_l`` with ``V_l [rank, N]``, ``W_l [N, rank]``,
    ``b_l [N]``; the last ``x`` is the output.

    Init (torchrec): ``V_l`` and ``W_l`` xavier-normal (std sqrt(2/(N + rank))), ``b_l`` zero.
    """

    def __init__(self, embedding_dim: int, n_sparse: int, num_layers: int, rank: int) -> None:
        super().__init__()
        width = (n_sparse + 1) * embedding_dim
        self.out_features = width
        self.V = nn.ParameterList(nn.Parameter(torch.empty(rank, width)) for _ in range(num_layers))
        self.W = nn.ParameterList(nn.Parameter(torch.empty(width, rank)) for _ in range(num_layers))
        self.bias = nn.ParameterList(nn.Parameter(torch.empty(width)) for _ in range(num_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for v, w, b in zip(self.V, self.W, self.bias):
            nn.init.xavier_normal_(v)
            nn.init.xavier_normal_(w)
            nn.init.zeros_(b)

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, embeddings.flatten(1)], dim=1)
        x = x0
        for v, w, b in zip(self.V, self.W, self.bias):
            # (x Vᵀ) Wᵀ: two thin GEMMs through the rank, never the N x N product
            x = x0 * torch.addmm(b, x @ v.t(), w.t()) + x
        return x


class OverArch(nn.Module):
    """The top MLP: ``[B, in_features] -> [B, 1]`` logits.

    ``mlp`` is ``Sequential(Linear, ReLU, ..., Linear)``: a ReLU after every hidden layer, the last
    Linear (to 1) bare (the reference's ``top_l`` without its final Sigmoid; same indices).

    ``batch_norm`` / ``dropout`` (BARS's FuxiCTR DLRM; both off by default): every hidden layer
    becomes ``Linear, BatchNorm1d, ReLU, Dropout(dropout)`` (see :func:`_hidden_layer`); the last
    Linear to 1 stays bare, as in FuxiCTR, whose top ``MLP_Layer`` ends in ``Linear(·, 1)`` and the
    task's Sigmoid (left to the loss here).
    """

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for size in layer_sizes:
            layers += _hidden_layer(width, size, batch_norm, dropout)
            width = size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_mlp(self.mlp)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features ``[B, in_features]`` -> logits ``[B, 1]``."""
        return self.mlp(features)


def _int(value: Any) -> int | None:
    """``value`` as an int when it is an integer (not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _sizes(name: str, values: Any, allow_empty: bool) -> list[int]:
    """A config list of positive ints (``model.dense_arch``), or a one-line error naming it."""
    is_list = hasattr(values, "__iter__") and not isinstance(values, (str, bytes, Mapping))
    shown = list(values) if is_list else values
    sizes = [_int(v) for v in shown] if is_list else [None]
    if any(size is None or size < 1 for size in sizes):
        raise UserInputError(f"model.{name} must be a list of positive integers, got {shown!r}")
    if not sizes and not allow_empty:
        raise UserInputError(f"model.{name} must not be empty")
    return sizes


def _positive(name: str, value: Any) -> int:
    as_int = _int(value)
    if as_int is None or as_int < 1:
        raise UserInputError(f"model.{name} must be a positive integer, got {value!r}")
    return as_int


def _dropout(name: str, value: Any) -> float:
    """A dropout probability in [0, 1), or a one-line error naming ``model.<name>``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
    if not ok:
        raise UserInputError(f"model.{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UserInputError(f"model.{name} must be true or false, got {value!r}")
    return value


def _dot_kernel(choice: KernelChoice | None, deprecated: KernelImpl | None) -> KernelImpl:
    """The dot interaction's kernel from ``model.dot_interaction`` or, while it is still read,
    the old ``model.interaction_kernel`` (which wins over the default; a clash is refused)."""
    kernel = kernel_of("model.dot_interaction", choice)
    if deprecated is None:
        return kernel
    deprecated = check_kernel(deprecated, "model.interaction_kernel")
    # a log line, not warnings.warn: a config key has no source line worth printing beside it
    log.warning(
        "model.interaction_kernel is deprecated and will be removed in the next release; use "
        "model.dot_interaction.kernel=%s", deprecated,
    )
    if kernel != "pytorch" and kernel != deprecated:
        raise UserInputError(
            f"model.interaction_kernel={deprecated} contradicts model.dot_interaction.kernel={kernel}: "
            "set model.dot_interaction.kernel alone"
        )
    return deprecated


class DLRM(nn.Module):
    """DLRM: ``forward(dense [B, n_dense] float32, sparse [B, n_sparse] int64) -> [B]`` click logits.

    ``logits = OverArch(interaction(DenseArch(dense), SparseArch(sparse)))``. Widths:
    ``DenseArch`` is ``n_dense -> dense_arch... -> embedding_dim`` (13-512-256-64-16 for the Kaggle
    default), ``OverArch`` is ``interaction width -> over_arch... -> 1`` (367-512-256-1 with the
    ``dot`` interaction of 26 features at d = 16).

    Args:
        cardinalities: rows of each categorical feature's table (the data's metadata; its length
            is ``n_sparse``).
        n_dense: number of dense features.
        embedding_dim: d, the width of every table and of the bottom MLP's output.
        dense_arch: hidden widths of the bottom MLP (a last layer to ``embedding_dim`` follows).
        over_arch: hidden widths of the top MLP (a last layer to 1 follows).
        dense_arch_batch_norm, over_arch_batch_norm: a BatchNorm1d after each hidden Linear of the
            bottom / top MLP, before its ReLU (not after the last layer of either).
        dense_arch_dropout, over_arch_dropout: a Dropout of that probability after each hidden
            layer's ReLU in the bottom / top MLP (none after the last layer of either).
            With the four off (the default) the MLPs are the reference's. BARS's DLRM on
            Criteo_x1 (FuxiCTR 1.2.1) is both batch norms on, ``over_arch_dropout=0.2``,
            ``dense_arch_dropout=0``: FuxiCTR's ``MLP_Layer`` orders a hidden layer
            ``Linear, BatchNorm1d, ReLU, Dropout`` and its DLRM passes one ``batch_norm`` flag
            to both MLPs (here one flag each).
        interaction: ``dot`` (the reference's pairwise dots), ``cat`` (concatenation) or
            ``dcnv2`` (low-rank DCN-v2 cross network).
        interaction_itself: ``dot`` only: keep the self-dots too (``F(F+1)/2`` values).
        dot_interaction: ``dot`` only: ``{"kernel": "pytorch" | "triton"}`` (``triton``: the fused
            kernel; falls back to PyTorch with one warning where Triton cannot run).
        dcn_layers, dcn_rank: ``dcnv2`` only: cross layers and their rank.
        sparse_gradients: sparse COO gradients for the tables (needs a sparse-capable optimizer).
        lazy_tables: the tables' rows are drawn in :meth:`shard_tables` (the task's
            ``configure_model``), where each rank of a ``hardware=model_parallel*`` run draws only
            the rows it keeps: no process ever holds a whole table (until then the weight is on
            the meta device). The values are those of an eager build. Without it, every process
            draws the whole tables at build and a sharded run keeps its rows of them.
        compile: run the dense computation (both MLPs and the interaction) through
            ``torch.compile``; the table lookup stays eager (sparse gradients).
        interaction_kernel: the deprecated spelling of ``dot_interaction["kernel"]``, read (with a
            warning) for one more release; None when unset.

    Init as the reference: every Linear weight N(0, sqrt(2/(fan_in+fan_out))), bias
    N(0, sqrt(1/fan_out)); table rows U(±sqrt(1/rows)); cross layers as torchrec.
    """

    # the constructor argument that turns the tables' sparse gradients off (named in optimizer errors)
    sparse_gradients_key = "sparse_gradients"
    implements = (CTRModel,)

    def __init__(
        self,
        cardinalities: Sequence[int],
        n_dense: Annotated[int, Range(ge=1)] = 13,
        embedding_dim: Annotated[int, Range(ge=1)] = 16,
        dense_arch: Sequence[Annotated[int, Range(ge=1)]] = (512, 256, 64),
        over_arch: Sequence[Annotated[int, Range(ge=1)]] = (512, 256),
        dense_arch_batch_norm: bool = False,
        over_arch_batch_norm: bool = False,
        dense_arch_dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        over_arch_dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        interaction: Literal["dot", "cat", "dcnv2"] = "dot",
        interaction_itself: bool = False,
        dot_interaction: KernelChoice | None = None,
        dcn_layers: Annotated[int, Range(ge=1)] = 3,
        dcn_rank: Annotated[int, Range(ge=1)] = 512,
        sparse_gradients: bool = True,
        lazy_tables: bool = False,
        compile: bool = False,
        interaction_kernel: KernelImpl | None = None,
    ) -> None:
        super().__init__()
        cards = _sizes("cardinalities", cardinalities, allow_empty=False)
        n_dense = _positive("n_dense", n_dense)
        embedding_dim = _positive("embedding_dim", embedding_dim)
        hidden_bottom = _sizes("dense_arch", dense_arch, allow_empty=True)
        hidden_top = _sizes("over_arch", over_arch, allow_empty=True)
        dense_bn = _flag("dense_arch_batch_norm", dense_arch_batch_norm)
        over_bn = _flag("over_arch_batch_norm", over_arch_batch_norm)
        dense_p = _dropout("dense_arch_dropout", dense_arch_dropout)
        over_p = _dropout("over_arch_dropout", over_arch_dropout)
        if interaction not in INTERACTIONS:
            raise UserInputError(
                f"model.interaction must be one of {', '.join(INTERACTIONS)}, got {interaction!r}"
            )
        kernel = _dot_kernel(dot_interaction, interaction_kernel)
        if interaction != "dot" and interaction_itself:
            raise UserInputError(
                "model.interaction_itself=true applies to interaction=dot only, got "
                f"interaction={interaction}"
            )
        if interaction != "dot" and kernel != "pytorch":
            raise UserInputError(
                f"model.dot_interaction.kernel={kernel} applies to interaction=dot only, got "
                f"interaction={interaction} (which has no kernel switch)"
            )
        if interaction == "dcnv2":
            dcn_layers, dcn_rank = _positive("dcn_layers", dcn_layers), _positive("dcn_rank", dcn_rank)
        self.n_dense, self.n_sparse, self.embedding_dim = n_dense, len(cards), embedding_dim
        self.interaction_kind = interaction
        self.compile_dense = bool(compile)

        self.dense_arch = DenseArch(n_dense, [*hidden_bottom, embedding_dim], dense_bn, dense_p)
        self.sparse_arch = SparseArch(cards, embedding_dim, sparse_gradients=bool(sparse_gradients),
                                      lazy=_flag("lazy_tables", lazy_tables))
        if interaction == "dot":
            self.interaction: nn.Module = DotInteraction(
                embedding_dim, len(cards), interaction_itself, kernel
            )
        elif interaction == "cat":
            self.interaction = CatInteraction(embedding_dim, len(cards))
        else:
            self.interaction = DCNv2Interaction(embedding_dim, len(cards), dcn_layers, dcn_rank)
        self.over_arch = OverArch(self.interaction.out_features, hidden_top, over_bn, over_p)
        self._compiled = None

    @property
    def cardinalities(self) -> list[int]:
        return list(self.sparse_arch.cardinalities)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.over_arch.mlp[0].weight.dtype

    def shard_tables(self, mesh: DeviceMesh | None) -> None:
        """Split the tables' rows across ``mesh`` (1-D; None: no split), see :meth:`SparseArch.shard_rows`."""
        self.sparse_arch.shard_rows(mesh)

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The embedding table (one parameter holding every feature's rows)."""
        return [self.sparse_arch.embedding.weight]

    def reset_parameters(self) -> None:
        """Re-draw every parameter as at construction (see the class docstring)."""
        self.dense_arch.reset_parameters()
        self.sparse_arch.reset_parameters()
        if isinstance(self.interaction, DCNv2Interaction):
            self.interaction.reset_parameters()
        self.over_arch.reset_parameters()

    def _dense_path(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """dense ``[B, n_dense]``, embeddings ``[B, n_sparse, d]`` -> logits ``[B]``."""
        x = self.dense_arch(dense)
        return self.over_arch(self.interaction(x, embeddings)).squeeze(1)

    def check_inputs(self, dense: torch.Tensor, sparse: torch.Tensor | SparseBags) -> None:
        """Raise ValueError, naming the input and the shape expected, unless ``dense`` and
        ``sparse`` are what :meth:`forward` takes (the ids' range is the lookup's check)."""
        if dense.dim() != 2 or dense.shape[1] != self.n_dense or not dense.is_floating_point():
            raise ValueError(
                f"dense must be a float tensor [B, n_dense] = [B, {self.n_dense}], got {dense.dtype} "
                f"{tuple(dense.shape)}"
            )
        if isinstance(sparse, SparseBags):
            if (sparse.batch_size, sparse.n_features) != (dense.shape[0], self.n_sparse):
                raise ValueError(
                    f"sparse bags must hold n_sparse = {self.n_sparse} features for B = {dense.shape[0]} rows, "
                    f"got {sparse.n_features} features for {sparse.batch_size} rows"
                )
        else:
            integer = not sparse.is_floating_point() and sparse.dtype != torch.bool
            if not integer or sparse.shape != (dense.shape[0], self.n_sparse):
                raise ValueError(
                    f"sparse must be an integer tensor [B, n_sparse] = [{dense.shape[0]}, {self.n_sparse}] or "
                    f"SparseBags, got {sparse.dtype} {tuple(sparse.shape)}"
                )

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor | SparseBags) -> torch.Tensor:
        """dense ``[B, n_dense]`` float, sparse ``[B, n_sparse]`` int64 (one id per feature) or
        :class:`SparseBags` (multi-hot, sum-pooled) -> logits ``[B]``."""
        self.check_inputs(dense, sparse)
        embeddings = self.sparse_arch(sparse)
        if not self.compile_dense:
            return self._dense_path(dense, embeddings)
        if self._compiled is None:
            self._compiled = torch.compile(self._dense_path)
        # The batch dimension is dynamic from the first call: left static, dynamo compiled the
        # first batch size alone and compiled again at the next one (an epoch's last batch, the
        # evaluation batches), each compile counting towards torch._dynamo's recompile limit (8).
        # Now one graph per autograd mode (training, no_grad validation, inference_mode test)
        # serves every batch size, bar a batch of one row (PyTorch specialises sizes 0 and 1) and
        # the size ranges inductor itself may split on (on CPU: a training batch over 4096 rows).
        # maybe_mark_dynamic: a hint, not a demand, so that a size the graph must fix is no error.
        torch._dynamo.maybe_mark_dynamic(dense, 0)
        torch._dynamo.maybe_mark_dynamic(embeddings, 0)
        return self._compiled(dense, embeddings)

    def __getstate__(self) -> dict:
        # the compiled function holds graphs that neither pickle nor deep-copy; it is rebuilt
        # on the next forward
        state = dict(super().__getstate__())
        state["_compiled"] = None
        return state


def load_reference_state_dict(model: DLRM, state: Mapping[str, Any]) -> None:
    """Copy a facebookresearch/dlrm ``DLRM_Net`` state dict into ``model`` (in place).

    Names: ``emb_l.<t>.weight [rows_t, d]`` -> feature t's table (:meth:`SparseArch.table`);
    ``bot_l.<k>.weight|bias`` -> ``dense_arch.mlp.<k>``; ``top_l.<k>.weight|bias`` ->
    ``over_arch.mlp.<k>`` (the reference's Sequential indices are ours: Linear at even indices,
    its final Sigmoid has no parameters; with dropout, the i-th Linear is the reference's ``2i``).
    Values may be tensors or numpy arrays. Only the ``dot`` and ``cat`` interactions exist in the
    reference, and no batch norm. Every reference entry must find its place
    and every parameter of ``model`` must be set, with equal shapes, or nothing is copied and a
    ValueError says what differs.
    """
    if model.interaction_kind not in ("dot", "cat"):
        raise ValueError(f"DLRM_Net has no {model.interaction_kind} interaction: only dot and cat load")
    if any(isinstance(m, nn.BatchNorm1d) for m in model.modules()):
        raise ValueError("DLRM_Net has no batch norm: a model with dense_arch_batch_norm or "
                         "over_arch_batch_norm does not load")
    targets: dict[str, torch.Tensor] = {}
    for t in range(model.n_sparse):
        targets[f"emb_l.{t}.weight"] = model.sparse_arch.table(t)
    for prefix, arch in (("bot_l", model.dense_arch), ("top_l", model.over_arch)):
        linears = [layer for layer in arch.mlp if isinstance(layer, nn.Linear)]
        for i, layer in enumerate(linears):
            targets[f"{prefix}.{2 * i}.weight"] = layer.weight
            targets[f"{prefix}.{2 * i}.bias"] = layer.bias
    missing = sorted(set(targets) - set(state))
    unexpected = sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"DLRM_Net state does not fit this model: missing {missing}, unexpected {unexpected}"
        )
    values = {name: torch.as_tensor(state[name]) for name in targets}
    for name, target in targets.items():
        if tuple(values[name].shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: shape {tuple(values[name].shape)} in the state, {tuple(target.shape)} in the "
                "model"
            )
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(values[name])

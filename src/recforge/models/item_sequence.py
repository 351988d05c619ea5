"""What the HSTU paper's sequential encoders (SASRec, HSTU) share around their layers.

Both read a jagged batch of histories through the same input (the reference's
``LearnablePositionalEmbeddingInputFeaturesPreprocessor``: ``item_emb · sqrt(D) + pos_emb[p]``, p
counted from the oldest item, then dropout), end in L2-normalised vectors, and score the catalogue
by cosine against their own item table. Only the layers in between differ, and each model's
``reset_parameters`` draws the tables as its reference does.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from recforge.kernels.jagged import jagged_positions


class ItemSequenceEncoder(nn.Module):
    """Item table ``item_emb [n_items, D]``, position table ``pos_emb [n_positions, D]``, the
    input they make, and the accessors :class:`recforge.contracts.SequenceModel` asks for."""

    #: the model's name in its errors
    name = "the encoder"

    def __init__(
        self,
        n_items: int,
        embedding_dim: int,
        n_positions: int,
        max_sequence_length: int,
        dropout_rate: float,
        l2_norm_eps: float,
    ) -> None:
        super().__init__()
        self.n_items = int(n_items)
        self.embedding_dim = int(embedding_dim)
        self.max_sequence_length = int(max_sequence_length)
        self.dropout_rate = float(dropout_rate)
        self.l2_norm_eps = float(l2_norm_eps)
        self.item_emb = nn.Embedding(self.n_items, self.embedding_dim)
        self.pos_emb = nn.Embedding(int(n_positions), self.embedding_dim)

    def embed_inputs(
        self, items: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """items ``[ΣL]``, offsets ``[B+1]`` -> (the first layer's input ``[ΣL, D]``, the longest
        row's length, each element's row and position ``[ΣL]``); positions beyond the table are
        refused."""
        total = items.numel()
        rows, positions = jagged_positions(offsets, total)
        max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 and total > 0 else 0
        if max_len > self.pos_emb.num_embeddings:
            raise ValueError(
                f"a history has {max_len} items but {self.name} has {self.pos_emb.num_embeddings} "
                f"positions (max_sequence_length={self.max_sequence_length} plus extra_positions): "
                "truncate histories to their most recent max_sequence_length items"
            )
        x = self.item_emb(items) * math.sqrt(self.embedding_dim) + self.pos_emb(positions)
        # The reference then zeroes padded rows: a jagged batch has none.
        return F.dropout(x, self.dropout_rate, self.training), max_len, rows, positions

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's rows -> unit rows (norm clamped at ``l2_norm_eps``), as the reference's
        ``L2NormEmbeddingPostprocessor``; no final LayerNorm."""
        return F.normalize(x, dim=-1, eps=self.l2_norm_eps)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.item_emb.weight.dtype

    @property
    def item_table(self) -> nn.Parameter:
        """The raw item table ``[n_items, D]``: the inputs' embeddings and the loss's items."""
        return self.item_emb.weight

    def item_embeddings(self, normalize: bool = True) -> torch.Tensor:
        """The catalogue's vectors for scoring ``[n_items, D]``.

        ``normalize=True``: L2-normalised (norm clamped at ``l2_norm_eps``), what the reference
        ranks against (its evaluation and its loss normalise the items, ``item_l2_norm=True``),
        so a query's dot product with them is a cosine. ``False``: the raw table (a Parameter:
        what the loss takes, so gradients reach it).
        """
        table = self.item_emb.weight
        return F.normalize(table, dim=-1, eps=self.l2_norm_eps) if normalize else table

    @staticmethod
    def last_positions(outputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each row's last vector: outputs ``[ΣL, D]``, offsets ``[B+1]`` -> ``[B, D]``.

        The evaluation query (the reference's ``get_current_embeddings``). Every row needs at
        least one item.
        """
        if offsets.numel() > 1 and bool((offsets[1:] <= offsets[:-1]).any()):
            raise ValueError("last_positions needs every history to have at least one item")
        return outputs.index_select(0, offsets[1:] - 1)

"""SASRec (Kang & McAuley 2018) as the HSTU paper's baseline (spec §1.6), on jagged histories.

The layer is the one of the generative-recommenders research code that produced the published
SASRec rows (``research/modeling/sequential/sasrec.py`` with the ml-1m/ml-20m/Books
``sasrec-sampled-softmax-*-final.gin`` configs), not the original paper's:

* input: ``item_emb · sqrt(D) + pos_emb[p]`` (p counted from the oldest item), dropout;
* per block (``num_blocks``):
  ``x̂ = LN(x)``; ``a = MHA(query=x̂, key=x, value=x)`` (keys and values are the *un-normalised*
  x; causal; softmax(q·k/sqrt(d_head)); dropout on the attention weights);
  ``h = LN(x̂ + a)`` (the residual is x̂, not x); ``x = h + drop(W2 · drop(act(W1 · h)))``;
  every LN without affine parameters, eps 1e-8;
* no final LayerNorm; outputs L2-normalised (norm clamped at ``l2_norm_eps``).

Plain nn.Module, no Lightning. Histories come jagged (flat ids plus offsets) and stay jagged
except inside the attention: see :class:`SASRecBlock`.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from torch import nn
from torch.nn import functional as F

from recforge.config_values import ConfigValueError, Range
from recforge.contracts import SequenceModel
from recforge.models.item_sequence import ItemSequenceEncoder

# The reference's LayerNorms (F.layer_norm in SASRec._run_one_layer): no affine, this eps.
_LN_EPS = 1e-8


class SASRecBlock(nn.Module):
    """One SASRec block of the reference (``SASRec._run_one_layer`` + ``StandardAttentionFF``).

    Everything but the attention runs on the jagged rows ``[ΣL, D]``. The attention pads q, k, v
    to ``[B, heads, Lmax, D/heads]`` with Lmax the *batch's* longest history (not a global
    width): dense causal attention is the simplest exact form, and since every history is
    left-aligned, causality alone keeps a row's queries off the padding (a valid query at
    position p sees keys 0..p, all valid), so no key-padding mask is needed. Memory
    ``B · heads · Lmax²`` for the attention weights. Padded query rows are computed and
    dropped; their gradient is zero.

    Parameters as ``nn.MultiheadAttention`` + the reference's two 1x1 Conv1d (here Linear, the
    same map and the same fans): ``in_proj_weight [3D, D]`` and ``in_proj_bias [3D]`` (q, k, v
    stacked), ``out_proj`` D -> D, ``ffn_in`` D -> H, ``ffn_out`` H -> D, all with bias.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        ffn_hidden_dim: int,
        ffn_activation: Literal["relu", "gelu"],
        ffn_dropout_rate: float,
    ) -> None:
        super().__init__()
        if embedding_dim % num_heads:
            raise ValueError(
                f"embedding_dim ({embedding_dim}) must be a multiple of num_heads ({num_heads})"
            )
        if ffn_activation not in ("relu", "gelu"):
            raise ValueError(f"ffn_activation must be 'relu' or 'gelu', got {ffn_activation!r}")
        self.embedding_dim = embedding_dim
        self.num_heads = num_heads
        self.ffn_activation = ffn_activation
        # The reference gives MultiheadAttention dropout=ffn_dropout_rate: the attention weights
        # share the FFN's rate, not the input dropout's.
        self.dropout_rate = ffn_dropout_rate
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embedding_dim, embedding_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embedding_dim))
        self.out_proj = nn.Linear(embedding_dim, embedding_dim)
        self.ffn_in = nn.Linear(embedding_dim, ffn_hidden_dim)
        self.ffn_out = nn.Linear(ffn_hidden_dim, embedding_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference's init: SASRec.reset_state re-draws every parameter of ≥ 2 dims
        xavier-normal; the 1-D ones make xavier raise and keep their module's own init.

        * ``in_proj_weight`` xavier-normal over the whole ``[3D, D]`` (fan_out 3D: std
          sqrt(2/4D), not per q/k/v block); ``in_proj_bias`` and ``out_proj.bias`` zero
          (MultiheadAttention's init);
        * ``out_proj.weight``, ``ffn_in.weight`` ``[H, D]``, ``ffn_out.weight`` ``[D, H]``
          xavier-normal (a 1x1 Conv1d weight ``[out, in, 1]`` has the same fans);
        * ``ffn_*.bias`` U(±1/sqrt(fan_in)) (Conv1d's and Linear's default: kept).
        """
        for weight in (self.in_proj_weight, self.out_proj.weight, self.ffn_in.weight,
                       self.ffn_out.weight):
            nn.init.xavier_normal_(weight)
        nn.init.zeros_(self.in_proj_bias)
        nn.init.zeros_(self.out_proj.bias)
        for layer in (self.ffn_in, self.ffn_out):
            bound = 1.0 / math.sqrt(layer.in_features)
            nn.init.uniform_(layer.bias, -bound, bound)

    def forward(
        self, x: torch.Tensor, pad_index: torch.Tensor, batch_size: int, max_len: int
    ) -> torch.Tensor:
        """x ``[ΣL, D]`` -> ``[ΣL, D]``.

        pad_index ``[ΣL]``: ``row · max_len + position`` of each element in the padded
        ``[batch_size, max_len]`` grid.
        """
        d, h = self.embedding_dim, self.num_heads
        x_hat = F.layer_norm(x, (d,), eps=_LN_EPS)
        w_q, w_kv = self.in_proj_weight.split([d, 2 * d])
        b_q, b_kv = self.in_proj_bias.split([d, 2 * d])
        qkv = torch.cat([F.linear(x_hat, w_q, b_q), F.linear(x, w_kv, b_kv)], dim=1)
        padded = qkv.new_zeros(batch_size * max_len, 3 * d).index_copy(0, pad_index, qkv)
        # [B·Lmax, 3D] -> 3 x [B, heads, Lmax, D/heads]
        q, k, v = padded.view(batch_size, max_len, 3, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_rate if self.training else 0.0, is_causal=True
        )
        attn = attn.transpose(1, 2).reshape(batch_size * max_len, d).index_select(0, pad_index)
        h_in = F.layer_norm(x_hat + self.out_proj(attn), (d,), eps=_LN_EPS)
        act = F.relu if self.ffn_activation == "relu" else F.gelu
        p = self.dropout_rate
        hidden = F.dropout(act(self.ffn_in(h_in)), p, self.training)
        return h_in + F.dropout(self.ffn_out(hidden), p, self.training)


class SASRec(ItemSequenceEncoder):
    """SASRec encoder over jagged histories, with the item table it shares with the loss.

    ``forward(items [ΣL], offsets [B+1]) -> [ΣL, D]``: row ``offsets[b] + p`` is user b's vector
    after reading its items 0..p (oldest first), L2-normalised; it scores the item *after*
    position p (the next history item, or the target at the last position).
    :meth:`last_positions` takes each row's last vector ``[B, D]`` (the evaluation query).

    Item ids are catalogue indices ``[0, n_items)``: the reference's padding row 0 has no
    counterpart (jagged rows need no padding id), so a table built with ``n_items`` equal to the
    reference's row count (max id + 1, e.g. 3,953 for ml-1m) has its parameter count.

    The position table has ``max_sequence_length + extra_positions`` rows, as the reference's
    (its dense width N = 200 + 10 + 1 = 211 for ML); only the first ``max_sequence_length`` are
    ever read by histories the data module truncated, the rest keep the published shape and
    parameter count (ml-1m: 238,800 with a 3,953-row table, 41,150 without it).

    Init (reference): item table truncated normal std 0.02 at ±2 std; positions truncated
    normal std sqrt(1/D) at ±2 std (SASRec's xavier re-init skips the input preprocessor, so
    unlike HSTU the position table keeps it); blocks as :meth:`SASRecBlock.reset_parameters`.
    """

    implements = (SequenceModel,)
    name = "SASRec"

    def __init__(
        self,
        n_items: int,
        embedding_dim: Annotated[int, Range(ge=1)] = 50,
        num_blocks: Annotated[int, Range(ge=1)] = 2,
        num_heads: Annotated[int, Range(ge=1)] = 1,
        ffn_hidden_dim: Annotated[int, Range(ge=1)] = 50,
        ffn_activation: Literal["relu", "gelu"] = "relu",
        dropout_rate: Annotated[float, Range(ge=0, lt=1)] = 0.2,
        ffn_dropout_rate: Annotated[float, Range(ge=0, lt=1)] = 0.2,
        max_sequence_length: Annotated[int, Range(ge=1)] = 200,
        extra_positions: Annotated[int, Range(ge=0)] = 11,
        l2_norm_eps: Annotated[float, Range(gt=0)] = 1e-6,
    ) -> None:
        if int(embedding_dim) % int(num_heads):
            raise ConfigValueError(f"model.num_heads={num_heads}: the heads split model.embedding_dim={embedding_dim} "
                                   f"between them; use a divisor of {embedding_dim}")
        super().__init__(n_items, embedding_dim, int(max_sequence_length) + int(extra_positions),
                         max_sequence_length, dropout_rate, l2_norm_eps)
        self.blocks = nn.ModuleList(
            SASRecBlock(self.embedding_dim, int(num_heads), int(ffn_hidden_dim), ffn_activation,
                        float(ffn_dropout_rate))
            for _ in range(int(num_blocks))
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw every parameter as the reference does (see the class docstring).

        The reference draws its truncated normals by taking the first of 4 standard normals in
        (-2, 2) (the first draw if none is: ~4e-6 of the values); this uses the exact
        truncated normal instead.
        """
        std = 0.02
        nn.init.trunc_normal_(self.item_emb.weight, std=std, a=-2 * std, b=2 * std)
        std = math.sqrt(1.0 / self.embedding_dim)
        nn.init.trunc_normal_(self.pos_emb.weight, std=std, a=-2 * std, b=2 * std)
        for block in self.blocks:
            block.reset_parameters()

    def forward(self, items: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """items ``[ΣL]`` int64 in [0, n_items), offsets ``[B+1]`` int64 -> ``[ΣL, D]`` unit rows.

        Rows may be empty. Histories longer than the position table are refused (the data
        module truncates to the most recent ``max_sequence_length`` items).
        """
        x, max_len, rows, positions = self.embed_inputs(items, offsets)
        pad_index = rows * max_len + positions
        for block in self.blocks:
            x = block(x, pad_index, offsets.numel() - 1, max_len)
        return self.output(x)

    def encode_last(self, items: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """items ``[ΣL]``, offsets ``[B+1]`` -> each row's query ``[B, D]`` (unit rows)."""
        return self.last_positions(self(items, offsets), offsets)

"""What the parts of an experiment promise each other, declared so that configs can be checked
before anything is built.

Every edge of an experiment is one declaration on each side, compared by
:func:`recforge.config_checks.check_combination`:

====================  =========================================  ======================================
edge                  declared by the producer                   declared by the consumer
====================  =========================================  ======================================
data -> task          ``DataModule.batch_type``                  ``Task.batch_type``
task -> model         ``Model.implements`` (Protocols below)     ``Task.model_contract``
task -> loss          ``Task.produces`` (a score layout)         ``Loss.consumes``
task -> evaluation    ``Task.evaluation_kind``                   ``Evaluation.kind``
====================  =========================================  ======================================

A model's ``implements`` is a promise checked structurally by the tests (an instance is an
instance of each runtime-checkable Protocol it names).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

# Score layouts a task hands its loss.
NEXT_ITEM_COLUMNS = "next_item_columns"
"""``[B', C]`` scores: row i's target is column i (the mini-batch's targets), then shared
sampled negatives; losses normalise by the configured batch size (GRU4Rec's session-parallel
losses)."""
SEQUENCE_POSITIONS = "sequence_positions"
"""Jagged per-position user vectors ``[P, D]`` with the next item of every position ``[P]``
and the item table: a softmax over the positive and negatives per position (SASRec/HSTU)."""
CTR_LOGITS = "ctr_logits"
"""``[B]`` click logits against ``[B]`` labels (DLRM)."""


@runtime_checkable
class SessionModel(Protocol):
    """A step-wise session model (GRU4Rec): a hidden state carried from event to event.

    ``state_widths``: widths of the hidden state's tensors (one ``[B, w]`` each).
    ``train_step(items [B], hidden, columns [C]) -> (scores [B, C], new hidden)``.
    ``step(items [B], hidden) -> (output [B, d], new hidden)`` (evaluation).
    ``item_weights() -> (weights [n_items, d], bias [n_items])``: the catalogue's scorer, the
    score of item j for output o being ``o @ weights[j] + bias[j]``.
    """

    @property
    def state_widths(self) -> list[int]: ...

    @property
    def param_dtype(self) -> torch.dtype: ...

    def train_step(
        self, items: torch.Tensor, hidden: list[torch.Tensor], columns: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def step(
        self, items: torch.Tensor, hidden: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def item_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@runtime_checkable
class SequenceModel(Protocol):
    """An encoder of jagged user histories (SASRec, HSTU) scored by cosine against its items.

    ``forward(items [ΣL], offsets [B+1]) -> [ΣL, D]`` L2-normalised user vectors; the row of
    position p scores the item after p. ``last_positions(outputs, offsets) -> [B, D]``: each
    row's last vector (the evaluation query). ``item_table``: the raw ``[n_items, D]`` table
    (the loss's items, gradients reach it); ``item_embeddings() -> [n_items, D]``: the vectors
    the catalogue is ranked with.
    """

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def item_table(self) -> torch.Tensor: ...

    def item_embeddings(self) -> torch.Tensor: ...

    def last_positions(self, outputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, items: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

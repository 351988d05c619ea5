"""What the parts of an experiment promise each other, declared so that configs can be checked
before anything is built.

Every edge of an experiment is one declaration on each side, compared by
:func:`recforge.config_checks.check_combination`:

====================  =========================================  ======================================
edge                  declared by the producer                   declared by the consumer
====================  =========================================  ======================================
data -> task          ``DataModule.batch_type``                  ``Task.batch_type``
data -> task          ``DataModule.task_inputs`` return type     the task's ``__init__`` parameters
                      (a TypedDict below: the keys)
task -> model         ``Model.implements`` (Protocols below)     ``Task.model_contract``
task -> loss          ``Task.produces`` (a score layout)         ``Loss.consumes``
task -> evaluation    ``Task.evaluation_kind``                   ``Evaluation.kind``
====================  =========================================  ======================================

An evaluation also implements :class:`Evaluation` (what the task and the pipeline call on it).

A model's ``implements`` is a promise checked structurally by the tests (an instance is an
instance of each runtime-checkable Protocol it names, and :func:`missing_parameters` finds no
parameter of a Protocol method that the model's method lacks). A task that can drive models of more than
one contract declares them all (``model_contract`` a tuple) and asks :func:`declares` which one
it holds; it never guesses from attributes.

What the pipeline and the data modules read of each other at run time is declared too:
:class:`DataModule` (what a data module offers) and :class:`Task` (what the data reads of the
task it feeds).
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol, TypedDict, runtime_checkable

import numpy as np
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


# What a data module hands the task it feeds (keyword arguments of the task's constructor).
class CatalogueInputs(TypedDict):
    """Next-item data: ``n_items`` (item indices are ``[0, n_items)``) and ``item_popularity``
    ``[n_items]`` int64, the training split's events per item."""

    n_items: int
    item_popularity: np.ndarray


class HistoryInputs(CatalogueInputs):
    """User histories: the catalogue, and ``max_seq_len``, the most recent items a history keeps."""

    max_seq_len: int


class CTRInputs(TypedDict):
    """Criteo-shaped rows: ``cardinalities`` (one table size per categorical feature) and
    ``n_dense``, the width of the dense features."""

    cardinalities: list[int]
    n_dense: int


@runtime_checkable
class DataModule(Protocol):
    """A data module, as the pipeline and the config check use it (:class:`recforge.data.base.RecDataModule`).

    ``batch_type``: the batch its loaders yield. ``has_validation``: whether it has a validation
    split (without one, ``val_dataloader()`` is empty and the run neither validates nor monitors).
    ``task_inputs()``: the task's constructor arguments it provides, its return type one of the
    TypedDicts above. ``train_dataloader()`` resumes inside an epoch (its state travels in
    checkpoints); ``state_dict()`` is the data's identity, checked by ``load_state_dict``.
    ``check_trainable(min_batch_rows)`` refuses, before the run starts, training data with no
    mini-batch of the task's ``min_batch_rows``.
    """

    batch_type: ClassVar[type]

    @property
    def has_validation(self) -> bool: ...

    def task_inputs(self) -> Mapping[str, Any]: ...

    def train_dataloader(self) -> Iterable: ...

    def val_dataloader(self) -> Iterable: ...

    def test_dataloader(self) -> Iterable: ...

    def check_trainable(self, min_batch_rows: int) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class Task(Protocol):
    """What a data module reads of the task it feeds (:class:`recforge.tasks.base.RecTask`).

    ``min_batch_rows``: the fewest rows a training mini-batch may have for its loss to learn
    (2 when a mini-batch's own targets are its only negatives); a loader that cuts batches of
    varying size (session-parallel) never yields fewer. ``validation_sample``: the users a
    validation pass ranks (:class:`recforge.evaluation.user_sample.ValidationSample`, or None for
    all), read by a data module that declares ``samples_validation_users``.
    """

    min_batch_rows: int


@runtime_checkable
class SessionModel(Protocol):
    """A step-wise session model (GRU4Rec): a hidden state carried from event to event.

    ``state_widths``: widths of the hidden state's tensors (one ``[B, w]`` each).
    ``train_step(items [B], hidden, columns [C], distinct_rows=False) -> (scores [B, C], new
    hidden)``; ``distinct_rows=True`` (``task.fast_step``) asks for the same function computed in
    any order of summation that is faster (a model without such a path ignores it).
    ``step(items [B], hidden) -> (output [B, d], new hidden)`` (evaluation).
    ``item_weights() -> (weights [n_items, d], bias [n_items])``: the catalogue's scorer, the
    score of item j for output o being ``o @ weights[j] + bias[j]``.
    """

    @property
    def state_widths(self) -> list[int]: ...

    @property
    def param_dtype(self) -> torch.dtype: ...

    def train_step(
        self,
        items: torch.Tensor,
        hidden: list[torch.Tensor],
        columns: torch.Tensor,
        distinct_rows: bool = False,
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
    row's last vector; ``encode_last(items, offsets) -> [B, D]``: the same from the inputs (the
    evaluation query; a model may compute only those rows). ``item_table``: the raw ``[n_items, D]`` table
    (the loss's items, gradients reach it); ``item_embeddings() -> [n_items, D]``: the vectors
    the catalogue is ranked with.
    """

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def item_table(self) -> torch.Tensor: ...

    def item_embeddings(self) -> torch.Tensor: ...

    def last_positions(self, outputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

    def encode_last(self, items: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, items: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TimedSequenceModel(Protocol):
    """A :class:`SequenceModel` that also reads when things happened (HSTU's time bias).

    ``forward(items [ΣL], offsets [B+1], timestamps [ΣL], query_times [ΣL]) -> [ΣL, D]``:
    ``timestamps`` are the items' times (int64 seconds, non-decreasing within a row) and
    ``query_times[p]`` the time of the event position p predicts: the next item's, and at a row's
    last position the target's (training and evaluation alike, as the reference does: the
    request time is known when a recommendation is asked for). Everything else as
    :class:`SequenceModel`.
    """

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def item_table(self) -> torch.Tensor: ...

    def item_embeddings(self) -> torch.Tensor: ...

    def last_positions(self, outputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

    def encode_last(
        self,
        items: torch.Tensor,
        offsets: torch.Tensor,
        timestamps: torch.Tensor,
        query_times: torch.Tensor,
    ) -> torch.Tensor: ...

    def __call__(
        self,
        items: torch.Tensor,
        offsets: torch.Tensor,
        timestamps: torch.Tensor,
        query_times: torch.Tensor,
    ) -> torch.Tensor: ...


@runtime_checkable
class CTRModel(Protocol):
    """A click-through-rate model over Criteo-shaped rows (DLRM).

    ``forward(dense [B, n_dense] float32, sparse [B, n_sparse] int64) -> [B]`` click logits;
    ``sparse[:, f]`` are row indices into feature f's table (``[0, cardinalities[f])``). Multi-hot
    data passes :class:`recforge.data.batches.SparseBags` as ``sparse`` instead (a model that
    takes them pools each bag).
    ``sparse_parameters()``: the embedding tables' parameters (the optimiser may treat them
    apart: sparse gradients, row-wise Adagrad).
    ``shard_tables(mesh)``: split the tables' rows across a 1-D device mesh (None: keep them
    whole); called once the processes and the mesh exist (the task's ``configure_model``),
    idempotent.
    """

    @property
    def param_dtype(self) -> torch.dtype: ...

    def sparse_parameters(self) -> list[torch.nn.Parameter]: ...

    def shard_tables(self, mesh: Any) -> None: ...

    def __call__(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Evaluation(Protocol):
    """What a task feeds at validation and test, and what the run reads back.

    ``kind``: the edge a task's ``evaluation_kind`` names (``full_ranking``, ``ctr``).
    ``update(split, ...)``: one batch of a split (``val`` or ``test``); its inputs are the
    family's (queries and the catalogue for a ranking, logits and labels for CTR).
    ``compute_and_reset(split) -> {"<split>/<name>": scalar}`` over the whole split (reduced
    across DDP ranks), then cleared. ``logged_names()``: every name it logs, for both splits.
    ``monitor``: the logged name that checkpointing, early stopping and sweeps follow, or None.
    ``reduce_over(group)``: reduce across that process group instead of every rank (the
    data-parallel ranks, where a table-sharding group's ranks see the same rows).
    """

    kind: str
    monitor: str | None

    def update(self, split: str, *args: Any, **kwargs: Any) -> None: ...

    def compute_and_reset(self, split: str) -> dict[str, torch.Tensor]: ...

    def logged_names(self) -> list[str]: ...

    def reduce_over(self, group: Any) -> None: ...


def accepted_contracts(task_or_cls: Any) -> tuple[Any, ...]:
    """The contracts a task (class or instance) drives: its ``model_contract``, one or a tuple."""
    contract = getattr(task_or_cls, "model_contract", None)
    if contract is None:
        return ()
    return tuple(contract) if isinstance(contract, tuple) else (contract,)


def declares(model_or_cls: Any, contract: Any) -> bool:
    """Whether a model (class or instance) names ``contract`` in its ``implements``."""
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    return contract in getattr(cls, "implements", ())


def missing_parameters(model_or_cls: Any, contract: Any) -> list[str]:
    """``"method(parameter)"`` for each parameter a ``contract`` method declares that the model's
    method cannot take by that name: ``isinstance`` against a runtime-checkable Protocol checks
    only that the names exist, so a model could miss a keyword a task passes and fail only when
    the option that passes it is on."""
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    missing = []
    for name, declared in vars(contract).items():
        if name.startswith("_") or not inspect.isfunction(declared):
            continue
        own = getattr(cls, name, None)
        if own is None:
            missing.append(f"{name}()")
            continue
        params = inspect.signature(own).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        missing += [f"{name}({p})" for p in list(inspect.signature(declared).parameters)[1:] if p not in params]
    return missing

"""LightningModule for click-through-rate prediction on Criteo-shaped rows (DLRM)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import torch
from torch import nn

from recforge.config_values import Range
from recforge.contracts import CTR_LOGITS, CTRModel, Evaluation
from recforge.data.batches import CTRBatch
from recforge.distributed.data_parallel import (
    average_dense_grads_,
    average_over_replicas_,
    dense_parameters,
    replicate_dense,
)
from recforge.distributed.strategy import sharded_tables
from recforge.errors import UserInputError
from recforge.evaluation import CTREvaluation
from recforge.optim.sparse_capable import has_sparse_gradients
from recforge.tasks.base import RecTask


class CTRTask(RecTask):
    """Trains a :class:`recforge.contracts.CTRModel` on :class:`CTRBatch` es with a click loss and
    evaluates it by the CTR metrics (AUC, logloss, accuracy, calibration) of every row of a split.

    The optimizer factory gets two parameter groups: the dense part, then the embedding tables
    flagged ``{"sparse": True}`` (``model.sparse_parameters()``), so that
    :class:`recforge.optim.dense_sparse.DenseSparseOptimizer` can give the tables their own rule
    (row-wise Adagrad, sparse SGD) while plain optimizers treat both groups alike.

    Args:
        model: factory ``(cardinalities=..., n_dense=...) -> nn.Module`` implementing
            :class:`recforge.contracts.CTRModel`.
        loss: a ``CTR_LOGITS`` loss (``BinaryCrossEntropy``).
        optimizer, evaluation, scheduler, gradient_clip_val, gradient_clip_algorithm: see
            :class:`recforge.tasks.base.RecTask`.
        scheduler_interval: ``step`` (DLRM's warm-up and decay are counted in updates) or ``epoch``.
        embedding_l2: λ of an L2 penalty ``λ/2 · Σ ||table||²`` over the whole embedding tables,
            added to every batch's loss (FuxiCTR's ``embedding_regularizer``, BARS: 1e-5). It
            touches every row at every step, so it needs dense table gradients
            (``model.sparse_gradients=false``).
        cardinalities, n_dense: from the data module (table sizes, dense feature count).
    """

    batch_type = CTRBatch
    model_contract = CTRModel
    produces = CTR_LOGITS
    evaluation_kind = CTREvaluation.kind

    def __init__(
        self,
        model: Callable[..., nn.Module],
        loss: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        evaluation: Evaluation,
        cardinalities: Sequence[Annotated[int, Range(ge=1)]],
        n_dense: Annotated[int, Range(ge=0)] = 13,
        scheduler: Callable | None = None,
        scheduler_interval: Literal["epoch", "step"] = "step",
        gradient_clip_val: Annotated[float, Range(gt=0)] | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        embedding_l2: Annotated[float, Range(ge=0)] = 0.0,
    ) -> None:
        super().__init__(
            optimizer, evaluation, scheduler, gradient_clip_val, gradient_clip_algorithm, scheduler_interval
        )
        self.save_hyperparameters(
            ignore=["model", "loss", "optimizer", "scheduler", "evaluation"], logger=False
        )
        self.model = model(cardinalities=list(cardinalities), n_dense=n_dense)
        self.loss = loss
        self.embedding_l2 = float(embedding_l2)
        self._replicated: list[nn.Parameter] = []  # the dense layers, under a mesh (configure_model)
        if self.embedding_l2 and has_sparse_gradients(self.model):
            raise UserInputError(
                f"task.embedding_l2={embedding_l2} penalises every table row at every step, which needs dense "
                "table gradients: set model.sparse_gradients=false"
            )

    # ------------------------------------------------------------------ placement
    def configure_model(self) -> None:
        """Where the processes exist: under ``hardware=model_parallel*`` (Lightning's
        ``ModelParallelStrategy`` sets ``device_mesh``) the tables' rows are split across the
        mesh's ``tensor_parallel`` dimension, the rest is data-parallel over every rank
        (:mod:`recforge.distributed.data_parallel`); elsewhere a table built sharded is drawn whole.
        Before the optimizer is built (it gets the shards), once per stage (idempotent)."""
        mesh = self.device_mesh
        self.model.shard_tables(None if mesh is None else mesh["tensor_parallel"])
        if mesh is not None:
            self._replicated = dense_parameters(self.model)  # averaged after every backward
            # a table-sharding group's ranks evaluate the same rows: each row counts once
            self.evaluation.reduce_over(mesh["data_parallel"].get_group())

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.device_mesh is not None:
            # once the strategy has put the model on its device: rank 0's dense layers are everyone's
            replicate_dense(self.model, self.device_mesh)

    def on_after_backward(self) -> None:
        # the dense layers are replicated on every rank; a table shard only across the
        # data-parallel ranks that hold the same rows
        mesh = self.device_mesh
        if mesh is not None:
            average_dense_grads_(self._replicated, mesh)
            average_over_replicas_(sharded_tables(self.model).values(), mesh["data_parallel"])

    # ------------------------------------------------------------------ optimisation
    def split_parameters(self) -> tuple[list[nn.Parameter], Any]:
        # the table-sharding ranks of one data-parallel index hold disjoint rows of each table
        mesh = self.device_mesh
        if mesh is None or mesh["tensor_parallel"].size() == 1:
            return [], None
        return [t.weight for t in sharded_tables(self.model).values()], mesh["tensor_parallel"].get_group()

    def optimizer_params(self) -> list[dict]:
        tables = list(self.model.sparse_parameters())
        table_ids = {id(p) for p in tables}
        rest = [p for p in self.parameters() if id(p) not in table_ids]
        groups = [{"params": rest}]
        if tables:
            groups.append({"params": tables, "sparse": True})
        return groups

    # ------------------------------------------------------------------ training
    def regularization(self) -> torch.Tensor | float:
        """``embedding_l2 / 2 · Σ ||table||²`` (0 without ``embedding_l2``)."""
        if not self.embedding_l2:
            return 0.0
        return self.embedding_l2 / 2 * sum(table.pow(2).sum() for table in self.model.sparse_parameters())

    def train_loss(self, batch: CTRBatch) -> torch.Tensor:
        """The click loss of one batch plus the embedding penalty (no update: training_step makes it)."""
        return self.loss(self.model(batch.dense, batch.sparse), batch.labels) + self.regularization()

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, batch: CTRBatch, split: str) -> None:
        self.evaluation.update(split, self.model(batch.dense, batch.sparse), batch.labels)

    def validation_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

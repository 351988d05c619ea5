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
from recforge.models.dlrm_fused_step import fused_sgd_step_loss, fused_step_unsupported
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
        fast_step: the opt-in fast training step (``task.fast_step=true``): the step's forward and
            backward written out, plain SGD applied inside the backward to every parameter
            (:mod:`recforge.models.dlrm_fused_step`; the parameters get no ``.grad``). For the
            reference's model: DLRM with the dot interaction, plain MLPs, one id per feature,
            ``optimizer=sgd`` without momentum or weight decay, one process, no clipping. Same
            losses and updates as the default step to float round-off, in fewer operations.
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
        fast_step: bool = False,
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
        self.fast_step = bool(fast_step)
        self._learning_rates = None  # the fused step's (dense, tables) rates, from configure_optimizers
        if self.fast_step:
            refusal = fused_step_unsupported(self.model)
            if refusal is None and self.embedding_l2:
                refusal = f"task.embedding_l2={embedding_l2} (the fused step has no penalty term)"
            if refusal is None and gradient_clip_val:
                refusal = f"task.gradient_clip_val={gradient_clip_val} (the fused step forms no gradient to clip)"
            if refusal is not None:
                raise UserInputError(f"task.fast_step=true cannot run with {refusal}: set task.fast_step=false")
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
        if mesh is not None and self.fast_step:
            raise UserInputError("task.fast_step=true runs in one process and shards nothing: set "
                                 "task.fast_step=false under hardware=model_parallel*")
        self.model.shard_tables(None if mesh is None else mesh["tensor_parallel"])
        if mesh is not None:
            self._replicated = dense_parameters(self.model)  # averaged after every backward
            # a table-sharding group's ranks evaluate the same rows: each row counts once
            self.evaluation.reduce_over(mesh["data_parallel"].get_group())

    def setup(self, stage: str) -> None:
        if self.fast_step and stage == "fit" and self.trainer.world_size > 1:
            raise UserInputError(
                f"task.fast_step=true updates in the backward, before any all-reduce, so it runs in one process "
                f"(this run has {self.trainer.world_size}): set task.fast_step=false")
        super().setup(stage)

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

    def configure_optimizers(self):
        configured = super().configure_optimizers()
        if self.fast_step:
            optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
            self._learning_rates = _plain_sgd_rates(optimizer)
        return configured

    def optimize(self, loss: torch.Tensor) -> None:
        if not self.fast_step:
            super().optimize(loss)
            return
        # the backward is the update (one process: no padding steps, no gradient to clear or clip)
        optimizer = self.optimizers()
        self.manual_backward(loss)
        # No parameter has a gradient, so the step changes nothing; it is how Lightning counts an
        # update (trainer.global_step: max_steps, step-wise checkpoints and logging, a resumed run)
        optimizer.step()
        self.step_scheduler_per_update()

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
        """The click loss of one batch plus the embedding penalty (no update: training_step makes
        it; under ``fast_step`` the loss's backward makes it)."""
        if self.fast_step:
            if self._learning_rates is None:
                raise RuntimeError("task.fast_step=true reads its learning rates from the optimizer: "
                                   "call configure_optimizers first")
            return fused_sgd_step_loss(self.model, batch.dense, batch.sparse, batch.labels, self._learning_rates)
        return self.loss(self.model(batch.dense, batch.sparse), batch.labels) + self.regularization()

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, batch: CTRBatch, split: str) -> None:
        self.evaluation.update(split, self.model(batch.dense, batch.sparse), batch.labels)

    def validation_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")


def _plain_sgd_rates(optimizer: torch.optim.Optimizer):
    """``() -> (dense lr, tables' lr)`` read from ``optimizer``'s groups when called (a scheduler's
    changes included), or a one-line error unless it is plain SGD, the rule the fused step applies."""
    if type(optimizer) is not torch.optim.SGD:
        raise UserInputError(
            f"task.fast_step=true applies plain SGD inside the backward: it needs optimizer=sgd, got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__} (or set task.fast_step=false)")
    for group in optimizer.param_groups:
        extras = {k: group[k] for k in ("momentum", "weight_decay") if group[k]}
        extras.update({k: True for k in ("nesterov", "maximize") if group[k]})
        if extras:
            settings = ", ".join(f"optimizer.{k}={v}" for k, v in extras.items())
            raise UserInputError(f"task.fast_step=true applies plain SGD (no momentum, weight decay, nesterov or "
                                 f"maximize), got {settings}: unset them or set task.fast_step=false")
    dense, tables = optimizer.param_groups[0], optimizer.param_groups[-1]

    def rates() -> tuple[float, float]:
        return float(dense["lr"]), float(tables["lr"])

    return rates

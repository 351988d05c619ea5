"""LightningModule for session-based next-item models trained session-parallel (GRU4Rec)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Literal, get_args

import lightning as L
import numpy as np
import torch
from torch import nn

from recforge.config_values import Range
from recforge.errors import UserInputError
from recforge.data.batches import SessionStep, SessionSteps
from recforge.data.negatives import PopularitySampler
from recforge.kernels import target_rank_counts
from recforge.kernels.twin import KernelImpl
from recforge.losses.sampled import NEXT_ITEM_COLUMNS, SampledLoss
from recforge.metrics import RankingMetrics
from recforge.optim.clipping import clip_grad_norm_, clip_grad_value_
from recforge.optim.sparse_grad_sync import average_sparse_grads_, sparse_parameter_names


class SessionNextItemTask(L.LightningModule):
    """Trains a step-wise session model on :class:`SessionStep` batches and ranks the catalogue.

    The hidden state lives here between steps (detached: no BPTT) and follows each batch's
    keep/reset instructions. Evaluation scores the full catalogue in tiles and feeds the rank of
    every target to a :class:`RankingMetrics` whose sums DDP reduces.

    Args:
        model: factory ``(n_items=...) -> nn.Module`` with ``train_step``, ``step``,
            ``item_weights`` and ``state_widths`` (see :class:`recforge.models.gru4rec.GRU4Rec`).
        loss: a sampled next-item loss.
        optimizer: factory ``(params) -> torch.optim.Optimizer``.
        n_items, item_popularity: the training catalogue (from the data module).
        batch_size: the configured training batch size; losses are normalised by it.
        evaluation: ``ks``, ``metrics``, ``ties``, ``chunk_size``, ``kernel`` of the ranking protocol.
        n_sample: extra negatives per mini-batch, shared by its rows, drawn with P ∝ pop^alpha
            (0: the mini-batch's own targets are the only negatives).
        sample_alpha, sample_store_size: the sampling distribution's exponent and how many draws
            are made at once.
        seed: seed of the negative sampler (one independent stream per DDP rank).
        gradient_clip_val, gradient_clip_algorithm: optional clipping ("norm" or "value") of
            the gradients, sparse item-table gradients included (the task optimises manually, so
            this replaces the Trainer's own clipping options).
    """

    batch_type = SessionStep
    produces = NEXT_ITEM_COLUMNS

    def __init__(
        self,
        model: Callable[..., nn.Module],
        loss: SampledLoss,
        optimizer: Callable[..., torch.optim.Optimizer],
        n_items: int,
        item_popularity: Sequence[int] | np.ndarray | torch.Tensor,
        batch_size: Annotated[int, Range(ge=1)],
        evaluation: dict,
        scheduler: Callable | None = None,
        n_sample: Annotated[int, Range(ge=0)] = 0,
        sample_alpha: Annotated[float, Range(ge=0)] = 0.5,
        sample_store_size: Annotated[int, Range(ge=1)] = 10_000_000,
        seed: int | None = 0,
        gradient_clip_val: Annotated[float, Range(gt=0)] | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
    ) -> None:
        super().__init__()
        self.save_hyperparameters(
            ignore=["model", "loss", "optimizer", "scheduler", "item_popularity"], logger=False
        )
        self.model = model(n_items=n_items)
        self.loss = loss
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.batch_size = int(batch_size)
        popularity = torch.as_tensor(np.asarray(item_popularity), dtype=torch.float64)
        # float32 holds counts exactly up to 2**24 events per item
        self.register_buffer("popularity", popularity.float())
        self.register_buffer("log_popularity", torch.log(popularity.float().clamp_min(1.0)))
        evaluation = dict(evaluation)
        self.chunk_size = evaluation.pop("chunk_size", 8192)
        self.rank_kernel = evaluation.pop("kernel", "pytorch")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise UserInputError(f"evaluation.chunk_size={self.chunk_size}: expected an integer >= 1")
        if self.rank_kernel not in get_args(KernelImpl):
            raise UserInputError(
                f"evaluation.kernel={self.rank_kernel}: expected one of {', '.join(get_args(KernelImpl))}"
            )
        try:
            self.val_metrics = RankingMetrics(**evaluation)
        except (ValueError, TypeError) as error:  # the protocol's keys: ks, metrics, ties
            raise UserInputError(f"evaluation: {error}") from error
        self.test_metrics = RankingMetrics(**evaluation)
        # Manual optimisation: GRU4Rec's step is small, and Lightning's closure machinery cost a
        # quarter of it; it also lets a padded DDP step join the all-reduce without an update.
        self.automatic_optimization = False
        self.gradient_clip_val = gradient_clip_val
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}")
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.n_sample = int(n_sample)
        self.sample_alpha = float(sample_alpha)
        self.sample_store_size = int(sample_store_size)
        self.seed = int(seed or 0)
        self._sampler: PopularitySampler | None = None
        self._sampler_state: dict | None = None
        self._train_hidden: list[torch.Tensor] | None = None
        self._eval_hidden: list[torch.Tensor] | None = None
        self._sparse_synced: list[nn.Parameter] = []

    def setup(self, stage: str) -> None:
        # Before the strategy wraps the module: under DDP the sparse item tables are averaged by
        # the task (optim/sparse_grad_sync.py), not by DDP's sparse all-reduce.
        if self.trainer.world_size > 1:
            names = sparse_parameter_names(self)
            self._ddp_params_and_buffers_to_ignore = names
            self._sparse_synced = [self.get_parameter(name) for name in names]

    def on_fit_start(self) -> None:
        # DDP reads the ignore list when it wraps the module: if a strategy wrapped it earlier,
        # these gradients would be averaged twice, silently.
        ignored = getattr(self.trainer.strategy.model, "parameters_to_ignore", None)
        if not self._sparse_synced or ignored is None:
            return
        reduced_twice = sorted(set(self._ddp_params_and_buffers_to_ignore) - set(ignored))
        if reduced_twice:
            raise RuntimeError(f"DDP still reduces {reduced_twice}, which the task averages itself")

    @property
    def min_batch_rows(self) -> int:
        return self.loss.min_batch_rows(self.n_sample)

    # ------------------------------------------------------------------ training
    @property
    def sampler(self) -> PopularitySampler | None:
        if self.n_sample > 0 and self._sampler is None:
            self._sampler = PopularitySampler(
                self.popularity.cpu(),
                self.n_sample,
                self.sample_alpha,
                self.sample_store_size,
                seed=self.seed,
                stream=self.global_rank,
                device=self.device,
            )
            if self._sampler_state is not None:
                self._sampler.load_state_dict(self._sampler_state)
        return self._sampler

    def on_train_epoch_start(self) -> None:
        self._train_hidden = None
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_steps = 0

    def training_step(self, batch: SessionStep | SessionSteps, batch_idx: int) -> torch.Tensor:
        # A grouped batch (data.steps_per_batch > 1) is several steps, each with its own update.
        steps = batch.steps if isinstance(batch, SessionSteps) else (batch,)
        for step in steps:
            loss = self._train_step(step)
        # Lightning's per-call logging costs ~5% of a GRU4Rec step: the epoch mean is summed in
        # _train_step and the step value is handed over only as often as the loggers write it.
        if steps[-1].size and batch_idx % self.trainer.log_every_n_steps == 0:
            self.log("train/loss_step", loss, prog_bar=True, batch_size=steps[-1].size)
        return loss

    def _train_step(self, batch: SessionStep) -> torch.Tensor:
        if batch.size == 0:
            # A DDP rank that ran out of sessions still joins the gradient all-reduce, with a
            # zero loss built through the same parameters so every gradient has the same layout.
            # (two rows: every loss, BPR-max without extra samples included, needs a negative)
            batch = SessionStep(
                inputs=torch.zeros(2, dtype=torch.long, device=self.device),
                targets=torch.zeros(2, dtype=torch.long, device=self.device),
                reset=torch.ones(2, dtype=torch.bool, device=self.device),
            )
            loss = self._train_loss(batch, hidden=None) * 0.0
            self._train_hidden = [h[:0] for h in self._train_hidden] if self._train_hidden else None
            self._optimize(loss, step=False)
            return loss
        loss = self._train_loss(batch, self._train_hidden)
        self._optimize(loss)
        self._loss_sum += loss.detach()
        self._loss_steps += 1
        return loss

    def _optimize(self, loss: torch.Tensor, step: bool = True) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        if self._sparse_synced:
            average_sparse_grads_(self._sparse_synced)
        if not step:
            return  # the gradients were all-reduced; a padded step must not move momentum
        if self.gradient_clip_val:
            self.configure_gradient_clipping(optimizer, self.gradient_clip_val, self.gradient_clip_algorithm)
        optimizer.step()

    def _train_loss(self, batch: SessionStep, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        state = batch.carry_hidden(hidden, self.model.state_widths, self.model.Wy.weight.dtype)
        negatives = self.sampler.sample() if self.sampler is not None else None
        columns = batch.targets if negatives is None else torch.cat([batch.targets, negatives])
        log_q = None
        if self.loss.uses_log_q:
            # q of an in-batch target is its raw popularity; of a sampled column, pop^alpha
            log_q = self.log_popularity[batch.targets]
            if negatives is not None:
                log_q = torch.cat([log_q, self.sample_alpha * self.log_popularity[negatives]])
        scores, new_state = self.model.train_step(batch.inputs, state, columns)
        self._train_hidden = [h.detach() for h in new_state]
        return self.loss(scores, self.batch_size, log_q=log_q)

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        # Lightning's own clipping cannot take norms of the item tables' sparse gradients.
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm == "value":
            clip_grad_value_(self.parameters(), gradient_clip_val)
        else:
            clip_grad_norm_(self.parameters(), gradient_clip_val)

    def on_train_epoch_end(self) -> None:
        if self._loss_steps:
            mean = self._loss_sum / self._loss_steps
            self.log("train/loss_epoch", mean, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()  # manual optimisation steps its schedulers itself, once per epoch

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._sampler is not None:
            checkpoint["negative_sampler"] = self._sampler.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._sampler_state = checkpoint.get("negative_sampler")
        self._sampler = None

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer=optimizer)}

    # ------------------------------------------------------------------ evaluation
    def on_validation_epoch_start(self) -> None:
        self._eval_hidden = None

    def on_test_epoch_start(self) -> None:
        self._eval_hidden = None

    def _rank_targets(self, batch: SessionStep, metrics: RankingMetrics) -> None:
        state = batch.carry_hidden(self._eval_hidden, self.model.state_widths, self.model.Wy.weight.dtype)
        output, self._eval_hidden = self.model.step(batch.inputs, state)
        weights, bias = self.model.item_weights()
        n_greater, n_equal = target_rank_counts(
            output, weights, bias, batch.targets, chunk_size=self.chunk_size, impl=self.rank_kernel
        )
        metrics.update_from_counts(n_greater, n_equal)

    def validation_step(self, batch: SessionStep, batch_idx: int) -> None:
        self._rank_targets(batch, self.val_metrics)

    def test_step(self, batch: SessionStep, batch_idx: int) -> None:
        self._rank_targets(batch, self.test_metrics)

    def _log_metrics(self, prefix: str, metrics: RankingMetrics) -> None:
        values = metrics.compute()  # reduces the count sums across DDP ranks
        self.log_dict({f"{prefix}/{k}": v.float() for k, v in values.items()}, sync_dist=False)
        metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test", self.test_metrics)

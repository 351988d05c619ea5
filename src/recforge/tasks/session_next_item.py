"""LightningModule for session-based next-item models trained session-parallel (GRU4Rec)."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import numpy as np
import torch
from torch import nn

from recforge.config_values import Range
from recforge.contracts import NEXT_ITEM_COLUMNS, SessionModel
from recforge.data.batches import SessionStep, SessionSteps
from recforge.data.negatives import PopularitySampler
from recforge.evaluation import FullRanking
from recforge.losses.sampled import SampledLoss
from recforge.tasks.base import RecTask


class SessionNextItemTask(RecTask):
    """Trains a step-wise session model on :class:`SessionStep` batches and ranks the catalogue.

    The hidden state lives here between steps (detached: no BPTT) and follows each batch's
    keep/reset instructions. Evaluation ranks every target against the full catalogue
    (:class:`recforge.evaluation.FullRanking`).

    Args:
        model: factory ``(n_items=...) -> nn.Module`` implementing :class:`SessionModel`.
        loss: a sampled next-item loss.
        optimizer, evaluation, scheduler, scheduler_interval, gradient_clip_val, gradient_clip_algorithm: see
            :class:`recforge.tasks.base.RecTask`.
        n_items, item_popularity: the training catalogue (from the data module).
        batch_size: the configured training batch size; losses are normalised by it.
        n_sample: extra negatives per mini-batch, shared by its rows, drawn with P ∝ pop^alpha
            (0: the mini-batch's own targets are the only negatives).
        sample_alpha, sample_store_size: the sampling distribution's exponent and how many draws
            are made at once.
        seed: seed of the negative sampler (one independent stream per DDP rank).
        fast_step: the opt-in fast training step (``task.fast_step=true``): scores and
            gradients over each distinct item row once, which sums duplicate rows in another
            order than the reference. Off, training retraces the official code bit for bit.
    """

    batch_type = SessionStep
    model_contract = SessionModel
    produces = NEXT_ITEM_COLUMNS
    evaluation_kind = FullRanking.kind

    def __init__(
        self,
        model: Callable[..., nn.Module],
        loss: SampledLoss,
        optimizer: Callable[..., torch.optim.Optimizer],
        evaluation: FullRanking,
        n_items: int,
        item_popularity: Sequence[int] | np.ndarray | torch.Tensor,
        batch_size: Annotated[int, Range(ge=1)],
        scheduler: Callable | None = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        n_sample: Annotated[int, Range(ge=0)] = 0,
        sample_alpha: Annotated[float, Range(ge=0)] = 0.5,
        sample_store_size: Annotated[int, Range(ge=1)] = 10_000_000,
        seed: int | None = 0,
        gradient_clip_val: Annotated[float, Range(gt=0)] | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        fast_step: bool = False,
    ) -> None:
        super().__init__(optimizer, evaluation, scheduler, gradient_clip_val, gradient_clip_algorithm,
                         scheduler_interval=scheduler_interval)
        self.save_hyperparameters(
            ignore=["model", "loss", "optimizer", "scheduler", "evaluation", "item_popularity"], logger=False
        )
        self.model = model(n_items=n_items)
        self.loss = loss
        self.batch_size = int(batch_size)
        popularity = torch.as_tensor(np.asarray(item_popularity), dtype=torch.float64)
        # float32 holds counts exactly up to 2**24 events per item
        self.register_buffer("popularity", popularity.float())
        self.register_buffer("log_popularity", torch.log(popularity.float().clamp_min(1.0)))
        self.n_sample = int(n_sample)
        self.sample_alpha = float(sample_alpha)
        self.sample_store_size = int(sample_store_size)
        self.seed = int(seed or 0)
        self.fast_step = bool(fast_step)
        self.register_lazy("negative_sampler", self._new_sampler)
        self._train_hidden: list[torch.Tensor] | None = None
        self._eval_hidden: list[torch.Tensor] | None = None

    @property
    def min_batch_rows(self) -> int:
        return self.loss.min_batch_rows(self.n_sample)

    # ------------------------------------------------------------------ training
    def _new_sampler(self) -> PopularitySampler | None:
        if self.n_sample == 0:
            return None
        return PopularitySampler(
            self.popularity.cpu(),
            self.n_sample,
            self.sample_alpha,
            self.sample_store_size,
            seed=self.seed,
            stream=self.global_rank,
            device=self.device,
        )

    @property
    def sampler(self) -> PopularitySampler | None:
        return self.lazy("negative_sampler")

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._train_hidden = None

    # ------------------------------------------------------------------ resuming inside an epoch
    # A checkpoint saved inside an epoch carries the hidden state of the sessions in flight; the
    # resumed run's loader skips the steps already trained (data.base's resumable loader) and the
    # next step continues those sessions as an uninterrupted run would. Under DDP each rank holds
    # other sessions: every rank's travel in the checkpoint (RecTask.rank_local_keys), and a
    # resume on another number of ranks restarts them from zero.
    rank_local_keys = ("train_hidden",)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._train_hidden is not None:
            checkpoint["train_hidden"] = [h.detach().cpu() for h in self._train_hidden]
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._resumed_hidden = checkpoint.get("train_hidden")

    def on_train_start(self) -> None:
        super().on_train_start()
        resumed, self._resumed_hidden = getattr(self, "_resumed_hidden", None), None
        if resumed is not None and (self.trainer.world_size == 1 or self.has_own_rank_state):
            self._train_hidden = [h.to(self.device) for h in resumed]

    def training_step(self, batch: SessionStep | SessionSteps, batch_idx: int) -> torch.Tensor:
        # A grouped batch (data.steps_per_batch > 1) is several steps, each with its own update.
        steps = batch.steps if isinstance(batch, SessionSteps) else (batch,)
        self.batch_cut_after = None
        left = self._updates_left()
        if left is not None and left < len(steps):
            # trainer.max_steps counts updates, and Lightning checks it between batches only: the
            # group ends at the limit and keeps just the steps that ran, which is what the
            # callbacks after this (events counted, logged) then read; a checkpoint of this step
            # resumes with the group's other steps (data.resumable)
            steps = batch.steps = batch.steps[:left]
            self.batch_cut_after = left
        for step in steps:
            loss = self._train_step(step)
        self.log_step_loss(loss, batch_idx, steps[-1].size)
        return loss

    def _updates_left(self) -> int | None:
        """Updates ``trainer.max_steps`` still allows (None without a step limit)."""
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            return None
        return max_steps - self.trainer.global_step

    def _train_step(self, batch: SessionStep) -> torch.Tensor:
        if batch.size == 0:
            # A DDP rank that ran out of sessions still joins the gradient all-reduce, with a
            # zero loss built through the same parameters so every gradient has the same layout,
            # and applies the averaged update as the other ranks do (RecTask.optimize).
            # (two rows: every loss, BPR-max without extra samples included, needs a negative)
            batch = SessionStep(
                inputs=torch.zeros(2, dtype=torch.long, device=self.device),
                targets=torch.zeros(2, dtype=torch.long, device=self.device),
                reset=torch.ones(2, dtype=torch.bool, device=self.device),
            )
            loss = self._train_loss(batch, hidden=None) * 0.0
            self._train_hidden = [h[:0] for h in self._train_hidden] if self._train_hidden else None
            self.optimize(loss)
            return loss
        loss = self.train_loss(batch)
        self.optimize(loss)
        self.record_loss(loss)
        return loss

    def train_loss(self, batch: SessionStep) -> torch.Tensor:
        """The loss of one session-parallel step, the hidden state carried on from the previous
        one; the update is the caller's (``training_step`` makes it; benchmarks time both)."""
        return self._train_loss(batch, self._train_hidden)

    def _train_loss(self, batch: SessionStep, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        state = batch.carry_hidden(hidden, self.model.state_widths, self.model.param_dtype)
        negatives = self.sampler.sample() if self.sampler is not None else None
        fused = (self.fast_step and getattr(self.model, "fused_step_supported", False)
                 and self.loss.has_value_and_grad)
        counts = None
        if fused and negatives is not None and self.loss.prefers_counted_columns:
            # Each distinct negative scored once and counted as often as it was drawn (about a
            # third of 2,048 draws repeat on the sample): the loss's sums are the same, over
            # fewer columns. The targets' columns stay as they are, one per row.
            negatives, drawn = torch.unique(negatives, return_counts=True)
            counts = torch.cat([drawn.new_ones(len(batch.targets)), drawn]).to(self.model.param_dtype)
        columns = batch.targets if negatives is None else torch.cat([batch.targets, negatives])
        log_q = None
        if self.loss.uses_log_q:
            # q of an in-batch target is its raw popularity; of a sampled column, pop^alpha
            log_q = self.log_popularity[batch.targets]
            if negatives is not None:
                log_q = torch.cat([log_q, self.sample_alpha * self.log_popularity[negatives]])
        if fused:
            # the whole step in one autograd node, its backward written out (GRU4Rec's presets)
            loss, new_hidden = self.model.fused_train_step(
                batch.inputs, state[0], columns,
                functools.partial(self.loss.fast_value_and_grad, batch_size=self.batch_size, log_q=log_q,
                                  counts=counts))
            self._train_hidden = [new_hidden]
            return loss
        scores, new_state = self.model.train_step(batch.inputs, state, columns, distinct_rows=self.fast_step)
        self._train_hidden = [h.detach() for h in new_state]
        loss = self.loss.fast if self.fast_step else self.loss
        return loss(scores, self.batch_size, log_q=log_q)

    # ------------------------------------------------------------------ evaluation
    def on_validation_epoch_start(self) -> None:
        self._eval_hidden = None

    def on_test_epoch_start(self) -> None:
        self._eval_hidden = None

    def _rank_targets(self, batch: SessionStep, split: str) -> None:
        state = batch.carry_hidden(self._eval_hidden, self.model.state_widths, self.model.param_dtype)
        output, self._eval_hidden = self.model.step(batch.inputs, state)
        weights, bias = self.model.item_weights()
        self.evaluation.update(split, output, weights, bias, batch.targets)

    def validation_step(self, batch: SessionStep, batch_idx: int) -> None:
        self._rank_targets(batch, "val")

    def test_step(self, batch: SessionStep, batch_idx: int) -> None:
        self._rank_targets(batch, "test")

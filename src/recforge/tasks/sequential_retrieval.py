"""LightningModule for generative sequential retrieval over jagged user histories (SASRec, HSTU)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import numpy as np
import torch
from torch import nn

from recforge.config_values import Range
from recforge.contracts import SEQUENCE_POSITIONS, SequenceModel, TimedSequenceModel, declares
from recforge.data.batches import HistoryBatch
from recforge.data.negatives import negatives_generator_seed
from recforge.evaluation import FullRanking
from recforge.kernels.jagged import next_item_positives
from recforge.tasks.base import RecTask
from recforge.utils.seeds import step_seed


class SequentialRetrievalTask(RecTask):
    """Trains a sequence encoder on :class:`HistoryBatch` es, every position supervised, and ranks
    the full catalogue for each user's target.

    Training: the encoder reads each jagged history; position p's vector predicts the history's
    next item and the last position predicts the batch's target (spec §1.5); the loss compares
    them with the item table. Evaluation: each row's last vector is the query; the catalogue is
    ranked with the model's item vectors, the batch's exclusion lists (the history, as the data's
    ``exclude`` policy says) never counted (:class:`recforge.evaluation.FullRanking`).

    A model declaring :class:`recforge.contracts.TimedSequenceModel` (HSTU) also gets the items'
    timestamps and, per position, the time of the event it predicts (the next item's; at the
    last position the target's, in training and in evaluation, as the reference does).

    Args:
        model: factory ``(n_items=..., max_sequence_length=...) -> nn.Module`` implementing
            :class:`recforge.contracts.SequenceModel` or
            :class:`recforge.contracts.TimedSequenceModel`.
        loss: a ``SEQUENCE_POSITIONS`` loss (``SampledSoftmax``, ``FullSoftmax``); one with a
            ``manual_seed`` draws its negatives from a stream derived from (seed, DDP rank).
        optimizer, evaluation, scheduler, scheduler_interval, gradient_clip_val, gradient_clip_algorithm: see
            :class:`recforge.tasks.base.RecTask`.
        n_items, item_popularity, max_seq_len: from the data module (catalogue size, counts,
            longest history it hands out).
        seed: the run's seed, from which the negatives' stream is derived.
    """

    batch_type = HistoryBatch
    model_contract = (SequenceModel, TimedSequenceModel)
    produces = SEQUENCE_POSITIONS
    evaluation_kind = FullRanking.kind

    def __init__(
        self,
        model: Callable[..., nn.Module],
        loss: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        evaluation: FullRanking,
        n_items: int,
        item_popularity: Sequence[int] | np.ndarray | torch.Tensor,
        max_seq_len: Annotated[int, Range(ge=1)],
        scheduler: Callable | None = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        seed: int | None = 0,
        gradient_clip_val: Annotated[float, Range(gt=0)] | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
    ) -> None:
        super().__init__(optimizer, evaluation, scheduler, gradient_clip_val, gradient_clip_algorithm,
                         scheduler_interval=scheduler_interval)
        self.save_hyperparameters(
            ignore=["model", "loss", "optimizer", "scheduler", "evaluation", "item_popularity"], logger=False
        )
        self.model = model(n_items=n_items, max_sequence_length=max_seq_len)
        self.timed = declares(self.model, TimedSequenceModel)
        self.loss = loss
        self.n_items = int(n_items)
        self.seed = int(seed or 0)
        self._pass_catalogue: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # one stream of negatives per rank, none of them the global generator's (which drew the
        # initial weights); a checkpoint's saved position replaces it on resume
        if hasattr(self.loss, "manual_seed"):
            self.loss.manual_seed(negatives_generator_seed(self.seed, self.global_rank))

    def on_train_batch_start(self, batch: HistoryBatch, batch_idx: int) -> None:
        # dropout (and HSTU's mask-hash seeds) draw from torch's global generator, which a
        # checkpoint does not carry and a resumed run's loaders and sanity check move: seeded per
        # step, step t draws the same in a resumed run as in an uninterrupted one
        torch.manual_seed(step_seed(self.seed, self.global_rank, self.global_step))

    def encode(self, batch: HistoryBatch) -> torch.Tensor:
        """The model's vector at every position of the batch, ``[ΣL, D]``."""
        return self.model(batch.items, batch.offsets, *self._times(batch))

    def encode_last(self, batch: HistoryBatch) -> torch.Tensor:
        """Each row's query, the model's vector at its last position ``[B, D]``."""
        return self.model.encode_last(batch.items, batch.offsets, *self._times(batch))

    def _times(self, batch: HistoryBatch) -> tuple[torch.Tensor, ...]:
        if not self.timed:
            return ()
        # the time of what each position predicts: the same shift as the positives', applied to
        # the times (next item's time, the target's at a row's last position)
        query_times = next_item_positives(batch.timestamps, batch.offsets, batch.target_timestamps)
        return batch.timestamps, query_times

    # ------------------------------------------------------------------ training
    def train_loss(self, batch: HistoryBatch) -> torch.Tensor:
        """The loss of one batch, every position supervised (no update: training_step makes it)."""
        outputs = self.encode(batch)
        positives = next_item_positives(batch.items, batch.offsets, batch.targets)
        return self.loss(outputs, positives, self.model.item_table)

    # ------------------------------------------------------------------ evaluation
    def _catalogue(self) -> torch.Tensor:
        # the normalised item vectors, once per evaluation pass (the weights do not change inside
        # one): at Books' 695,762 items, normalising them took ~10% of a batch's ranking
        if self._pass_catalogue is None:
            self._pass_catalogue = self.model.item_embeddings()
        return self._pass_catalogue

    def _rank_targets(self, batch: HistoryBatch, split: str) -> None:
        queries = self.encode_last(batch)
        self.evaluation.update(
            split, queries, self._catalogue(), None, batch.targets,
            exclude_items=batch.exclude_items, exclude_offsets=batch.exclude_offsets,
        )

    def on_validation_epoch_start(self) -> None:
        self._pass_catalogue = None

    def on_test_epoch_start(self) -> None:
        self._pass_catalogue = None

    def on_validation_epoch_end(self) -> None:
        self._pass_catalogue = None
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self._pass_catalogue = None
        super().on_test_epoch_end()

    def validation_step(self, batch: HistoryBatch, batch_idx: int) -> None:
        self._rank_targets(batch, "val")

    def test_step(self, batch: HistoryBatch, batch_idx: int) -> None:
        self._rank_targets(batch, "test")

"""Every task's public ``train_loss`` is the loss its ``training_step`` optimises.

A Trainer runs one training batch and records the loss handed to ``optimize`` (with the batch and
the global random state when its step began); a twin task, built from the same seed, then computes
``train_loss`` on that batch from that random state, after the module's own batch-start hook as the
Trainer runs it: the two must be equal bit for bit. The CTR
task's loss is also checked against BCE plus the embedding penalty computed here by hand.
"""
from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from recforge.data.negatives import negatives_generator_seed
from recforge.pipeline import build


class FirstUpdate(L.Callback):
    """The first training batch and the global RNG state when its step began."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.batch = copy.deepcopy(batch)
            self.rng = torch.get_rng_state()


def _optimised_loss(cfg):
    """The loss the first ``optimize`` call of a one-batch fit receives, the batch and RNG state."""
    L.seed_everything(cfg.seed, verbose=False)
    datamodule, task = build(cfg)
    seen = []
    optimize = task.optimize

    def recording(loss):
        seen.append(loss.detach().clone())
        return optimize(loss)

    task.optimize = recording
    first = FirstUpdate()
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[first],
    )
    trainer.fit(task, datamodule=datamodule)
    return seen[0], first.batch, first.rng


def _twin_loss(cfg, batch, rng):
    L.seed_everything(cfg.seed, verbose=False)
    _, twin = build(cfg)
    twin.train()
    twin.on_train_epoch_start()
    if hasattr(twin.loss, "manual_seed"):  # what the task's setup seeds under a Trainer (rank 0)
        twin.loss.manual_seed(negatives_generator_seed(twin.seed, 0))
    first = batch.steps[0] if hasattr(batch, "steps") else batch  # a grouped batch: its first update
    torch.set_rng_state(rng)
    # what the Trainer runs after the callbacks' hook and before the step: the module's own
    # (the sequential task seeds the global generator for the step there)
    twin.on_train_batch_start(batch, 0)
    with torch.no_grad():
        return twin.train_loss(first)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        # dropout and sampled negatives with logq: the global and the sampler's random streams
        ("model=gru4rec", "loss=xe", "loss.logq=1.0", "model.dropout_p_hidden=0.3", "task.n_sample=16"),
        ("model=sasrec",),
        ("model=hstu",),
        ("model=dlrm",),
        ("model=dlrm", "task.embedding_l2=0.01", "model.sparse_gradients=false"),
    ],
    ids=["gru4rec", "sasrec", "hstu", "dlrm", "dlrm-embedding-l2"],
)
def test_train_loss_is_what_training_step_optimises(make_cfg, overrides):
    cfg = make_cfg(*overrides)
    optimised, batch, rng = _optimised_loss(cfg)
    twin = _twin_loss(cfg, batch, rng)
    assert torch.isfinite(optimised) and optimised.ndim == 0
    assert torch.equal(twin, optimised), (float(twin), float(optimised))


@pytest.mark.slow
def test_ctr_train_loss_is_bce_plus_the_embedding_penalty(make_cfg):
    cfg = make_cfg("model=dlrm", "task.embedding_l2=0.5", "model.sparse_gradients=false")
    L.seed_everything(cfg.seed, verbose=False)
    datamodule, task = build(cfg)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    with torch.no_grad():
        logits = task.model(batch.dense, batch.sparse)
        penalty = sum(float(t.double().pow(2).sum()) for t in task.model.sparse_parameters())
        expected = float(F.binary_cross_entropy_with_logits(logits.double(), batch.labels.double())) + 0.25 * penalty
        got = float(task.train_loss(batch))
    assert penalty > 0
    assert got == pytest.approx(expected, rel=1e-5)

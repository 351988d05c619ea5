"""Checkpointing and early stopping that act only on a validation pass that logged their monitor.

Lightning's ``trainer.callback_metrics`` keeps a metric's last value until it is logged again, so a
callback following ``val/ndcg@10`` on an epoch that did not log it (a partial validation, which
logs ``val_sample/...`` only: :class:`recforge.evaluation.FullRanking`'s ``max_users``) would
compare a stale figure, count a non-improvement towards the patience, or refuse to run when a
resumed fit starts on such an epoch. These two act on a pass only if the task's last validation
logged their monitor (``RecTask.last_validation_logged``); with every user validated every epoch
that is every pass, and they are Lightning's own.

A resumed run writes into its own run directory, and Lightning forgets the best checkpoint of a
checkpoint saved under another directory ("The dirpath has changed ..."): the resumed run would
then test, and report as best, whatever its own epochs reached. :class:`ModelCheckpoint` carries
the best ones over instead: it copies them into the new directory, so the resumed run is whole on
its own and its top-k bookkeeping never deletes a file of the earlier run.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch import callbacks
from lightning.pytorch.trainer.states import TrainerFn

from recforge.utils.atomic import apply_umask

log = logging.getLogger(__name__)


def logged_by_last_validation(monitor: str | None, pl_module: L.LightningModule) -> bool:
    """Whether the last validation pass gave ``monitor`` a fresh value (True when the module does
    not say which names it logged, or when nothing is monitored)."""
    logged = getattr(pl_module, "last_validation_logged", None)
    return monitor is None or logged is None or monitor in logged


class ModelCheckpoint(callbacks.ModelCheckpoint):
    """:class:`lightning.pytorch.callbacks.ModelCheckpoint` that never picks a checkpoint on a pass
    that did not log its monitor, and whose ``last.ckpt`` (``save_last``) is the run's latest state.

    Lightning 2.6 writes ``last.ckpt`` only beside a new top-k checkpoint, so the epochs after the
    best were in no file: a resume went back to the best epoch, and ``src/eval.py`` of ``last.ckpt``
    tested it. Here ``last.ckpt`` is written at every point Lightning would checkpoint (an epoch's
    end, a validation inside one), at the update that reaches ``trainer.max_steps`` (inside the
    epoch: resumed with a larger limit, the run goes on as if uninterrupted), and at the end of
    training if anything trained since (a ``trainer.max_time`` stop).

    With a monitor and ``every_n_train_steps``, Lightning ranks each step's checkpoint by the last
    validation's figure, so the best could be weights no validation ever scored. Here a step
    checkpoint is ``last.ckpt`` (the latest state, to resume from), and the ranked ones are taken
    where a validation pass scored the weights: at its end."""

    def _ranks_at_validation_only(self) -> bool:
        return self.monitor is not None and self._every_n_train_steps >= 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if not self._ranks_at_validation_only():
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        elif trainer.global_step % self._every_n_train_steps == 0:
            self._save_last(trainer)
        if 0 < trainer.max_steps <= trainer.global_step:
            self._save_last(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if logged_by_last_validation(self.monitor, pl_module):
            super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._ranks_at_validation_only():
            # not _should_skip_saving_checkpoint: a step checkpoint (last.ckpt) of this very step
            # must not keep the scored one from being ranked
            fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
            candidates = self._monitor_candidates(trainer)
            if (fitting and not trainer.fast_dev_run and logged_by_last_validation(self.monitor, pl_module)
                    and self.monitor in candidates):
                self._save_topk_checkpoint(trainer, candidates)
        elif logged_by_last_validation(self.monitor, pl_module):
            super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last(trainer)

    def _save_last(self, trainer: L.Trainer) -> None:
        # skipped in a sanity check, under fast_dev_run, and where this step is saved already
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old_dir = state_dict.get("dirpath")
        if self.dirpath is None or old_dir is None or Path(old_dir) == Path(self.dirpath):
            super().load_state_dict(state_dict)
            return
        carried = _carried_over(state_dict, Path(old_dir), Path(self.dirpath), self.mode)
        if not carried["best_k_models"]:  # nothing to carry: start as a fresh callback would
            carried.update(kth_best_model_path=self.kth_best_model_path, kth_value=self.kth_value)
        super().load_state_dict({**state_dict, "dirpath": self.dirpath, **carried})


def _carried_over(state: dict[str, Any], old_dir: Path, new_dir: Path, mode: str) -> dict[str, Any]:
    """The best-k entries of ``state`` whose files still exist, copied from ``old_dir`` into
    ``new_dir`` (by rank 0), with their paths and the best / k-th fields pointing at the copies."""
    best_k: dict[str, Any] = {}
    for old_path, score in (state.get("best_k_models") or {}).items():
        old_path = Path(old_path)
        if not old_path.exists():
            log.warning("resumed run: the earlier best checkpoint %s is gone; it is not carried over", old_path)
            continue
        new_path = new_dir / old_path.name
        if rank_zero_only.rank == 0 and not new_path.exists():
            _copy(old_path, new_path)
        best_k[str(new_path)] = score
    carried = {"best_k_models": best_k, "last_model_path": ""}
    if best_k:
        ranked = sorted(best_k, key=lambda p: float(best_k[p]), reverse=mode == "max")
        best_path, kth_path = ranked[0], ranked[-1]  # the k-th is read only once best_k holds k
        carried.update(best_model_path=best_path, best_model_score=best_k[best_path],
                       kth_best_model_path=kth_path, kth_value=best_k[kth_path])
        log.info("resumed run: best %s %s carried over from %s", state.get("monitor"),
                 float(best_k[best_path]), old_dir)
    else:
        carried.update(best_model_path="", best_model_score=None)
    return carried


def _copy(source: Path, target: Path) -> None:
    """``source`` (a file, or a distributed checkpoint's directory) at ``target``, whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staged = tmp / target.name
    try:
        if source.is_dir():
            shutil.copytree(source, staged)
        else:
            shutil.copy2(source, staged)
        apply_umask(staged)
        os.replace(staged, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class EarlyStopping(callbacks.EarlyStopping):
    """:class:`lightning.pytorch.callbacks.EarlyStopping` whose patience counts only the passes that
    logged its monitor."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if logged_by_last_validation(self.monitor, pl_module):
            super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if logged_by_last_validation(self.monitor, pl_module):
            super().on_train_epoch_end(trainer, pl_module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores the checkpoint's patience too; a resumed run keeps the one it was
        # given (callbacks.early_stopping.patience=5 lets a stopped run go on)
        patience = self.patience
        super().load_state_dict(state_dict)
        if self.patience != patience:
            log.info("early stopping: patience %d (the checkpoint's was %d), %d pass(es) without improvement so far",
                     patience, self.patience, self.wait_count)
        self.patience = patience

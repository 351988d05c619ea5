"""One W&B run per training run, across an interrupt: its id in every checkpoint, its end state true.

* Every checkpoint stores the W&B run's id (:class:`WandbRunInCheckpoint`).
* A resumed run (``ckpt_path=...``) continues that W&B run when W&B is online
  (:func:`continue_wandb_run`). W&B cannot resume an offline run: the resumed run is then a new
  W&B run, which says so in one log line and in its W&B notes, naming the run it continues.
* :class:`WandbLogger` is Lightning's, less the ``anonymous=None`` it passes to ``wandb.init`` on
  every run: wandb 0.31 prints "The anonymous setting has no effect" for any value given.
* :func:`finish_wandb_run` ends the run with the job's outcome. Lightning turns Ctrl-C into
  ``sys.exit(1)`` after closing its loggers, and ``wandb.finish()`` without an exit code records 0,
  so an interrupted run used to look finished. Now it is marked preempting (W&B shows it as
  preempted: stopped, resumable) with exit code 130, the shell's code for SIGINT; a failed run
  ends with exit code 1.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import lightning as L
from lightning.pytorch.loggers.wandb import WandbLogger as LightningWandbLogger
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

Outcome = Literal["finished", "failed", "interrupted"]
EXIT_CODES = {"finished": 0, "failed": 1, "interrupted": 130}
WANDB_LOGGER_TARGETS = ("recforge.callbacks.wandb_run.WandbLogger", "lightning.pytorch.loggers.wandb.WandbLogger",
                        "lightning.pytorch.loggers.WandbLogger")


class WandbLogger(LightningWandbLogger):
    """Lightning's W&B logger (conf/logger/wandb.yaml), without the ``anonymous=None`` that it
    passes to ``wandb.init`` on every run: the value means "not anonymous", as leaving it out does,
    but wandb 0.31 warns "The anonymous setting has no effect" whenever it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


def _wandb_loggers(trainer: L.Trainer) -> list:
    return [lg for lg in trainer.loggers if isinstance(lg, LightningWandbLogger)]


class WandbRunInCheckpoint(L.Callback):
    """Stores the id of the run's W&B run in every checkpoint (``checkpoint[key]``)."""

    key = "wandb_run_id"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        for logger in _wandb_loggers(trainer):
            # the id of the started run (rank 0), or the configured one before it starts
            run_id = logger.version
            if run_id:
                checkpoint[self.key] = str(run_id)
                return


def wandb_logger_nodes(logger_cfg: DictConfig | None) -> list[DictConfig]:
    """The W&B loggers among a run's ``logger`` config group."""
    if not logger_cfg:
        return []
    return [node for node in logger_cfg.values()
            if isinstance(node, DictConfig) and node.get("_target_") in WANDB_LOGGER_TARGETS]


def continue_wandb_run(logger_cfg: DictConfig | None, checkpoint: dict, ckpt_path: Path) -> None:
    """Point the W&B logger of a resumed run at the W&B run its checkpoint was written by.

    Online, the logger resumes that run (``id`` and ``resume="allow"``). Offline (W&B cannot
    resume offline runs), the run stays a new W&B run whose notes name the earlier one. A run that
    sets ``logger.wandb.id`` itself keeps its choice; a checkpoint without an id changes nothing.
    """
    previous = checkpoint.get(WandbRunInCheckpoint.key)
    if not previous:
        return
    for node in wandb_logger_nodes(logger_cfg):
        if node.get("id"):
            continue
        with open_dict(node):
            if node.get("offline", False):
                node.notes = f"resumes W&B run {previous} from {ckpt_path}"
                log.info("W&B is offline and cannot resume a run: this resumed run logs to a new W&B "
                         "run; the interrupted one is %s (wandb sync uploads both)", previous)
            else:
                node.id = previous
                node.resume = "allow"
                log.info("W&B: continuing run %s", previous)


def finish_wandb_run(outcome: Outcome) -> None:
    """End the open W&B run, if any, recording the job's outcome (see the module docstring).

    One W&B run per Hydra job: a run left open would swallow the next multirun job's logs. A run
    can only be open if wandb was imported; importing it just to look costs every run half a second.
    """
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return
    if outcome == "interrupted":
        run.mark_preempting()
    wandb.finish(exit_code=EXIT_CODES[outcome])


@contextmanager
def wandb_run_ends_with_the_job() -> Iterator[SimpleNamespace]:
    """Around a job's Trainer calls: at the end, :func:`finish_wandb_run` with how the block ended
    (returned, raised, or Ctrl-C). Set ``job.trainer`` once it exists: Lightning ends an
    interrupted fit or test with ``sys.exit(1)``, and only its state says it was Ctrl-C."""
    job = SimpleNamespace(trainer=None)
    outcome: Outcome = "failed"
    try:
        yield job
        outcome = "finished"
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        finish_wandb_run("interrupted" if job.trainer is not None and job.trainer.interrupted else outcome)

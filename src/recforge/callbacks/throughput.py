"""Events per second of training and evaluation (the figures the speed targets are stated in)."""
from __future__ import annotations

import time

import lightning as L
import torch


def _batch_events(batch) -> int:
    size = getattr(batch, "size", None)
    return int(size) if size is not None else 0


def _batch_steps(batch) -> int:
    """Mini-batches in a Lightning batch: several when the data layer groups steps."""
    return int(getattr(batch, "n_steps", 1))


def _whole_run(trainer, pl_module, events: float, seconds: float) -> tuple[float, float]:
    """The run's events and seconds (the slowest rank's): under DDP each rank counts only its own
    share of the rows. The table-sharding ranks of one data-parallel rank (``hardware=model_parallel*``)
    read the same rows, so the sum over every rank is scaled to the data-parallel ranks'."""
    world = trainer.world_size
    if world == 1:
        return events, seconds
    share = trainer.distributed_sampler_kwargs
    readers = int(share["num_replicas"]) if share else world
    reduce = trainer.strategy.reduce
    events_t = torch.tensor([events], dtype=torch.float64, device=pl_module.device)
    seconds_t = torch.tensor([seconds], dtype=torch.float64, device=pl_module.device)
    total = float(reduce(events_t, reduce_op="sum")) * readers / world
    return round(total), float(reduce(seconds_t, reduce_op="max"))


class EventThroughput(L.Callback):
    """Counts events (rows of every batch) and wall time per epoch.

    Logs ``train/events_per_s``, ``train/batches_per_s`` (mini-batches, i.e. optimizer steps, also
    when the data layer groups several into one Lightning batch) and ``val/events_per_s`` /
    ``test/events_per_s`` at epoch end, and keeps the running training rate in the progress bar.
    Time spent in validation is excluded from the training rate. Under DDP the events are every
    rank's and the time the slowest rank's; ``train/batches_per_s`` counts a rank's steps, which
    all ranks take together.
    """

    def __init__(self, prog_bar_every: int = 50) -> None:
        self.prog_bar_every = prog_bar_every
        self.totals: dict[str, float] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning does not call on_train_epoch_start when it resumes inside an epoch
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._train = {"events": 0, "batches": 0, "calls": 0, "seconds": 0.0, "t0": time.perf_counter()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        t = self._train
        t["events"] += _batch_events(batch)
        t["batches"] += _batch_steps(batch)
        t["calls"] += 1
        if self.prog_bar_every and t["calls"] % self.prog_bar_every == 0:
            elapsed = t["seconds"] + time.perf_counter() - t["t0"]
            pl_module.log("ev/s", t["events"] / max(elapsed, 1e-9), prog_bar=True, logger=False)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if trainer.training and hasattr(self, "_train"):
            self._train["seconds"] += time.perf_counter() - self._train["t0"]
        self._eval = {"events": 0, "t0": time.perf_counter()}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval["events"] += _batch_events(batch)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._log_eval(trainer, pl_module, "val")
        if trainer.training and hasattr(self, "_train"):
            self._train["t0"] = time.perf_counter()

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self._eval = {"events": 0, "t0": time.perf_counter()}

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval["events"] += _batch_events(batch)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._log_eval(trainer, pl_module, "test")

    def _log_eval(self, trainer, pl_module, prefix: str) -> None:
        if trainer.sanity_checking:
            return
        events, seconds = _whole_run(trainer, pl_module, self._eval["events"], time.perf_counter() - self._eval["t0"])
        rate = events / max(seconds, 1e-9)
        self.totals[f"{prefix}/events_per_s"] = rate
        pl_module.log(f"{prefix}/events_per_s", rate, sync_dist=False)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        t = self._train
        events, seconds = _whole_run(trainer, pl_module, t["events"], t["seconds"] + time.perf_counter() - t["t0"])
        self.totals["train/events_per_s"] = events / max(seconds, 1e-9)
        self.totals["train/batches_per_s"] = t["batches"] / max(seconds, 1e-9)
        self.totals["train/events"] = int(events)
        pl_module.log("train/events_per_s", self.totals["train/events_per_s"])
        pl_module.log("train/batches_per_s", self.totals["train/batches_per_s"])

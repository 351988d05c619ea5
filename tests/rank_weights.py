"""A callback a test adds to a multi-process run (``+callbacks.rank_weights._target_=rank_weights.SaveRankWeights``,
with ``tests/`` on the child's ``PYTHONPATH``): each rank writes the weights it ended training with,
so the test can compare the replicas (a checkpoint holds rank 0's only)."""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class SaveRankWeights(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        weights = {name: value.detach().cpu().clone() for name, value in pl_module.state_dict().items()
                   if isinstance(value, torch.Tensor)}  # not a module's extra state (a generator's position)
        torch.save(weights, self.out / f"rank{trainer.global_rank}.pt")


def load_rank_weights(out: Path, world: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(Path(out) / f"rank{rank}.pt") for rank in range(world)]

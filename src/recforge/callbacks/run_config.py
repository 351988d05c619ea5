"""Stores the run's resolved config inside every checkpoint, so a checkpoint explains itself."""
from __future__ import annotations

import lightning as L


class RunConfigInCheckpoint(L.Callback):
    key = "recforge_config"

    def __init__(self, config: dict) -> None:
        self.config = config

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[self.key] = self.config

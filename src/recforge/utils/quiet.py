"""Known, harmless library messages, silenced in one place so that what a user sees means something.

Each entry says why it is harmless. Installed at the start of every run (every process of a DDP
run or a multirun launches through the pipeline, so each installs it).
"""
from __future__ import annotations

import logging
import warnings

# (message regex, category, why it is harmless)
KNOWN_WARNINGS = [
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     "Lightning's own use of a torch pytree API that torch deprecated; nothing a user can change"),
    (r".*sync_dist=True.*when logging on epoch level", Warning,
     "ranking metrics are reduced across ranks inside RankingMetrics before they are logged"),
    (r".*callbacks used to create the checkpoint need", Warning,
     "testing a checkpoint restores weights and data state only; training callbacks are not needed"),
    (r"The number of training batches \(\d+\) is smaller than the logging interval", Warning,
     "short epochs (ml-1m: 24 batches) log the step loss less often; the epoch's mean loss and every "
     "evaluation metric are logged at each epoch's end all the same"),
    (r"Your `IterableDataset` has `__len__` defined", Warning,
     "the Criteo stream gives each rank and worker a disjoint share and reports that share's exact "
     "batch count (recforge.data.criteo.datamodule)"),
]

# Lightning's advertisements, logged at INFO on every run (litlogger, litmodels).
KNOWN_LOG_PREFIXES = ("💡 Tip:",)


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(KNOWN_LOG_PREFIXES)


_TIPS = _DropTips()


def silence_known_noise() -> None:
    """Install the filters (idempotent)."""
    for message, category, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _TIPS not in logger.filters:
            logger.addFilter(_TIPS)

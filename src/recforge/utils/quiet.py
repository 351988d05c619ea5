"""Known, harmless library messages, silenced in one place so that what a user sees means something.

Each entry says why it is harmless. Installed at the start of every run (every process of a DDP
run or a multirun launches through the pipeline, so each installs it), and by the Hydra callback
:class:`QuietLaunch` in the process that launches a run or a sweep, before Hydra sets up the
sweeper (importing Optuna logs at once, before any job starts). ``extras.silence_known_warnings=
false`` turns all of it off.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

from hydra.experimental.callback import Callback

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

# Third-party loggers held at WARNING whatever the root logger's level: the debug presets set the
# root to DEBUG (for recforge's own loggers), which every logger without a level of its own would
# inherit. (logger, why what it logs below WARNING is noise). A level the config gives one of them
# (hydra.job_logging.loggers.<name>.level) is kept.
QUIET_LOGGERS = [
    ("filelock",
     "torch.compile's caches (inductor's code and autotuning caches) take a file lock per entry, and "
     "filelock logs every acquire and release at DEBUG: 200+ lines for one compiled DLRM, none about "
     "the run"),
    ("fsspec",
     "Lightning writes and reads checkpoints and profiler reports through fsspec, which logs each "
     "open at DEBUG; they are the files of the run directory that the run's first lines name"),
    ("alembic",
     "Optuna (the hparams_search presets' sweeper) imports alembic, the schema migrations of its "
     "database storage, which logs each plugin it sets up at INFO: 7 lines before the first trial, "
     "none about the study"),
]


def _pin_quiet_loggers() -> None:
    for name, _why in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def silence_known_noise() -> None:
    """Install the filters (idempotent)."""
    for message, category, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _TIPS not in logger.filters:
            logger.addFilter(_TIPS)
    _pin_quiet_loggers()


class QuietLaunch(Callback):
    """Hydra callback (conf/hydra/default.yaml): the filters in the process that launches a run or a
    sweep, installed before Hydra sets up the launcher and the sweeper."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._install(config)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._install(config)

    @staticmethod
    def _install(config: Any) -> None:
        extras = config.get("extras") or {}
        if extras.get("silence_known_warnings", True):
            silence_known_noise()

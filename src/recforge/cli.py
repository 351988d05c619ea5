"""How the commands end: a user's mistake is one line, anything else a traceback.

:func:`one_line_errors` ends src/train.py and src/eval.py; :func:`run_data_command` runs the work
of every ``python -m recforge.data.<family>.preprocess|prepare``.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from hydra.errors import CompactHydraException

from recforge.errors import UserInputError

T = TypeVar("T")
log = logging.getLogger(__name__)


class RefusedSweepJob(CompactHydraException):
    """A multirun job's :class:`UserInputError`. Hydra records the job as failed and runs the
    others; once they are done it raises the first failure again, which it prints as this one
    line (a compact exception) rather than as a traceback."""


def one_line_errors(run: Callable[[], T]) -> T:
    """Run ``run``; a :class:`UserInputError` exits non-zero with one ``recforge:`` line.

    In a multirun the job fails instead (:class:`RefusedSweepJob`), and the sweep goes on to its
    other jobs, as it does after any failure; an exit would end the whole sweep (an Optuna study
    too, whatever its ``max_failure_rate``).
    ``HYDRA_FULL_ERROR=1`` (Hydra's own switch for full tracebacks) shows its traceback instead.
    """
    try:
        return run()
    except UserInputError as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        job = _sweep_job()
        if job is not None:
            log.error("recforge: %s", error)  # the console and the job's log file, as the job ends
            raise RefusedSweepJob(f"recforge: sweep job {job}: {error}") from None
        _to_log_files(f"recforge: {error}")
        raise SystemExit(f"recforge: {error}") from None


def _sweep_job() -> str | None:
    """The number of the multirun job running here, if this is one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return str(HydraConfig.get().job.get("num", "?"))


def onto_the_run(argv: list[str]) -> list[str]:
    """``argv`` with each dotted key of the experiment (``data.multi_hot=mlperf``) made
    ``++data.multi_hot=mlperf`` when the command names a checkpoint (``ckpt_path=...``).

    A resume or an evaluation takes its run's data, model, task, ... and applies the command
    line's keys over them (:func:`recforge.checkpoints.with_run_experiment`). Hydra first composes
    the default experiment, though, and refuses a key that only the run's family has (a DLRM
    run's ``data.multi_hot`` over the default GRU4Rec data); ``++`` lets it through to that step,
    and the config check still refuses, in one line, a key the run's section does not take.
    """
    from recforge.checkpoints import EXPERIMENT_KEYS

    if not any(arg.startswith("ckpt_path=") and arg != "ckpt_path=null" for arg in argv[1:]):
        return argv
    out = argv[:1]
    for arg in argv[1:]:
        key = arg.split("=", 1)[0]
        if "=" in arg and "." in key and key.split(".", 1)[0] in EXPERIMENT_KEYS:
            arg = f"++{arg}"
        out.append(arg)
    return out


def _to_log_files(message: str) -> None:
    """The refusal into the run's log file (Hydra's ``<task>.log``) too, so a run directory left by
    a refused run says why; not to the console, where the exit prints it once."""
    record = logging.LogRecord("recforge", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run_data_command(run: Callable[[], T]) -> T:
    """Run a data preparation command's work: progress logged at INFO to stderr, a user error as
    one ``recforge:`` line (:func:`one_line_errors`).

    A plain kill (SIGTERM) would end the process without unwinding, leaving a half-built staging
    directory behind; as an exit, the staging directory is removed on the way out.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return one_line_errors(run)


def data_command_parser(
    module: str, description: str, raw_help: str, datasets: Sequence[str] | None = None
) -> argparse.ArgumentParser:
    """The arguments every data preparation command shares: the dataset (when it has a choice of
    them), ``--raw`` files, the ``--out`` directory and ``--force``."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    if datasets is not None:
        parser.add_argument("dataset", choices=sorted(datasets))
    parser.add_argument("--raw", nargs="+", required=True, help=raw_help)
    parser.add_argument("--out", required=True, help="the prepared directory to write")
    parser.add_argument("--force", action="store_true", help="prepare again even if --out is up to date")
    return parser

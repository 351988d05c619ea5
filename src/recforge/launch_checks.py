"""Checks a sweep's launcher before Hydra starts it: what the launcher itself would only say as a
traceback once the sweep is under way."""
from __future__ import annotations

import shutil

from hydra.experimental.callback import Callback


class LauncherCheck(Callback):
    """Hydra callback: refuse, in one ``recforge:`` line, a multirun whose launcher cannot run on
    this machine, before any job is set up."""

    def on_multirun_start(self, config, **kwargs) -> None:
        target = str(config.hydra.launcher.get("_target_", ""))
        # submitit's SLURM executor asks for srun when it is made, after the sweep has started
        if target.endswith(".SlurmLauncher") and shutil.which("srun") is None:
            raise SystemExit(
                "recforge: launcher=submitit_slurm submits every job to SLURM and runs only on a SLURM "
                "login node (no srun on this machine's PATH); launcher=joblib runs the same sweep here"
            )

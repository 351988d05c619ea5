"""A sweep whose launcher cannot run here is refused in one line before any job is set up."""
from __future__ import annotations

import shutil

import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir

from recforge.launch_checks import LauncherCheck


def _sweep_config(launcher: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"launcher={launcher}"], return_hydra_config=True)


def test_slurm_without_srun_is_refused_naming_the_local_launcher(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as refused:
        LauncherCheck().on_multirun_start(_sweep_config("submitit_slurm"))
    message = str(refused.value)
    assert message.startswith("recforge: launcher=submitit_slurm") and "launcher=joblib" in message
    assert "\n" not in message


def test_slurm_with_srun_and_local_launchers_pass(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    LauncherCheck().on_multirun_start(_sweep_config("submitit_slurm"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    for local in ("joblib", "submitit_local"):
        LauncherCheck().on_multirun_start(_sweep_config(local))


def test_every_sweep_runs_the_check():
    callbacks = _sweep_config("joblib").hydra.callbacks
    assert any(c._target_ == "recforge.launch_checks.LauncherCheck" for c in callbacks.values())

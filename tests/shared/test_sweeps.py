"""Multiruns as users start them: the README's sweep lines word for word, in a subprocess, from a
checkout-shaped directory and from elsewhere, with no paths.* or hydra.* override (the tiny
profile lives in that checkout's conf/local, where a user keeps machine-local settings)."""
from __future__ import annotations

import csv
import math
import re
import stat
from pathlib import Path

import pytest
import yaml

from conftest import TINY_CTR_RUN, TINY_SEQUENCE_RUN, readme_commands, run_command, tiny_profile, user_checkout

pytestmark = pytest.mark.slow

SWEEPS = [
    c for c in readme_commands()
    if c.startswith("python src/train.py") and (" -m " in c or "hparams_search=" in c)
]
# placeholders (...) need the user's data; SLURM needs a cluster (its local twin is tested below)
RUNNABLE = [c for c in SWEEPS if "..." not in c and "<" not in c and "submitit_slurm" not in c]
OPTUNA_TRIALS = 2


def expected_jobs(command: str) -> int:
    if "hparams_search=" in command:
        return OPTUNA_TRIALS
    values = [w.split("=", 1)[1] for w in command.split() if "=" in w]
    return math.prod(len(v.split(",")) for v in values)


def _profile(command: str) -> list[str]:
    # 200 trials is the preset's study; the local profile trims it like the data
    trials = [f"hydra.sweeper.n_trials={OPTUNA_TRIALS}"] if "hparams_search=" in command else []
    return tiny_profile(command) + trials


def _family_metric(command: str) -> str:
    """A test figure each job of the command's family logs, positive for any trained model."""
    profile = tiny_profile(command)
    if profile is TINY_CTR_RUN:
        return "test/auc"
    if profile is TINY_SEQUENCE_RUN:
        return "test/hr@50"
    return "test/recall@20"


def _only_sweep(cwd: Path) -> Path:
    sweeps = list((cwd / "outputs" / "train" / "multiruns").iterdir())
    assert len(sweeps) == 1, sweeps
    return sweeps[0]


def _summary(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_readme_shows_runnable_sweeps_of_every_kind():
    assert any(re.fullmatch(r"python src/train.py -m [^ ]+=[^ ]+,.*", c) for c in RUNNABLE), RUNNABLE
    assert any("hparams_search=" in c for c in RUNNABLE), RUNNABLE
    assert any("launcher=joblib" in c for c in RUNNABLE), RUNNABLE
    # one sweep a user can run without a download for each family
    for profile in (TINY_CTR_RUN, TINY_SEQUENCE_RUN):
        assert any(tiny_profile(c) is profile and " -m " in c for c in RUNNABLE), RUNNABLE


@pytest.mark.parametrize("command", RUNNABLE)
def test_readme_sweep_runs_as_written(command: str, user_sweep):
    checkout, done = user_sweep(command, _profile(command))
    assert done.returncode == 0, done.stderr[-4000:]
    sweep_dir = _only_sweep(checkout)
    rows = _summary(sweep_dir)
    assert len(rows) == expected_jobs(command)
    assert all(r["status"] == "ok" for r in rows), rows
    metric = "val/mrr@20" if "hparams_search=" in command else _family_metric(command)
    assert all(float(r[metric]) > 0 for r in rows), rows
    # readable like every other result file (it was 0600)
    summary_mode = stat.S_IMODE((sweep_dir / "summary.csv").stat().st_mode)
    assert summary_mode == stat.S_IMODE((sweep_dir / "0" / "metrics.json").stat().st_mode)
    assert summary_mode & stat.S_IROTH
    if "hparams_search=" in command:
        results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
        assert results["best_value"] == pytest.approx(max(float(r[metric]) for r in rows), rel=1e-6)


def test_sweep_from_another_directory_writes_under_it(tmp_path: Path):
    checkout = user_checkout(tmp_path / "repo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = run_command(f"python {checkout}/src/train.py -m loss=xe,bprmax trainer.max_epochs=1", cwd=elsewhere)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = _summary(_only_sweep(elsewhere))
    assert sorted(r["loss"] for r in rows) == ["bprmax", "xe"]
    assert (elsewhere / "data" / "synthetic").is_dir()  # generated where the command runs
    assert not (checkout / "outputs").exists()


def test_a_refused_job_fails_alone_and_the_sweep_leaves_its_summary(tmp_path: Path):
    """Job 0 is refused at start; job 1 still runs, summary.csv says which failed and why, and the
    sweep exits non-zero with that job's line, no traceback (it used to end at job 0, with no
    summary; an Optuna study ended there too)."""
    checkout = user_checkout(tmp_path / "repo")
    done = run_command("python src/train.py -m model.hidden_size=0,16 trainer.max_epochs=1", cwd=checkout)
    assert done.returncode == 1, done.stderr[-4000:]
    refusals = [line for line in done.stderr.splitlines() if line.startswith("recforge: ")]
    assert len(refusals) == 1, done.stderr[-4000:]
    (last,) = refusals
    assert re.fullmatch(r"recforge: sweep job 0: model\.hidden_size=0: expected an integer >= 1.*", last), last
    assert "Traceback" not in done.stderr and done.stderr.count("Error executing job") == 1, done.stderr[-4000:]
    rows = _summary(_only_sweep(checkout))
    assert [(r["job"], r["model.hidden_size"], r["status"]) for r in rows] == [("0", "0", "failed"), ("1", "16", "ok")]
    assert rows[0]["error"] == last and rows[1]["error"] == ""
    assert float(rows[1]["test/recall@20"]) > 0


def test_submitit_launcher_through_its_local_executor(tmp_path: Path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    checkout = user_checkout(tmp_path / "repo")
    done = run_command("python src/train.py -m launcher=submitit_local model.hidden_size=16", cwd=checkout)
    assert done.returncode == 0, done.stderr[-4000:]
    sweep_dir = _only_sweep(checkout)
    rows = _summary(sweep_dir)
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    assert (sweep_dir / ".submitit").is_dir()


def test_multirun_with_every_logger_gives_each_job_its_own_wandb_run(tmp_path: Path):
    pytest.importorskip("wandb")
    checkout = user_checkout(tmp_path / "repo")
    done = run_command("python src/train.py -m logger=many_loggers loss=xe,bprmax", cwd=checkout)
    assert done.returncode == 0, done.stderr[-4000:]
    sweep_dir = _only_sweep(checkout)
    assert len(_summary(sweep_dir)) == 2
    for job, loss in (("0", "xe"), ("1", "bprmax")):
        job_dir = sweep_dir / job
        assert len(list((job_dir / "wandb").glob("offline-run-*"))) == 1, job
        assert list((job_dir / "tensorboard").rglob("events.out.tfevents.*")), job
        assert (job_dir / "csv" / "metrics.csv").exists(), job
        # the W&B run as configured: grouped by the sweep, named by the job's overrides
        (hparams,) = (job_dir / "csv").rglob("hparams.yaml")
        wandb_cfg = yaml.safe_load(hparams.read_text())["logger"]["wandb"]
        assert wandb_cfg["group"] == f"train/multiruns/{sweep_dir.name}", job
        assert wandb_cfg["name"] == f"logger=many_loggers,loss={loss}", job
        (run_file,) = (job_dir / "wandb").glob("offline-run-*/run-*.wandb")
        assert f"train/multiruns/{sweep_dir.name}".encode() in run_file.read_bytes(), job

"""Multirun through each sweeper / launcher preset, as a user runs it (a subprocess each)."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow

TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=10",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "data.generator.n_items=100",
    "data.generator.n_sessions=1000",
    "task.sample_store_size=10000",
    "callbacks.progress_bar.refresh_rate=0",
]


def _sweep(tmp_path: Path, data_dir: Path, *overrides: str) -> tuple[Path, list[dict]]:
    cmd = [sys.executable, "src/train.py", *overrides, *TINY,
           f"paths.log_dir={tmp_path}", f"paths.data_dir={data_dir}"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "train" / "multiruns").iterdir()
    with open(sweep_dir / "summary.csv", newline="") as f:
        return sweep_dir, list(csv.DictReader(f))


def test_optuna_search_returns_the_optimised_metric(tmp_path, data_dir):
    sweep_dir, rows = _sweep(tmp_path, data_dir, "hparams_search=gru4rec_optuna", "hydra.sweeper.n_trials=2")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(float(r["val/mrr@20"]) for r in rows)
    assert results["best_value"] == pytest.approx(best, rel=1e-6)
    assert set(results["best_params"]) >= {"model.hidden_size", "optimizer.lr"}


def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path, data_dir):
    _, rows = _sweep(tmp_path, data_dir, "-m", "launcher=joblib", "loss=xe,bprmax")
    assert sorted(r["loss"] for r in rows) == ["bprmax", "xe"]
    assert all(float(r["test/recall@20"]) > 0 for r in rows)


def test_submitit_launcher_through_its_local_executor(tmp_path, data_dir):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir, rows = _sweep(tmp_path, data_dir, "-m", "launcher=submitit_local", "model.hidden_size=16")
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    assert (sweep_dir / ".submitit").is_dir()


def test_multirun_with_every_logger_gives_each_job_its_own_wandb_run(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sweep_dir, rows = _sweep(tmp_path, data_dir, "-m", "logger=many_loggers", "loss=xe,bprmax")
    assert len(rows) == 2
    for job in ("0", "1"):
        job_dir = sweep_dir / job
        assert len(list((job_dir / "wandb").glob("offline-run-*"))) == 1, job
        assert list((job_dir / "tensorboard").rglob("events.out.tfevents.*")), job
        assert (job_dir / "csv" / "metrics.csv").exists(), job

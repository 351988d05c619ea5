"""``src/train.py`` and ``src/eval.py`` as the split-table tests run them (test_dlrm_sharded.py,
test_dlrm_mesh2d.py): each in its own processes, one thread each, every rank's parameters saved."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from conftest import CHEAP, REPO_ROOT
from processes import run_child

TABLE = "model.sparse_arch.embedding.weight"
# one thread in every process: the same GEMM reduction order in the runs a test compares
_ENV = {"OMP_NUM_THREADS": "1"}


def train_ranks(model: list[str], overrides: list[str], log_dir: Path, checkpoints: bool = False) -> dict:
    """``src/train.py`` with ``model`` (before the cheap test profile) and ``overrides`` (after it),
    no early stopping, and ``conftest.SaveRankParameters`` saving each rank's parameters at the end.
    ``checkpoints``: the last epoch's checkpoint is kept (no monitor), else none is written.
    Returns the run's metrics, its output, each rank's saved parameters and the last checkpoint."""
    saving = ["callbacks.model_checkpoint.monitor=null"] if checkpoints else [
        "+trainer.enable_checkpointing=false", "~callbacks.model_checkpoint"]
    cmd = [sys.executable, "src/train.py", *model, *CHEAP, *overrides, *saving, "~callbacks.early_stopping",
           "+callbacks.dump._target_=conftest.SaveRankParameters", f"+callbacks.dump.path={log_dir / 'params'}",
           f"paths.log_dir={log_dir}"]
    env = {**os.environ, **_ENV, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(REPO_ROOT / "tests")}
    done = run_child(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    ranks = [torch.load(p, weights_only=False) for p in sorted((log_dir / "params").glob("rank*.pt"))]
    return {"metrics": json.loads((run_dir / "metrics.json").read_text()), "out": done.stdout + done.stderr,
            "ranks": ranks, "last": run_dir / "checkpoints" / "last.ckpt"}


def eval_in_one_process(checkpoint: Path, log_dir: Path, data_dir: Path) -> dict:
    """``src/eval.py`` on ``checkpoint`` (a distributed one included) in one process, without a
    mesh (``hardware=cpu``): the metrics it reports."""
    done = run_child([sys.executable, "src/eval.py", f"ckpt_path={checkpoint}", "hardware=cpu",
                      f"paths.log_dir={log_dir}", f"paths.data_dir={data_dir}"], cwd=REPO_ROOT,
                     env={**os.environ, **_ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (run_dir,) = (log_dir / "eval" / "runs").iterdir()
    return json.loads((run_dir / "metrics.json").read_text())

"""A real Ctrl-C, then a resume from the run's last.ckpt, ends where an uninterrupted run ends
(issue 21 §1: HSTU's resume once differed; the other resume tests start from a checkpoint a
callback saved, not from what an interrupted run leaves behind).

Each run is ``python src/train.py`` in its own process, as a user types it. The interrupted run
sends itself SIGINT at the first batch of epoch 1, so Python raises KeyboardInterrupt wherever the
main thread is, and Lightning's own Ctrl-C handling stops the run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_SEQUENCE_RUN, run_command, user_checkout

pytestmark = pytest.mark.slow

CTRL_C = '''
import os
import signal

import lightning as L


class CtrlCAtEpoch1(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGINT)
'''


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.parametrize("model", ["hstu", "sasrec"])
def test_a_run_stopped_by_ctrl_c_resumes_to_the_uninterrupted_runs_end(tmp_path: Path, model: str):
    checkout = user_checkout(tmp_path / "repo", local=TINY_SEQUENCE_RUN)
    (checkout / "src" / "ctrl_c.py").write_text(CTRL_C)  # src/ is on the path of src/train.py
    run = f"python src/train.py model={model} trainer.max_epochs=3"

    straight = run_command(f"{run} hydra.run.dir={tmp_path / 'straight'}", cwd=checkout)
    assert straight.returncode == 0, straight.stderr[-3000:]

    stopped_dir = tmp_path / "stopped"
    stopped = run_command(f"{run} hydra.run.dir={stopped_dir} +callbacks.ctrl_c._target_=ctrl_c.CtrlCAtEpoch1",
                          cwd=checkout)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "Detected KeyboardInterrupt" in stopped.stdout + stopped.stderr
    assert not (stopped_dir / "metrics.json").exists()  # it never reached its test
    assert torch.load(stopped_dir / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 0

    resumed_dir = tmp_path / "resumed"
    resumed = run_command(f"{run} ckpt_path={stopped_dir / 'checkpoints' / 'last.ckpt'} "
                          f"hydra.run.dir={resumed_dir}", cwd=checkout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    want = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    got = json.loads((resumed_dir / "metrics.json").read_text())
    tested = sorted(k for k in want if k.startswith("test/") and not k.endswith("_per_s"))
    assert tested, want
    assert {k: got[k] for k in tested} == {k: want[k] for k in tested}
    want_state, got_state = _state(tmp_path / "straight"), _state(resumed_dir)
    assert want_state.keys() == got_state.keys()
    for name, value in want_state.items():  # weights, and modules' extra state (samplers' generators)
        assert _same(got_state[name], value), name

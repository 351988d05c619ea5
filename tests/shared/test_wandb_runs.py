"""W&B runs across an interrupt (issue 21 §1) and per sweep (issue 20 §3).

The end state and the resume settings are checked against a stand-in ``wandb`` module and the
logger's config; the whole path (Ctrl-C inside a fit, the resumed run) runs offline W&B for real.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recforge.callbacks.wandb_run import (
    WandbRunInCheckpoint,
    continue_wandb_run,
    finish_wandb_run,
    wandb_logger_nodes,
    wandb_run_ends_with_the_job,
)
from recforge.utils.resolvers import wandb_group, wandb_name


class _Run:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def mark_preempting(self) -> None:
        self.calls.append("mark_preempting")


def _stand_in_wandb(calls: list) -> types.ModuleType:
    module = types.ModuleType("wandb")
    module.run = _Run(calls)
    module.finish = lambda exit_code=None: calls.append(("finish", exit_code))
    return module


@pytest.mark.parametrize("outcome, expected", [
    ("finished", [("finish", 0)]),
    ("failed", [("finish", 1)]),
    ("interrupted", ["mark_preempting", ("finish", 130)]),
])
def test_the_run_ends_with_the_jobs_outcome(monkeypatch, outcome, expected):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _stand_in_wandb(calls))
    finish_wandb_run(outcome)
    assert calls == expected


@pytest.mark.parametrize("ending, expected", [
    ("return", [("finish", 0)]),
    ("error", [("finish", 1)]),
    ("ctrl-c", ["mark_preempting", ("finish", 130)]),
    ("lightning's ctrl-c", ["mark_preempting", ("finish", 130)]),  # sys.exit(1), trainer interrupted
])
def test_the_job_block_ends_the_run_as_the_job_ended(monkeypatch, ending, expected):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _stand_in_wandb(calls))
    raised = {"return": None, "error": ValueError, "ctrl-c": KeyboardInterrupt,
              "lightning's ctrl-c": SystemExit}[ending]
    try:
        with wandb_run_ends_with_the_job() as job:
            job.trainer = types.SimpleNamespace(interrupted=ending == "lightning's ctrl-c")
            if raised is not None:
                raise raised(1)
    except BaseException as error:  # noqa: BLE001 - each ending re-raises what the block raised
        assert raised is not None and isinstance(error, raised)
    assert calls == expected


def test_a_run_that_never_imported_wandb_does_not_import_it_to_finish(monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    finish_wandb_run("finished")
    assert "wandb" not in sys.modules


def test_no_open_run_means_nothing_to_finish(monkeypatch):
    calls: list = []
    module = _stand_in_wandb(calls)
    module.run = None
    monkeypatch.setitem(sys.modules, "wandb", module)
    finish_wandb_run("interrupted")
    assert calls == []


def _logger_cfg(offline: bool, run_id: str | None = None):
    return OmegaConf.create({
        "csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": "x"},
        "wandb": {"_target_": "lightning.pytorch.loggers.wandb.WandbLogger", "offline": offline,
                  "project": "recforge", "id": run_id},
    })


def test_an_online_resume_continues_the_checkpoints_wandb_run(tmp_path: Path):
    cfg = _logger_cfg(offline=False)
    continue_wandb_run(cfg, {WandbRunInCheckpoint.key: "abc123"}, tmp_path / "last.ckpt")
    assert cfg.wandb.id == "abc123" and cfg.wandb.resume == "allow"
    assert "id" not in cfg.csv


def test_an_offline_resume_is_a_new_wandb_run_that_names_the_interrupted_one(tmp_path: Path, caplog):
    cfg = _logger_cfg(offline=True)
    with caplog.at_level("INFO", logger="recforge.callbacks.wandb_run"):
        continue_wandb_run(cfg, {WandbRunInCheckpoint.key: "abc123"}, tmp_path / "last.ckpt")
    assert cfg.wandb.id is None and "resume" not in cfg.wandb
    assert "abc123" in cfg.wandb.notes
    assert "cannot resume" in caplog.text and "abc123" in caplog.text


@pytest.mark.parametrize("checkpoint, given", [({}, None), ({WandbRunInCheckpoint.key: "abc123"}, "mine")])
def test_a_resume_keeps_a_chosen_id_and_needs_a_stored_one(tmp_path: Path, checkpoint, given):
    cfg = _logger_cfg(offline=False, run_id=given)
    continue_wandb_run(cfg, checkpoint, tmp_path / "last.ckpt")
    assert cfg.wandb.id == given and "resume" not in cfg.wandb


def test_only_wandb_loggers_are_found():
    assert [n._target_ for n in wandb_logger_nodes(_logger_cfg(True))] == [
        "lightning.pytorch.loggers.wandb.WandbLogger"]
    assert wandb_logger_nodes(None) == []


def test_outside_hydra_a_run_keeps_its_task_as_group_and_no_name(monkeypatch):
    from hydra.core.hydra_config import HydraConfig

    # another test of the session may have set Hydra's global config
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    assert wandb_group("train") == "train"
    assert wandb_name() is None


# ----------------------------------------------------------------------------- the whole path
def _wandb_run_dirs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_ctrl_c_leaves_an_interrupted_wandb_run_and_the_resume_names_it(tmp_path: Path):
    pytest.importorskip("wandb")
    from conftest import run_command, user_checkout

    checkout = user_checkout(tmp_path / "repo")
    # a callback raises KeyboardInterrupt inside the second epoch, as Ctrl-C would (src/ is on
    # the path of `python src/train.py`)
    (checkout / "src" / "interrupt.py").write_text(
        "import lightning as L\n"
        "class CtrlC(L.Callback):\n"
        "    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):\n"
        "        if trainer.current_epoch == 1:\n"
        "            raise KeyboardInterrupt\n"
    )
    first = tmp_path / "first"
    done = run_command(
        f"python src/train.py logger=wandb trainer.max_epochs=3 hydra.run.dir={first} "
        "+callbacks.ctrl_c._target_=interrupt.CtrlC", cwd=checkout,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    (interrupted,) = _wandb_run_dirs(first)
    previous_id = interrupted.name.rsplit("-", 1)[1]
    # wandb's own log of the run's end (its files hold no readable exit record offline)
    assert "got exitcode: 130" in (interrupted / "logs" / "debug.log").read_text()

    ckpt = first / "checkpoints" / "last.ckpt"
    import torch
    assert torch.load(ckpt, weights_only=True)[WandbRunInCheckpoint.key] == previous_id

    second = tmp_path / "second"
    done = run_command(
        f"python src/train.py logger=wandb ckpt_path={ckpt} trainer.max_epochs=3 hydra.run.dir={second}",
        cwd=checkout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (resumed,) = _wandb_run_dirs(second)
    assert resumed.name.rsplit("-", 1)[1] != previous_id
    log_text = (second / "train.log").read_text()
    assert f"the interrupted one is {previous_id}" in log_text
    assert "got exitcode: 0" in (resumed / "logs" / "debug.log").read_text()

"""Issue 21 §4, quiet where it is noise: the known, harmless messages a user saw are gone, and what
recforge and the libraries say that matters is still there.

* third-party loggers stay at WARNING under the debug presets' DEBUG root (filelock's lock lines,
  fsspec's file opens), recforge's own DEBUG records still pass;
* a compiled DLRM compiles once per autograd mode for every batch size (no recompile per size
  towards torch._dynamo's recompile limit), equal to eager;
* an Optuna sweep prints no alembic plugin lines;
* a W&B run prints no "The anonymous setting has no effect" warning (recforge's W&B logger).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.nn import functional as F

from conftest import REPO_ROOT, TINY_CTR_RUN, TINY_RUN, run_command, user_checkout
from recforge.utils.quiet import silence_known_noise


# ---------------------------------------------------------------- third-party loggers under DEBUG
# what floods a debug run: torch.compile's cache locks, Lightning's checkpoint and report files
NOISY_AT_DEBUG = ("filelock", "fsspec", "fsspec.local")


@pytest.mark.parametrize("preset", ["default", "profiler"])
def test_third_party_loggers_stay_quiet_under_the_debug_presets(preset, make_cfg, tmp_path, caplog):
    import filelock
    import fsspec

    cfg = make_cfg(f"debug={preset}")
    root_level = cfg.hydra.job_logging.root.level
    assert root_level == "DEBUG"  # what the preset asks for: recforge's DEBUG lines
    # every level through caplog, which puts it back after the test (the session's other tests
    # would otherwise log at DEBUG)
    for name in NOISY_AT_DEBUG:
        caplog.set_level(logging.NOTSET, logger=name)  # as a fresh process has them
    caplog.set_level(root_level)  # the root, as the preset sets it, and the capturing handler
    silence_known_noise()
    with filelock.FileLock(tmp_path / "cache.lock"):  # torch.compile's caches lock every entry
        pass
    with fsspec.open(tmp_path / "epoch_000.ckpt", "wb") as f:  # how Lightning writes a checkpoint
        f.write(b"x")
    logging.getLogger("recforge.pipeline").debug("recforge's own debug line")
    names = {record.name for record in caplog.records}
    assert not {n for n in names if n.split(".")[0] in ("filelock", "fsspec")}, names
    assert "recforge's own debug line" in caplog.messages


def test_a_level_the_config_gives_a_quiet_logger_is_kept(caplog, tmp_path):
    import filelock

    caplog.set_level(logging.DEBUG)
    # hydra.job_logging.loggers.filelock.level=DEBUG: a user debugging the lock itself
    caplog.set_level(logging.DEBUG, logger="filelock")
    silence_known_noise()
    with filelock.FileLock(tmp_path / "cache.lock"):
        pass
    assert any(record.name == "filelock" for record in caplog.records), caplog.messages


@pytest.mark.slow
def test_the_readmes_profile_of_a_compiled_dlrm_stays_compiled(tmp_path, make_cfg):
    """``python src/train.py model=dlrm model.compile=true debug=profiler`` (the README's line):
    the profiler's per-module record_function hooks, which dynamo cannot trace, are left out for a
    compiled model, so it is not compiled module by module up to the recompile limit; an eager
    model's profile keeps its module names. The run is a debug run (root logger at DEBUG, no
    callbacks): torch.compile's caches printed 200+ ``[filelock][DEBUG]`` lines, which are gone,
    and Lightning wrote a checkpoint of its own, which it no longer does."""
    import recforge.utils.resolvers  # noqa: F401 - registers recforge_not, as every run's pipeline does

    assert make_cfg("model=dlrm", "debug=profiler").trainer.profiler.record_module_names is True
    assert make_cfg("model=hstu", "debug=profiler").trainer.profiler.record_module_names is True
    compiled = make_cfg("model=dlrm", "model.compile=true", "debug=profiler")
    assert compiled.trainer.profiler.record_module_names is False
    checkout = user_checkout(tmp_path / "checkout", TINY_CTR_RUN)
    done = run_command("python src/train.py model=dlrm model.compile=true debug=profiler", cwd=checkout,
                       known_segfault="torch 2.13's profiler, about 1 run in 10 (tests/dlrm/test_dlrm_train.py)")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "recompile_limit" not in out and "[filelock]" not in out and "[fsspec" not in out, out[-4000:]
    assert "[recforge.pipeline][INFO] - training; run directory:" in out, out[-4000:]
    assert list((checkout / "outputs").rglob("*.pt.trace.json")), "no profiler trace was written"
    assert not list((checkout / "outputs").rglob("*.ckpt")), "a run without checkpoint callbacks wrote one"


# ---------------------------------------------------------------- a compiled DLRM's recompiles
def _tiny_dlrm():
    from recforge.models.dlrm import DLRM

    torch.manual_seed(0)
    return DLRM([5, 7, 9, 11], n_dense=4, embedding_dim=4, dense_arch=[16], over_arch=[32])


def _batch(batch: int):
    gen = torch.Generator().manual_seed(batch)
    dense = torch.rand(batch, 4, generator=gen)
    sparse = torch.stack([torch.randint(0, c, (batch,), generator=gen) for c in (5, 7, 9, 11)], dim=1)
    labels = (torch.rand(batch, generator=gen) < 0.3).float()
    return dense, sparse, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.isolated
def test_compiled_dlrm_compiles_once_per_autograd_mode_for_any_batch_size() -> None:
    """Training batches of 10 sizes (an epoch's last batch is another size), then evaluation
    batches of 10 sizes under no_grad (validation) and 3 under inference_mode (test), as Lightning
    runs them: one graph for each of the three modes, and the compiled model computes what the
    eager one does."""
    from torch._dynamo.utils import counters

    eager = _tiny_dlrm()
    compiled = copy.deepcopy(eager)
    compiled.compile_dense = True
    counters.clear()

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    for batch in (64, 37, 128, 5, 9, 200, 2, 3, 100, 17):
        results = []
        for model in (eager, compiled):
            model.train()
            model.zero_grad(set_to_none=True)
            dense, sparse, labels = _batch(batch)
            logits = model(dense, sparse)
            F.binary_cross_entropy_with_logits(logits, labels).backward()
            results.append((logits.detach(), _grads(model)))
        (logits_e, grads_e), (logits_c, grads_c) = results
        torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-5)
        assert grads_c.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, b=batch: f"B={b} {n}: {m}")
    assert graphs() == 1, f"training batches of 10 sizes took {graphs()} compiled graphs"

    for mode, sizes, expected in (
        (torch.no_grad, (256, 13, 7, 1000, 3, 64, 33, 500, 2, 129), 2),
        (torch.inference_mode, (256, 19, 4), 3),
    ):
        for batch in sizes:
            dense, sparse, _labels = _batch(batch)
            with mode():
                outputs = [model.eval()(dense, sparse) for model in (eager, compiled)]
            torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
        assert graphs() == expected, f"{mode.__name__} batches of {len(sizes)} sizes: {graphs()} graphs in all"


# ---------------------------------------------------------------- an Optuna sweep
# the README's Optuna line with test_sweeps.py's tiny profile: the session runs the sweep once
OPTUNA_SWEEP = "python src/train.py hparams_search=gru4rec_optuna"
OPTUNA_PROFILE = [*TINY_RUN, "hydra.sweeper.n_trials=2"]


@pytest.mark.slow
def test_optuna_sweep_prints_no_alembic_plugin_lines(user_sweep):
    _checkout, done = user_sweep(OPTUNA_SWEEP, OPTUNA_PROFILE)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "setup plugin" not in out, out[:4000]
    # the sweeper's own lines and the jobs' are still there
    assert "[HYDRA] Study name: gru4rec" in out, out[:4000]
    assert "[HYDRA] Best value:" in out, out[-4000:]
    assert "[recforge.pipeline][INFO] - training; run directory:" in out, out[-4000:]


# ---------------------------------------------------------------- a W&B run
@pytest.mark.isolated
def test_wandb_run_prints_no_anonymous_setting_warning(tmp_path, capfd, monkeypatch) -> None:
    """The W&B logger conf/logger/wandb.yaml makes, offline, in a process of its own (wandb prints
    the warning once per process); Lightning's own logger, beside it, still makes wandb print it."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from recforge.callbacks.wandb_run import LightningWandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "false")
    node = OmegaConf.load(REPO_ROOT / "conf" / "logger" / "wandb.yaml").wandb
    logger = instantiate({"_target_": node._target_, "save_dir": str(tmp_path), "offline": True,
                          "project": "recforge-quiet-test"})
    assert isinstance(logger, LightningWandbLogger)
    logger.log_hyperparams({"lr": 0.1})  # starts the W&B run (wandb.init)
    import wandb

    wandb.finish()
    err = capfd.readouterr().err
    assert "wandb" in err.lower() and "offline" in err.lower(), err  # W&B's run lines still show
    assert "anonymous setting" not in err, err
    # the oracle: what the warning looks like when Lightning's logger starts a run
    lightning = LightningWandbLogger(save_dir=str(tmp_path / "l"), offline=True, project="recforge-quiet-test")
    lightning.log_hyperparams({"lr": 0.1})
    wandb.finish()
    assert "anonymous setting" in capfd.readouterr().err

"""CTRTask with DLRM end to end: it learns the synthetic click model, resume equals an
uninterrupted run, DDP reduces the metrics of every row, the optimiser and schedule options, the
profiler preset, and the real Criteo sample from raw text to metrics."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from processes import run_child
import torch

from conftest import CHEAP, REPO_ROOT

from recforge.errors import UserInputError
from recforge.optim.schedules import dlrm_lr_scale
from recforge.pipeline import build, evaluate, train

# a narrow DLRM on a small synthetic set: seconds per epoch
SMALL = ["model=dlrm", "data.generator.n_rows=6000", "data.batch_size=128", "data.eval_batch_size=1000",
         "model.dense_arch=[32,16]", "model.over_arch=[32]", "model.embedding_dim=8"]


def _weights(ckpt: str | Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


@pytest.mark.slow
def test_dlrm_learns_the_click_model(make_cfg):
    cfg = make_cfg(*SMALL, "data.generator.n_rows=60000", "trainer.max_epochs=3", "optimizer=adagrad",
                   "optimizer.lr=0.05")
    metrics = train(cfg)
    for split in ("val", "test"):
        for name in ("auc", "logloss", "accuracy", "calibration"):
            assert math.isfinite(metrics[f"{split}/{name}"]), f"{split}/{name}"
    datamodule, _ = build(cfg)
    oracle = datamodule.metadata["oracle_auc"]
    # learned something real, and never more than the generator's own probabilities allow
    assert 0.65 < metrics["test/auc"] <= oracle + 0.01
    assert metrics["val/auc_best"] == pytest.approx(max(metrics["val/auc_best"], metrics["val/auc"]))


@pytest.mark.slow
def test_resume_trains_like_an_uninterrupted_run(make_cfg):
    straight = train(make_cfg(*SMALL, "trainer.max_epochs=2", run="straight"))
    first = train(make_cfg(*SMALL, "trainer.max_epochs=1", run="first"))
    last = Path(first["test_checkpoint"]).parent / "last.ckpt"
    resumed = train(make_cfg(*SMALL, "trainer.max_epochs=2", f"ckpt_path={last}", run="resumed"))
    a = _weights(Path(straight["test_checkpoint"]).parent / "last.ckpt")
    b = _weights(Path(resumed["test_checkpoint"]).parent / "last.ckpt")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert resumed["val/auc"] == straight["val/auc"]


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "steps"), [(0, (20, 40)), (2, (45,))])
def test_resume_inside_an_epoch_trains_like_an_uninterrupted_run(make_cfg, tmp_path, workers, steps):
    """A checkpoint saved mid-epoch (in epoch 0 at step 20, in epoch 1 at 40; 33 batches an epoch)
    resumes on the rows the uninterrupted run trained next: the same final weights, bit for bit."""
    loader = [f"data.num_workers={workers}", "~callbacks.early_stopping"]
    saves = [f"+callbacks.save_{k}._target_=conftest.SaveCheckpointAt" for k in steps]
    saves += [f"+callbacks.save_{k}.step={k}" for k in steps]
    saves += [f"+callbacks.save_{k}.path={tmp_path / f'step{k}.ckpt'}" for k in steps]
    straight = train(make_cfg(*SMALL, *loader, *saves, "trainer.max_epochs=2", run="straight"))
    want = _weights(Path(straight["test_checkpoint"]).parent / "last.ckpt")
    for k in steps:
        mid = torch.load(tmp_path / f"step{k}.ckpt", weights_only=False)
        assert mid["global_step"] == k and 0 < mid["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"][
            "processed"] < 33
        resumed = train(make_cfg(*SMALL, *loader, "trainer.max_epochs=2", f"ckpt_path={tmp_path / f'step{k}.ckpt'}",
                                 run=f"resumed{k}"))
        got = _weights(Path(resumed["test_checkpoint"]).parent / "last.ckpt")
        assert torch.load(Path(resumed["test_checkpoint"]).parent / "last.ckpt", weights_only=False)[
            "global_step"] == 66
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=lambda m, k=k, key=key: f"{k} {key}: {m}")


@pytest.mark.slow
def test_a_run_stopped_by_a_step_limit_resumes_as_if_uninterrupted(make_cfg):
    """``trainer.max_steps=20`` stops inside epoch 0 (33 batches an epoch), before any validation:
    its last.ckpt holds that step, and resumed without the limit the run ends with the
    uninterrupted run's weights, bit for bit (Lightning alone left no checkpoint of it)."""
    fixed = [*SMALL, "~callbacks.early_stopping", "trainer.max_epochs=2", "test=false"]
    straight = make_cfg(*fixed, run="straight")
    train(straight)
    stopped = make_cfg(*fixed, "trainer.max_steps=20", run="stopped")
    train(stopped)
    last = Path(stopped.paths.output_dir) / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 20
    resumed = make_cfg(*fixed, f"ckpt_path={last}", run="resumed")
    train(resumed)
    want = _weights(Path(straight.paths.output_dir) / "checkpoints" / "last.ckpt")
    got = _weights(Path(resumed.paths.output_dir) / "checkpoints" / "last.ckpt")
    assert torch.load(Path(resumed.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)[
        "global_step"] == 66
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
def test_ddp_two_cpu_processes_reduce_the_metrics_of_every_row(make_cfg, tmp_path, data_dir):
    """``hardware=ddp_cpu`` as a user runs it: the test AUC, logloss, ... it reports (rows split
    between the ranks, AUC from the gathered scores) equal a single-process evaluation of its
    checkpoint, and each rank stepped through half of the training rows."""
    log_dir = tmp_path / "ddp"
    cmd = [sys.executable, "src/train.py", "hardware=ddp_cpu", *SMALL, *CHEAP, "trainer.max_epochs=2",
           f"paths.log_dir={log_dir}", f"paths.data_dir={data_dir}"]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    done = run_child(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    trained = json.loads((run_dir / "metrics.json").read_text())
    ckpt = trained["test_checkpoint"]
    single = evaluate(make_cfg(*SMALL, f"ckpt_path={ckpt}", name="eval", run="single"))
    test = {k: v for k, v in trained.items() if k.startswith("test/") and "per_s" not in k}
    assert set(test) >= {"test/auc", "test/logloss", "test/accuracy", "test/calibration"}
    assert test == pytest.approx({k: single[k] for k in test}, abs=1e-6)
    datamodule, _ = build(make_cfg(*SMALL, run="probe"))
    n_train = datamodule.metadata["splits"]["train"]["rows"]
    state = torch.load(Path(ckpt).parent / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2 * math.ceil((n_train // 2) / 128)


def test_adam_on_sparse_tables_is_refused_in_one_line(make_cfg):
    _, task = build(make_cfg(*SMALL, "optimizer=adam"))
    with pytest.raises(UserInputError, match=r"^optimizer Adam cannot update the embedding tables' sparse "
                       r"gradients: .*model.sparse_gradients=false$"):
        task.configure_optimizers()


def test_adam_with_dense_tables_and_row_wise_groups(make_cfg):
    _, task = build(make_cfg(*SMALL, "optimizer=adam", "model.sparse_gradients=false"))
    assert isinstance(task.configure_optimizers(), torch.optim.Adam)
    _, task = build(make_cfg(*SMALL, "optimizer=rowwise_adagrad"))
    optimizer = task.configure_optimizers()
    groups = optimizer.param_groups
    tables = {id(p) for p in task.model.sparse_parameters()}
    assert [bool(g.get("sparse")) for g in groups] == [False, True]
    assert {id(p) for p in groups[1]["params"]} == tables
    assert not tables & {id(p) for p in groups[0]["params"]}
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in task.parameters())
    from recforge.optim.rowwise_adagrad import RowWiseAdagrad

    _, task = build(make_cfg(*SMALL, "optimizer=adam_rowwise_adagrad"))
    optimizer = task.configure_optimizers()
    assert isinstance(optimizer.optimizers["dense"], torch.optim.Adam)
    assert isinstance(optimizer.optimizers["sparse"], RowWiseAdagrad)
    tables = {id(p) for p in task.model.sparse_parameters()}
    assert {id(p) for p in optimizer.optimizers["sparse"].param_groups[0]["params"]} == tables


def test_the_schedule_steps_once_per_update(make_cfg):
    warmup, start, steps = 4, 6, 5
    schedule = ["+task.scheduler._target_=recforge.optim.schedules.DLRMLRPolicy", "+task.scheduler._partial_=true",
                f"+task.scheduler.warmup_steps={warmup}", f"+task.scheduler.decay_start_step={start}",
                f"+task.scheduler.decay_steps={steps}"]
    cfg = make_cfg(*SMALL, "trainer.max_epochs=1", "trainer.limit_train_batches=8", "trainer.limit_val_batches=1",
                   "test=false", *schedule)
    from omegaconf import OmegaConf

    assert OmegaConf.select(cfg, "task.scheduler.warmup_steps") == warmup
    datamodule, task = build(cfg)
    import lightning as L

    trainer = L.Trainer(max_epochs=1, limit_train_batches=8, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=datamodule)
    lr = task.optimizers().param_groups[0]["lr"]
    assert lr == pytest.approx(cfg.optimizer.lr * dlrm_lr_scale(8, warmup, start, steps, 1e-7))


def test_a_logloss_monitor_is_minimised(make_cfg):
    cfg = make_cfg(*SMALL, "evaluation.monitor=val/logloss")
    assert cfg.optimized_metric == "val/logloss"
    assert cfg.callbacks.model_checkpoint.mode == "min" and cfg.callbacks.early_stopping.mode == "min"
    cfg = make_cfg(*SMALL)
    assert cfg.callbacks.model_checkpoint.mode == "max" and cfg.callbacks.early_stopping.mode == "max"


# torch 2.13's profiler corrupts its own records now and then (segfaults while recording an
# operator or freeing the results: about 1 fresh process in 10 under load, at 1 and 2 threads, with
# or without memory profiling; not reproduced outside a Lightning run)
TORCH_PROFILER_CRASH = "torch 2.13's profiler, about 1 run in 10"


@pytest.mark.slow
@pytest.mark.isolated(known_segfault=TORCH_PROFILER_CRASH)
def test_profiler_preset_writes_a_tensorboard_trace(make_cfg, tmp_path):
    cfg = make_cfg(*SMALL, "debug=profiler", "trainer.limit_train_batches=8", "trainer.limit_val_batches=2",
                   "trainer.detect_anomaly=false")
    train(cfg)
    traces = list(Path(cfg.paths.output_dir, "tensorboard", "profiler").glob("*.pt.trace.json"))
    assert traces, "no trace written"
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)


@pytest.mark.slow
def test_the_real_criteo_sample_from_raw_text_to_metrics(make_cfg, shared_data_dir, tmp_path):
    raw = shared_data_dir / "criteo" / "train.tiny.txt"
    out = tmp_path / "prepared"
    done = run_child(
        [sys.executable, "-m", "recforge.data.criteo.prepare", "--raw", str(raw), "--out", str(out),
         "--categorical", "vocab", "--split", "random_7_2_1", "--seed", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = make_cfg("model=dlrm", "data=criteo_kaggle", f"data.prepared_dir={out}", "data.batch_size=64",
                   "trainer.max_epochs=3", "model.dense_arch=[32,16]", "model.over_arch=[32]",
                   "model.embedding_dim=8")
    metrics = train(cfg)
    meta = json.loads((out / "metadata.json").read_text())
    assert sum(s["rows"] for s in meta["splits"].values()) == 1999
    assert 0.0 <= metrics["test/auc"] <= 1.0 and math.isfinite(metrics["test/logloss"])


@pytest.mark.slow
def test_the_readme_criteo_lines_in_a_users_order(shared_data_dir, tmp_path):
    """The README's Criteo lines as typed, in one checkout: train from the raw file (converted
    into the cache), then the prepare CLI into its own --out, then train on what it wrote."""
    import shutil

    from conftest import readme_commands, run_command, user_checkout

    lines = [c for c in readme_commands() if "data/raw/criteo/train.txt" in c]
    from_raw = next(c for c in lines if c.startswith("python src/train.py model=dlrm data=criteo_kaggle"))
    prepare = next(c for c in lines if "recforge.data.criteo.prepare" in c)
    out = prepare.split("--out ", 1)[1].split()[0]
    checkout = user_checkout(tmp_path / "repo", local=["trainer.max_epochs=1"])
    (checkout / "data" / "raw" / "criteo").mkdir(parents=True)
    shutil.copy2(shared_data_dir / "criteo" / "train.tiny.txt", checkout / "data" / "raw" / "criteo" / "train.txt")
    for command in (from_raw, prepare, f"python src/train.py model=dlrm data.prepared_dir={out} data=criteo_kaggle"):
        done = run_command(command, cwd=checkout)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    assert (checkout / out / "metadata.json").is_file()

"""End-to-end runs on tiny synthetic data: learning, resume, eval reproduction, loggers, DDP."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from processes import run_child
import torch

from recforge.pipeline import build, evaluate, train

pytestmark = pytest.mark.slow


def _test_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("test/") and "per_s" not in k}


def most_popular_recall(datamodule, k: int) -> float:
    """Recall@k of ranking items by training popularity, ties counted against it (numpy oracle)."""
    pop = datamodule.catalog.popularity
    test = datamodule.split("test")
    starts = set(test.offsets[:-1].tolist())
    targets = np.array([test.items[i] for i in range(test.n_events) if i not in starts])
    sorted_pop = np.sort(pop)
    # rank = #items with popularity >= the target's (the target included)
    ranks = len(pop) - np.searchsorted(sorted_pop, pop[targets], side="left")
    return float(np.mean(ranks <= k))


def test_training_beats_most_popular(make_cfg):
    cfg = make_cfg("trainer.max_epochs=2")
    metrics = train(cfg)
    datamodule, _ = build(cfg)
    baseline = most_popular_recall(datamodule, 20)
    assert metrics["test/recall@20"] > baseline + 0.15, (metrics["test/recall@20"], baseline)
    assert metrics["test/mrr@20"] > 0.05
    written = json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())
    for key in ("val/recall@20", "test/mrr@20", "epochs", "wall_time_s", "train/events_per_s"):
        assert key in written, key
    assert written["epochs"] == 2
    assert written["train/events_per_s"] > 0
    assert (Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt").exists()


def test_bprmax_learns(make_cfg):
    # BPR-max needs the extra negatives: against in-batch (popularity-sampled) negatives alone it
    # learns to push popular items down and loses to most-popular on a skewed catalogue.
    metrics = train(make_cfg("loss=bprmax", "trainer.max_epochs=2"))
    cfg = make_cfg("loss=bprmax", run="again")
    datamodule, _ = build(cfg)
    assert metrics["test/recall@20"] > most_popular_recall(datamodule, 20) + 0.1


@pytest.mark.parametrize("loss", ["xe", "bprmax"])
def test_the_fast_step_trains_through_its_fused_node_and_learns(make_cfg, loss):
    """task.fast_step on the default model takes the written-out step (one autograd node for the
    whole step) in training, and learns as the exact step does (test_training_beats_most_popular)."""
    overrides = ["task.fast_step=true", f"loss={loss}"]
    cfg = make_cfg(*overrides, "trainer.max_epochs=2")
    datamodule, task = build(make_cfg(*overrides, run="probe"))
    datamodule.setup("fit")
    task.train()
    task.on_train_epoch_start()
    batch = next(iter(datamodule.train_dataloader()))
    step = batch.steps[0] if hasattr(batch, "steps") else batch
    assert type(task.train_loss(step).grad_fn).__name__ == "_FusedStepBackward"
    metrics = train(cfg)
    assert metrics["test/recall@20"] > most_popular_recall(datamodule, 20) + 0.1


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def test_resume_matches_uninterrupted_run(make_cfg):
    no_stop = ["callbacks.early_stopping.patience=100"]
    straight = train(make_cfg("trainer.max_epochs=2", *no_stop, run="straight"))
    first = make_cfg("trainer.max_epochs=1", *no_stop, run="first")
    train(first)
    last = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["epoch"] == 0
    resumed_cfg = make_cfg("trainer.max_epochs=2", f"ckpt_path={last}", *no_stop, run="resumed")
    resumed = train(resumed_cfg)
    assert resumed["epochs"] == 2
    ckpt_dir = Path(resumed_cfg.paths.output_dir) / "checkpoints"
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["epoch"] == 1
    for key in ("val/recall@20", "val/mrr@20"):
        assert resumed[key] == pytest.approx(straight[key], abs=1e-6), key
    a = _weights(ckpt_dir / "last.ckpt")
    b = _weights(Path(straight["test_checkpoint"]).parent / "last.ckpt")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("per_batch", [1, 3])
def test_resume_inside_an_epoch_matches_an_uninterrupted_run(make_cfg, tmp_path, per_batch):
    """Checkpoints saved inside epoch 0 and inside epoch 1 resume where the uninterrupted run was:
    the loader skips the steps already trained and the sessions in flight keep their hidden state.
    (Lightning skips on_train_epoch_start on such a resume: the task's and the throughput
    callback's epoch state must not depend on it.)"""
    common = ["callbacks.early_stopping.patience=100", f"data.steps_per_batch={per_batch}"]
    probe = train(make_cfg("trainer.max_epochs=1", *common, run="probe"))
    n = torch.load(Path(probe["test_checkpoint"]).parent / "last.ckpt", weights_only=False)["global_step"]
    assert n >= 8
    steps = (3 * per_batch, n + n // 2)
    saves = [f"+callbacks.save_{k}._target_=conftest.SaveCheckpointAt" for k in steps]
    saves += [f"+callbacks.save_{k}.step={k}" for k in steps]
    saves += [f"+callbacks.save_{k}.path={tmp_path / f'step{k}.ckpt'}" for k in steps]
    straight = train(make_cfg("trainer.max_epochs=2", *common, *saves, run="straight"))
    want = _weights(Path(straight["test_checkpoint"]).parent / "last.ckpt")
    for k in steps:
        mid = torch.load(tmp_path / f"step{k}.ckpt", weights_only=False)
        assert mid["train_hidden"] is not None and mid["epoch"] == (0 if k < n else 1)
        resumed = train(make_cfg("trainer.max_epochs=2", *common, f"ckpt_path={tmp_path / f'step{k}.ckpt'}",
                                 run=f"resumed{k}"))
        assert math.isfinite(resumed["train/loss_epoch"])
        got = _weights(Path(resumed["test_checkpoint"]).parent / "last.ckpt")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"step {k}: {name}")


def test_grouped_steps_train_exactly_like_single_steps(make_cfg):
    """data.steps_per_batch only regroups the loop: same updates, same order, same weights."""
    import lightning as L

    def run(per_batch: int):
        cfg = make_cfg(f"data.steps_per_batch={per_batch}", "task.n_sample=16", "seed=3",
                       run=f"group{per_batch}")
        L.seed_everything(3)
        datamodule, task = build(cfg)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(task, datamodule=datamodule)
        return trainer.global_step, {k: v.detach().clone() for k, v in task.model.state_dict().items()}

    steps_one, weights_one = run(1)
    steps_five, weights_five = run(5)
    assert steps_one == steps_five > 5  # optimizer steps, not Lightning batches
    for name, value in weights_one.items():
        assert torch.equal(value, weights_five[name]), name


def test_a_step_limit_inside_a_group_stops_at_that_update(make_cfg):
    """trainer.max_steps counts updates: 5 with 8 steps a Lightning batch is 5, not the group's 8,
    the same 5 as ungrouped (weights equal), and only their events are counted."""
    runs = {}
    for per_batch in (1, 8):
        cfg = make_cfg("trainer.max_steps=5", f"data.steps_per_batch={per_batch}", "seed=3", run=f"limit{per_batch}")
        metrics = train(cfg)
        checkpoint = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
        runs[per_batch] = metrics, checkpoint
    for metrics, checkpoint in runs.values():
        assert checkpoint["global_step"] == 5
        assert metrics["train/events"] == 5 * cfg.data.batch_size
    for name, value in runs[1][1]["state_dict"].items():
        assert torch.equal(value, runs[8][1]["state_dict"][name]), name


@pytest.mark.parametrize("where", ["inside epoch 1", "in epoch 0's last group"])
def test_a_step_limit_inside_a_group_leaves_a_last_that_resumes_as_if_uninterrupted(make_cfg, where):
    """With 8 steps a Lightning batch, trainer.max_steps 10 updates into epoch 1 cuts its second
    group after 2 steps; one update before epoch 0's end cuts its last group one step short.
    last.ckpt holds that update and says so, and the resumed run trains the group's other steps
    first: its final weights are the uninterrupted run's, bit for bit (it skipped the whole group
    before)."""
    fixed = ["data.steps_per_batch=8", "trainer.max_epochs=2", "~callbacks.early_stopping", "test=false"]

    def last(cfg) -> dict:
        return torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)

    straight = make_cfg(*fixed, run="straight")
    train(straight)
    want = last(straight)
    per_epoch = want["global_step"] // 2
    assert per_epoch % 8 != 1, "epoch 0's last group must have a step after the cut"
    limit = per_epoch + 10 if where == "inside epoch 1" else per_epoch - 1
    stopped = make_cfg(*fixed, f"trainer.max_steps={limit}", run="stopped")
    train(stopped)
    assert last(stopped)["global_step"] == limit
    resumed = make_cfg(*fixed, f"ckpt_path={Path(stopped.paths.output_dir) / 'checkpoints' / 'last.ckpt'}",
                       run="resumed")
    train(resumed)
    got = last(resumed)
    assert got["global_step"] == want["global_step"]
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name


def test_eval_reproduces_training_test_metrics(make_cfg):
    trained = train(make_cfg())
    ckpt = trained["test_checkpoint"]
    evaluated = evaluate(make_cfg(f"ckpt_path={ckpt}", name="eval", run="eval"))
    assert _test_metrics(evaluated) == pytest.approx(_test_metrics(trained), abs=1e-7)
    assert len(_test_metrics(evaluated)) == 8
    # train=false with the checkpoint tests it as src/eval.py does (it tested the initial weights)
    tested = train(make_cfg("train=false", f"ckpt_path={ckpt}", run="test-only"))
    assert tested["test_checkpoint"] == ckpt
    assert _test_metrics(tested) == pytest.approx(_test_metrics(trained), abs=1e-7)


def test_eval_overrides_apply_on_top_of_the_run_config(make_cfg):
    trained = train(make_cfg())
    eval_cfg = make_cfg(
        f"ckpt_path={trained['test_checkpoint']}", "evaluation.ties=standard", name="eval", run="e"
    )
    # Hydra records command-line overrides; evaluation_config applies them over the run's config.
    assert "evaluation.ties=standard" in list(eval_cfg.hydra.overrides.task)
    optimistic = evaluate(eval_cfg)
    # Optimistic ties can only rank targets higher than conservative ones.
    assert optimistic["test/recall@20"] >= trained["test/recall@20"]
    # other cut-offs: the run's monitor (val/mrr@20), which nothing follows in an evaluation, is
    # not asked for (it refused them, "not a metric this evaluation logs")
    cut = evaluate(make_cfg(f"ckpt_path={trained['test_checkpoint']}", "evaluation.ks=[5,50]", name="eval", run="k"))
    assert sorted(_test_metrics(cut)) == ["test/mrr@5", "test/mrr@50", "test/recall@5", "test/recall@50"]
    assert cut["test/recall@5"] == pytest.approx(trained["test/recall@5"], abs=1e-7)


def test_wandb_offline_writes_a_run(make_cfg, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = make_cfg("logger=wandb", "trainer.limit_train_batches=20")
    train(cfg)
    runs = list((Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert list(runs[0].glob("*.wandb")), "the offline run holds no data file"
    import wandb

    assert wandb.run is None, "the W&B run was left open"


def _rank_failures(stderr: str) -> str:
    """Both ranks write to one stderr: every traceback or fatal error in it, then its tail."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(("Traceback", "Fatal Python error"))]
    blocks = ["\n".join(lines[i:i + 60]) for i in starts]
    return "\n---\n".join([*blocks, "last lines:", "\n".join(lines[-40:])])


def test_ddp_two_cpu_processes_reduce_metrics(make_cfg, tmp_path, data_dir):
    """hardware=ddp_cpu as a user runs it: Lightning relaunches src/train.py for rank 1."""
    from conftest import CHEAP, REPO_ROOT, compose_config, shrinks_for

    # the command line takes only keys the default (GRU4Rec, synthetic sessions) config has
    GRU4REC_SIZES = shrinks_for(compose_config("train", [], tmp_path / "probe", data_dir), [])

    log_dir = tmp_path / "ddp"
    cmd = [
        sys.executable, "src/train.py", "hardware=ddp_cpu", *GRU4REC_SIZES, *CHEAP,
        f"paths.log_dir={log_dir}", f"paths.data_dir={data_dir}",
    ]
    # faulthandler: a rank that dies of a signal still leaves its Python stack in stderr
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    done = run_child(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, _rank_failures(done.stderr)
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    trained = json.loads((run_dir / "metrics.json").read_text())
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    ckpt = trained["test_checkpoint"]
    assert ckpt and Path(ckpt).exists()
    single = evaluate(make_cfg(f"ckpt_path={ckpt}", name="eval", run="single"))
    assert _test_metrics(trained) == pytest.approx(_test_metrics(single), abs=1e-6)
    assert trained["test/recall@20"] > 0.3  # the DDP run learned something
    # Each rank trained on its own half of the sessions, so equal metrics above mean the evaluation
    # counts really were summed across ranks; the events trained on are both ranks' (they were
    # rank 0's half)
    datamodule, _ = build(make_cfg(run="probe"))
    assert trained["train/events"] == datamodule.split("train").n_targets


def test_ddp_ranks_past_a_padded_epoch_stay_equal_stop_together_and_resume_exactly(make_cfg, tmp_path, data_dir):
    """The rank with fewer steps pads to the other's count. Its padding steps apply the averaged
    update the other rank applies, so the two replicas end equal to the bit (before: up to 0.07
    apart after two epochs); they are counted, so both ranks agree on trainer.global_step, and a
    limit 10 updates into the second epoch stops both (uncounted, one rank stopped while the other
    waited in its all-reduce). That limit cuts a group of 8 steps after 2; resumed, each rank
    takes back its own sessions in flight and negatives' stream (rank 0 alone writes the
    checkpoint) and the group's other steps: both ranks end as in the uninterrupted run, bit for
    bit (before, rank 1 took rank 0's sessions and stream)."""
    from conftest import CHEAP, REPO_ROOT, compose_config, shrinks_for
    from rank_weights import load_rank_weights

    from recforge.data.sessions.parallel import count_steps

    small = ["data.generator.n_sessions=1000"]  # three 2-process runs: 60 steps an epoch
    sizes = shrinks_for(compose_config("train", small, tmp_path / "probe", data_dir), small) + small
    datamodule, task = build(make_cfg(*small, run="probe"))
    arrays = datamodule.split("train")
    steps = [count_steps(arrays.offsets, arrays.partition(r, 2), datamodule.batch_size, task.min_batch_rows)
             for r in range(2)]
    assert steps[0] != steps[1]  # one rank pads
    limit = max(steps) + 10
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}

    def run(name: str, *extra: str) -> Path:
        cmd = [sys.executable, "src/train.py", "hardware=ddp_cpu", *sizes, *CHEAP, "trainer.max_epochs=2",
               "~callbacks.early_stopping", f"paths.log_dir={tmp_path / name}", f"paths.data_dir={data_dir}",
               "+callbacks.rank_weights._target_=rank_weights.SaveRankWeights",
               f"+callbacks.rank_weights.out={tmp_path / name / 'weights'}", *extra]
        done = run_child(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, _rank_failures(done.stderr)
        (run_dir,) = (tmp_path / name / "train" / "runs").iterdir()
        return run_dir

    stopped = run("stopped", f"trainer.max_steps={limit}", "test=false")
    trained = json.loads((stopped / "metrics.json").read_text())
    # each rank trained 10 updates of the second epoch, then both stopped (no all-reduce left
    # waiting: the run ended)
    assert trained["epochs"] == 2
    assert 2 * 9 * 32 < trained["train/events"] <= 2 * 10 * 32  # both ranks' (a padding step has none)
    rank0, rank1 = load_rank_weights(tmp_path / "stopped" / "weights", world=2)
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        torch.testing.assert_close(rank1[name], rank0[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    run("straight", "test=false")
    run("resumed", "test=false", f"ckpt_path={stopped / 'checkpoints' / 'last.ckpt'}")
    want = load_rank_weights(tmp_path / "straight" / "weights", world=2)
    got = load_rank_weights(tmp_path / "resumed" / "weights", world=2)
    for rank in range(2):
        for name in want[rank]:
            torch.testing.assert_close(got[rank][name], want[rank][name], rtol=0, atol=0,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam_rowwise_adagrad"])
def test_a_dense_sparse_optimizer_updates_the_item_tables_row_wise(optimizer, make_cfg):
    """The dense/sparse optimizers route groups by their "sparse" flag: GRU4Rec's sparse item
    tables go to the row-wise child (one accumulator per row), the GRU to the dense child (Adam was
    given them all and stopped at the first sparse gradient)."""
    from torch import nn

    from recforge.optim.rowwise_adagrad import RowWiseAdagrad

    cfg = make_cfg(f"optimizer={optimizer}", "trainer.limit_train_batches=20", run=optimizer)
    _, task = build(cfg)
    optim = task.configure_optimizers()
    tables = {id(m.weight): m.weight for m in task.modules() if isinstance(m, nn.Embedding) and m.sparse}
    assert tables
    sparse_child, dense_child = optim.optimizers["sparse"], optim.optimizers["dense"]
    assert isinstance(sparse_child, RowWiseAdagrad)
    assert {id(p) for g in sparse_child.param_groups for p in g["params"]} == set(tables)
    dense_ids = {id(p) for g in dense_child.param_groups for p in g["params"]}
    assert dense_ids == {id(p) for p in task.parameters()} - set(tables)
    trained = train(cfg)
    assert math.isfinite(trained["test/recall@20"]) and trained["test/recall@20"] > 0


@pytest.mark.parametrize("interval,step_size", [("epoch", 1), ("step", 40)])
def test_a_schedule_from_the_command_line_steps_per_epoch_or_per_update(interval, step_size, make_cfg):
    """``task.scheduler`` and ``task.scheduler_interval`` are in the task's config (a ``+`` was
    needed, and the interval was DLRM's only): StepLR halves the rate every ``step_size`` epochs
    or updates, so the rate at the end is the initial one over 2^(epochs or updates // step_size)."""
    cfg = make_cfg("task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:"
                   f"{step_size},gamma:0.5}}", f"task.scheduler_interval={interval}", "trainer.max_epochs=2",
                   "trainer.limit_train_batches=20", "~callbacks.early_stopping", run=interval)
    train(cfg)
    last = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    counted = 2 if interval == "epoch" else last["global_step"]
    assert counted >= 2 * step_size  # the rate moved at least twice
    (group,) = last["optimizer_states"][0]["param_groups"]
    assert group["lr"] == pytest.approx(cfg.optimizer.lr * 0.5 ** (counted // step_size), rel=1e-12)


def test_gradient_clipping_of_sparse_gradients_trains(make_cfg):
    clipped = train(make_cfg("task.gradient_clip_val=0.01", "trainer.limit_train_batches=30", run="clip"))
    free = train(make_cfg("trainer.limit_train_batches=30", run="free"))
    # the same seed and data: only the clipping differs, and a tight bound must change the result
    assert clipped["val/mrr@20"] != pytest.approx(free["val/mrr@20"], abs=1e-9)

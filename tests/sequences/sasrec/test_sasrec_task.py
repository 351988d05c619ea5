"""SequentialRetrievalTask with SASRec, end to end on synthetic histories: the evaluation against a
brute-force ranking, learning against most-popular, and resume against an uninterrupted run."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from processes import run_child
import torch

from sequences.oracles import most_popular_hr

from recforge.pipeline import build, train

SMALL = ["model=sasrec", "data.generator.n_users=300", "data.generator.n_items=200",
         "data.generator.max_length=60", "data.max_seq_len=50", "data.eval_batch_size=64"]


def brute_force_metrics(task, batches, ks=(1, 10, 50)) -> dict[str, float]:
    """HR@k / NDCG@k / MRR by scoring each user alone against every item in float64, excluded items
    (other than the target) left out, ties counted against the target."""
    model = task.model.eval().double()
    items = torch.nn.functional.normalize(model.item_table.detach(), dim=-1, eps=1e-6)
    ranks = []
    with torch.no_grad():
        for batch in batches:
            for b in range(batch.size):
                lo, hi = int(batch.offsets[b]), int(batch.offsets[b + 1])
                history = batch.items[lo:hi]
                query = model(history, torch.tensor([0, hi - lo]))[-1]
                scores = (items @ query).numpy()
                target = int(batch.targets[b])
                excluded = set(batch.exclude_items[batch.exclude_offsets[b]:batch.exclude_offsets[b + 1]].tolist())
                others = [j for j in range(len(scores)) if j != target and j not in excluded]
                ranks.append(1 + int(np.sum(scores[others] >= scores[target])))
    model.float()
    r = np.array(ranks, dtype=np.float64)
    out = {f"hr@{k}": float(np.mean(r <= k)) for k in ks}
    out |= {f"ndcg@{k}": float(np.mean(np.where(r <= k, 1 / np.log2(r + 1), 0))) for k in ks}
    out["mrr"] = float(np.mean(1 / r))
    return out


def test_validation_metrics_equal_a_brute_force_ranking(make_cfg):
    cfg = make_cfg(*SMALL, "evaluation.ks=[1,10,50]", "evaluation.chunk_size=37")
    datamodule, task = build(cfg)
    datamodule.setup("fit")
    batches = list(datamodule.val_dataloader())
    assert all(b.exclude_items is not None for b in batches)
    task.eval()
    task.on_validation_epoch_start()
    with torch.no_grad():
        for i, batch in enumerate(batches):
            task.validation_step(batch, i)
    got = {k.removeprefix("val/"): float(v) for k, v in task.evaluation.compute_and_reset("val").items()}
    want = brute_force_metrics(task, batches)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key


@pytest.mark.slow
def test_sasrec_learns_beyond_most_popular(make_cfg):
    cfg = make_cfg(*SMALL, "trainer.max_epochs=8", "callbacks.early_stopping.patience=100")
    metrics = train(cfg)
    datamodule, _ = build(cfg)
    datamodule.setup("test")
    baseline = most_popular_hr(datamodule, 10)
    assert metrics["test/hr@10"] > baseline + 0.1, (metrics["test/hr@10"], baseline)
    for key in ("val/ndcg@10", "test/hr@200", "test/mrr", "val/ndcg@10_best"):
        assert key in metrics, key


# dropout on: its masks are drawn per step from (seed, rank, step), the negatives' stream, the
# users' order and the optimizer state travel in the checkpoint; all must carry over, for HSTU too
RESUMABLE = {"sasrec": SMALL, "hstu": ["model=hstu", *SMALL[1:]]}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(RESUMABLE))
def test_resume_trains_like_an_uninterrupted_run(make_cfg, model):
    exact = [*RESUMABLE[model], "callbacks.early_stopping.patience=100"]
    straight = train(make_cfg(*exact, "trainer.max_epochs=2", run="straight"))
    first = make_cfg(*exact, "trainer.max_epochs=1", run="first")
    train(first)
    last = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    resumed = train(make_cfg(*exact, "trainer.max_epochs=2", f"ckpt_path={last}", run="resumed"))
    assert resumed["epochs"] == 2
    a = torch.load(Path(resumed["test_checkpoint"]).parent / "last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(Path(straight["test_checkpoint"]).parent / "last.ckpt", weights_only=True)["state_dict"]
    for name, value in b.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(a[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(RESUMABLE))
def test_resume_inside_an_epoch_trains_like_an_uninterrupted_run(make_cfg, tmp_path, model):
    """Checkpoints saved inside epoch 0 and inside epoch 1 resume on the users the uninterrupted
    run trained next (the loader skips the epoch's trained batches): the same final weights."""
    exact = [*RESUMABLE[model], "~callbacks.early_stopping"]
    datamodule, _ = build(make_cfg(*exact, run="probe"))
    datamodule.setup("fit")
    n = len(datamodule.train_dataloader())
    assert n >= 4
    steps = (2, n + n // 2)
    saves = [f"+callbacks.save_{k}._target_=conftest.SaveCheckpointAt" for k in steps]
    saves += [f"+callbacks.save_{k}.step={k}" for k in steps]
    saves += [f"+callbacks.save_{k}.path={tmp_path / f'step{k}.ckpt'}" for k in steps]
    straight = train(make_cfg(*exact, *saves, "trainer.max_epochs=2", run="straight"))
    want = torch.load(Path(straight["test_checkpoint"]).parent / "last.ckpt", weights_only=True)["state_dict"]
    for k in steps:
        resumed = train(make_cfg(*exact, "trainer.max_epochs=2", f"ckpt_path={tmp_path / f'step{k}.ckpt'}",
                                 run=f"resumed{k}"))
        got = torch.load(Path(resumed["test_checkpoint"]).parent / "last.ckpt", weights_only=True)["state_dict"]
        for name, value in want.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"step {k}: {name}")


@pytest.mark.slow
def test_ddp_two_cpu_processes_split_users_and_reduce_metrics(make_cfg, tmp_path, data_dir):
    """``model=sasrec data=synthetic_histories hardware=ddp_cpu`` as a user runs it (Lightning
    relaunches src/train.py for rank 1): each rank trains on half of the users and evaluates half
    of them, and the test metrics it reports equal a single-process evaluation of its checkpoint."""
    import json
    import math
    import os
    import sys

    from conftest import CHEAP, REPO_ROOT

    from recforge.pipeline import evaluate

    sizes = ["model=sasrec", "data=synthetic_histories", "data.generator.n_users=300",
             "data.generator.n_items=200", "data.generator.max_length=60", "data.max_seq_len=50",
             "data.batch_size=32", "data.eval_batch_size=64"]
    log_dir = tmp_path / "ddp"
    cmd = [sys.executable, "src/train.py", "hardware=ddp_cpu", *sizes, *CHEAP, "trainer.max_epochs=2",
           f"paths.log_dir={log_dir}", f"paths.data_dir={data_dir}"]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    done = run_child(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    # epochs shorter than log_every_n_steps are normal here (known noise, recforge.utils.quiet)
    assert "smaller than the logging interval" not in done.stderr
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    trained = json.loads((run_dir / "metrics.json").read_text())
    ckpt = trained["test_checkpoint"]
    single = evaluate(make_cfg(*sizes, f"ckpt_path={ckpt}", name="eval", run="single"))
    test = {k: v for k, v in trained.items() if k.startswith("test/") and "per_s" not in k}
    assert test and test == pytest.approx({k: single[k] for k in test}, abs=1e-6)
    # each rank stepped through its own half of the training users, two epochs of it
    datamodule, _ = build(make_cfg(*sizes, run="probe"))
    datamodule.setup("fit")
    n_train = len(datamodule.dataset("train"))
    state = torch.load(Path(ckpt).parent / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2 * math.ceil(math.ceil(n_train / 2) / 32)

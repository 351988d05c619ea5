"""Partial validation (evaluation.max_users, full_every_n_epochs; spec hstu.md §1.7): the sample is
fixed, seeded and shared disjointly by DDP ranks; a partial figure equals a plain FullRanking of the
same users ranked by hand; a fit logs each kind under its own name, picks checkpoints and counts
patience on full evaluations only, and says in metrics.json what every figure covers."""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from processes import run_child
import torch

from recforge.data.sequences.datamodule import HistoryDataModule, _EvalShard
from recforge.data.sequences.prepared import write_prepared
from recforge.data.sequences.synthetic import SyntheticHistoriesConfig, generate_histories
from recforge.errors import UserInputError
from recforge.evaluation import FullRanking
from recforge.evaluation.user_sample import ValidationSample
from recforge.pipeline import build, train

pytestmark = pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")

SMALL = ["model=sasrec", "data.generator.n_users=300", "data.generator.n_items=200",
         "data.generator.max_length=60", "data.max_seq_len=50", "data.eval_batch_size=16",
         "data.batch_size=64"]


# ------------------------------------------------------------------ the sample
def test_the_sample_is_fixed_seeded_and_shared_disjointly_by_ranks():
    sample = ValidationSample(max_users=40, full_every_n_epochs=3, seed=7)
    rows = sample.rows(1000)
    assert len(rows) == 40 == len(set(rows.tolist())) and list(rows) == sorted(rows)
    assert np.array_equal(ValidationSample(40, 3, 7).rows(1000), rows)  # a function of the seed
    assert not np.array_equal(ValidationSample(40, 3, 8).rows(1000), rows)
    assert [sample.is_full(e, 1000) for e in range(7)] == [True, False, False, True, False, False, True]
    assert sample.is_full(None, 1000)  # outside a fit (trainer.validate): every user
    assert ValidationSample(40, None, 7).is_full(None, 1000) and not ValidationSample(40, None, 7).is_full(0, 1000)
    assert ValidationSample(2000, None, 7).is_full(5, 1000)  # a sample as large as the split is the split
    for world in (1, 2, 3):
        partial = [sample.start_pass(1, 1000, rank, world) for rank in range(world)]
        full = [sample.start_pass(3, 1000, rank, world) for rank in range(world)]
        # the same users every partial epoch, whatever the number of ranks: disjoint shares of it
        assert sorted(np.concatenate(partial).tolist()) == rows.tolist()
        assert sorted(np.concatenate(full).tolist()) == list(range(1000))
        for rank in range(world):
            assert np.array_equal(sample.start_pass(4, 1000, rank, world), partial[rank])
            # a full pass ranks the rank's sampled users first
            assert np.array_equal(full[rank][: len(partial[rank])], partial[rank])
            assert not set(full[rank][len(partial[rank]):].tolist()) & set(rows.tolist())


def test_the_validation_loader_ranks_the_epochs_plan_and_counts_a_full_pass(tmp_path):
    histories = generate_histories(SyntheticHistoriesConfig(n_users=23, n_items=30, min_length=4, max_length=8))
    write_prepared(tmp_path / "p", histories, dataset="test", inputs=[], params={})
    dataset = HistoryDataModule(prepared_dir=str(tmp_path / "p")).dataset("val")
    assert len(dataset) == 23
    sample = ValidationSample(max_users=5, full_every_n_epochs=2, seed=0)
    for world in (1, 2):
        seen = {0: [], 1: []}
        for rank in range(world):
            shard = _EvalShard(dataset, world, rank, sample)
            for epoch in (0, 1):
                shard.set_epoch(epoch)
                rows = list(shard)
                seen[epoch] += rows
                if epoch == 0:
                    assert len(shard) == len(rows)  # Lightning counts a full pass's batches
        assert sorted(seen[0]) == list(range(len(dataset)))
        assert sorted(seen[1]) == sample.rows(len(dataset)).tolist()
    assert sorted(_EvalShard(dataset, 1, 0, sample)) == list(range(len(dataset)))  # no epoch set: all


# ------------------------------------------------------------------ figures against an oracle
def _rank(evaluation, task, batches, split="val"):
    with torch.no_grad():
        for batch in batches:
            queries = task.model.last_positions(task.encode(batch), batch.offsets)
            evaluation.update(split, queries, task.model.item_embeddings(), None, batch.targets,
                              exclude_items=batch.exclude_items, exclude_offsets=batch.exclude_offsets)


def test_a_partial_figure_equals_a_full_ranking_of_the_same_users_ranked_by_hand(make_cfg):
    cfg = make_cfg(*SMALL, "evaluation.max_users=37", "evaluation.full_every_n_epochs=2",
                   "evaluation.chunk_size=29")
    datamodule, task = build(cfg)
    datamodule.setup("fit")
    task.eval()
    dataset = datamodule.dataset("val")
    sample = task.validation_sample
    chosen = sample.rows(len(dataset)).tolist()

    def oracle(rows):  # a FullRanking without a sample, fed those users' rows in one batch
        plain = FullRanking(ks=cfg.evaluation.ks, metrics=cfg.evaluation.metrics, full_mrr=True)
        _rank(plain, task, [dataset.collate(rows)])
        return {k.split("/", 1)[1]: float(v) for k, v in plain.compute_and_reset("val").items()}

    want_sample, want_all = oracle(chosen), oracle(list(range(len(dataset))))
    for epoch in (1, 2):
        shard = _EvalShard(dataset, 1, 0, sample)
        shard.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=shard, collate_fn=dataset.collate)
        _rank(task.evaluation, task, loader)
        got = {k: float(v) for k, v in task.evaluation.compute_and_reset("val").items()}
        assert {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith("val_sample/")
                and k.split("/")[1] in want_sample} == pytest.approx(want_sample, abs=1e-6)
        assert got["val_sample/users"] == 37 and got["val_sample/of_users"] == len(dataset)
        if epoch == 1:  # partial: no figure under the whole split's names
            assert not [k for k in got if k.startswith("val/")]
        else:
            assert {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith("val/")
                    and k.split("/")[1] in want_all} == pytest.approx(want_all, abs=1e-6)
            assert got["val/users"] == len(dataset) and got["val/epoch"] == 2


def test_a_full_only_monitor_needs_full_evaluations():
    with pytest.raises(UserInputError, match=r"^evaluation.monitor=val/ndcg@10 .* monitor val_sample/ndcg@10"):
        FullRanking(metrics=("ndcg",), ks=(10,), monitor="val/ndcg@10", max_users=8, full_every_n_epochs=None)
    FullRanking(metrics=("ndcg",), ks=(10,), monitor="val_sample/ndcg@10", max_users=8)  # the opt-in
    with pytest.raises(UserInputError, match="not a metric this evaluation logs"):
        FullRanking(metrics=("ndcg",), ks=(10,), monitor="val_sample/ndcg@10")  # no sample, no such name


# ------------------------------------------------------------------ a fit
def _logged(run_dir: Path) -> dict[int, set[str]]:
    by_epoch: dict[int, set[str]] = {}
    with open(run_dir / "csv" / "metrics.csv") as handle:
        for row in csv.DictReader(handle):
            names = {k for k, v in row.items() if v and k.startswith("val") and "per_s" not in k}
            by_epoch.setdefault(int(row["epoch"]), set()).update(names)
    return by_epoch


def _val_series(run_dir: Path, name: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return {int(r["epoch"]): float(r[name]) for r in csv.DictReader(handle) if r.get(name)}


@pytest.mark.slow
def test_a_fit_validates_the_sample_every_epoch_and_everyone_every_second(make_cfg, caplog):
    caplog.set_level(logging.INFO)
    cfg = make_cfg(*SMALL, "evaluation.max_users=50", "evaluation.full_every_n_epochs=2",
                   "trainer.max_epochs=4", "callbacks.early_stopping.patience=100")
    metrics = train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    logged = _logged(run_dir)
    for epoch in range(4):
        assert "val_sample/ndcg@10" in logged[epoch] and "val_sample/users" in logged[epoch]
        assert ("val/ndcg@10" in logged[epoch]) == (epoch % 2 == 0), (epoch, logged[epoch])
    # the best checkpoint is the better of the two full evaluations, never a partial epoch
    full = _val_series(run_dir, "val/ndcg@10")
    assert sorted(full) == [0, 2]
    best = max(full, key=full.get)
    assert Path(metrics["test_checkpoint"]).name == f"epoch_{best:03d}.ckpt"
    assert {p.name for p in (run_dir / "checkpoints").glob("epoch_*")} <= {"epoch_000.ckpt", "epoch_002.ckpt"}
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["val_sample/users"] == 50 and saved["val/users"] == saved["val_sample/of_users"] == 300
    assert saved["val/epoch"] == 2 and saved["val/ndcg@10"] == pytest.approx(full[2])
    assert saved["val/ndcg@10_best"] == pytest.approx(full[best])
    assert saved["val_sample/ndcg@10"] == pytest.approx(_val_series(run_dir, "val_sample/ndcg@10")[3])
    assert saved["test/users"] == 300  # the test split is always whole
    assert "checkpointing and early stopping follow val/ndcg@10 on full evaluations only" in caplog.text


@pytest.mark.slow
def test_patience_counts_full_evaluations_only(make_cfg):
    # no epoch can improve by 1 (NDCG <= 1): the check after epoch 0 sets the best, the next
    # check stops. Counting the partial epoch 1 (Lightning's stale value) would stop after it.
    cfg = make_cfg(*SMALL, "evaluation.max_users=50", "evaluation.full_every_n_epochs=2",
                   "trainer.max_epochs=6", "callbacks.early_stopping.patience=1",
                   "callbacks.early_stopping.min_delta=1.0")
    assert train(cfg)["epochs"] == 3


@pytest.mark.slow
def test_monitoring_the_sample_is_an_opt_in_that_says_so(make_cfg, caplog):
    caplog.set_level(logging.INFO)
    cfg = make_cfg(*SMALL, "evaluation.max_users=50", "evaluation.full_every_n_epochs=2",
                   "evaluation.monitor=val_sample/ndcg@10", "trainer.max_epochs=2")
    metrics = train(cfg)
    assert "follow val_sample/ndcg@10, a figure over the sample, not the whole validation split" in caplog.text
    sample = _val_series(Path(cfg.paths.output_dir), "val_sample/ndcg@10")
    assert metrics["val_sample/ndcg@10_best"] == pytest.approx(max(sample.values()))


def test_data_that_cannot_sample_users_refuses_max_users_in_one_line(make_cfg):
    cfg = make_cfg("+evaluation.max_users=10", "+evaluation.full_every_n_epochs=2",
                   "data.generator.n_items=50", "data.generator.n_sessions=200")
    with pytest.raises(UserInputError, match=r"^evaluation.max_users=10: SyntheticSessionDataModule cannot validate on a sample"):
        train(cfg)


def test_evaluation_shards_rank_longest_histories_first_and_keep_the_sample_first(tmp_path):
    # the encoders pad a batch to its longest row: like lengths together skip the padding
    histories = generate_histories(SyntheticHistoriesConfig(n_users=41, n_items=30, min_length=4, max_length=30))
    write_prepared(tmp_path / "p", histories, dataset="test", inputs=[], params={})
    dataset = HistoryDataModule(prepared_dir=str(tmp_path / "p"), max_seq_len=12).dataset("val")
    by_hand = [min(int(t - s), 12) for s, t in zip(dataset.rows.starts, dataset.rows.targets)]
    assert len(set(by_hand)) > 3
    for world in (1, 2):
        for rank in range(world):
            plain = list(_EvalShard(dataset, world, rank))
            assert sorted(plain) == list(range(rank, len(dataset), world))
            assert [by_hand[r] for r in plain] == sorted((by_hand[r] for r in plain), reverse=True)
            sample = ValidationSample(max_users=9, full_every_n_epochs=2, seed=3)
            shard = _EvalShard(dataset, world, rank, sample)
            shard.set_epoch(0)
            rows = list(shard)
            sampled = sample.current.rank_sample_rows
            assert set(rows[:sampled]) == set(sample.rows(len(dataset))[rank::world].tolist())
            for part in (rows[:sampled], rows[sampled:]):
                assert [by_hand[r] for r in part] == sorted((by_hand[r] for r in part), reverse=True)


@pytest.mark.slow
def test_ddp_ranks_share_the_sample_and_report_its_figure(make_cfg, tmp_path, data_dir):
    """``hardware=ddp_cpu`` as a user runs it: the two ranks rank disjoint halves of the sample, and
    the reduced partial figure of epoch 1 equals a single process ranking the same users with that
    epoch's weights (monitoring the sample, every epoch's checkpoint kept)."""
    import os
    import sys

    from conftest import CHEAP, REPO_ROOT

    sizes = [*SMALL, "data=synthetic_histories", "evaluation.max_users=50", "evaluation.full_every_n_epochs=2",
             "model.dropout_rate=0", "model.ffn_dropout_rate=0"]
    log_dir = tmp_path / "ddp"
    cmd = [sys.executable, "src/train.py", "hardware=ddp_cpu", *sizes, *CHEAP, "trainer.max_epochs=2",
           "evaluation.monitor=val_sample/ndcg@10", "callbacks.model_checkpoint.save_top_k=-1",
           f"paths.log_dir={log_dir}", f"paths.data_dir={data_dir}"]
    done = run_child(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["val_sample/users"] == 50 and saved["val/users"] == saved["val_sample/of_users"] == 300
    assert sorted(_val_series(run_dir, "val/ndcg@10")) == [0]  # epoch 1 was partial
    # epoch 1's weights on the same 50 users, one process, by hand
    cfg = make_cfg(*sizes, run="single")
    datamodule, task = build(cfg)
    datamodule.setup("fit")
    state = torch.load(run_dir / "checkpoints" / "epoch_001.ckpt", weights_only=False)["state_dict"]
    task.load_state_dict(state)
    task.eval()
    dataset = datamodule.dataset("val")
    plain = FullRanking(ks=cfg.evaluation.ks, metrics=cfg.evaluation.metrics, full_mrr=True)
    _rank(plain, task, [dataset.collate(task.validation_sample.rows(len(dataset)).tolist())])
    want = {k.split("/", 1)[1]: float(v) for k, v in plain.compute_and_reset("val").items()}
    last = {name: _val_series(run_dir, f"val_sample/{name}")[1] for name in want}
    assert last == pytest.approx(want, abs=1e-5)


def test_each_evaluation_pass_ranks_against_the_weights_of_its_time(make_cfg):
    # the catalogue's vectors are computed once per pass: a pass after an update must see the update
    cfg = make_cfg(*SMALL)
    datamodule, task = build(cfg)
    datamodule.setup("fit")
    task.eval()
    batches = list(datamodule.val_dataloader())
    figures = []
    for shift in (0.0, 0.5):
        with torch.no_grad():
            task.model.item_table.add_(shift * torch.randn_like(task.model.item_table))
        plain = FullRanking(ks=cfg.evaluation.ks, metrics=cfg.evaluation.metrics, full_mrr=True)
        _rank(plain, task, batches)
        task.on_validation_epoch_start()
        with torch.no_grad():
            for i, batch in enumerate(batches):
                task.validation_step(batch, i)
        got = task.evaluation.compute_and_reset("val")
        want = plain.compute_and_reset("val")
        assert {k: float(v) for k, v in got.items()} == pytest.approx({k: float(v) for k, v in want.items()})
        figures.append(float(got["val/mrr"]))
    assert figures[0] != figures[1]

"""benchmarks/train_throughput.py runs any family's experiment at both levels and reports one way."""
from __future__ import annotations

import json
import math

import pytest
from conftest import REPO_ROOT, benchmark_module, run_command

TINY = "--steps 2 --windows 1 --warmup 1 --lead 1 --eval-batches 1 --threads 1"
FAMILIES = {
    "events": "--experiment gru4rec_synthetic_bprmax --override data.generator.n_items=100 "
    "--override data.generator.n_sessions=1000 --override task.sample_store_size=10000",
    "sequences": "--experiment sasrec_ml-1m --override data=synthetic_histories "
    "--override data.generator.n_users=300 --override data.generator.n_items=300",
    "samples": "--experiment dlrm_criteo_kaggle --override data=synthetic_criteo --override data.generator.n_rows=4000",
}


@pytest.fixture(scope="module")
def harness():
    with benchmark_module("train_throughput") as module:
        yield module


@pytest.mark.slow
@pytest.mark.parametrize("unit", list(FAMILIES))
def test_every_family_reports_a_positive_rate_in_its_unit_at_both_levels(unit, tmp_path):
    done = run_command(
        f"python benchmarks/train_throughput.py {FAMILIES[unit]} {TINY} --data-dir {tmp_path}", cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["unit"] == unit and report["threads"] == 1
    assert f"train {unit}/s min" in done.stdout  # the table states the unit
    assert set(report["levels"]) == {"lightning", "bare"}
    for level, stats in report["levels"].items():
        for key in (f"train_{unit}_per_s", "train_updates_per_s", f"eval_{unit}_per_s"):
            for stat in ("min", "median"):
                value = stats[key][stat]
                assert math.isfinite(value) and value > 0, (level, key, stat, value)
        # one window of 2 timed updates: the rows per update are the batch's
        rows_per_update = stats[f"train_{unit}_per_s"]["median"] / stats["train_updates_per_s"]["median"]
        assert 0 < rows_per_update <= report["config"]["data"]["batch_size"] * 1.01
    assert report["config"]["data"]["_target_"]  # the config used travels with the figures


def test_evaluation_only_runs_no_update_and_reports_no_training_rate(harness, tmp_path, monkeypatch):
    # scale.py's eval column takes its peak memory from such a run: one update would add the
    # gradients and the optimizer's state to it
    args = harness.parse_args(["--experiment", "dlrm_criteo_kaggle", "--override", "data=synthetic_criteo",
                               "--override", "data.generator.n_rows=2000", "--no-train", "--windows", "2",
                               "--eval-batches", "1", "--threads", "1", "--level", "bare", "--data-dir", str(tmp_path)])
    cfg, _, _ = harness.compose_config(args, tmp_path)
    monkeypatch.setattr(harness.Level, "train_window", lambda *a: pytest.fail("an update ran under --no-train"))
    result = harness.measure(args, cfg, log=lambda message: None)
    stats = result["levels"]["bare"]
    assert set(stats) == {"eval_samples_per_s", "eval_batches_per_s"}
    assert stats["eval_samples_per_s"]["min"] > 0
    assert result["state_bytes"]["optimizer_state"] in (None, 0) and result["sampler_store"] is None


def test_evaluation_only_without_evaluation_is_refused(harness, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(["--experiment", "sasrec_ml-1m", "--no-train", "--no-eval"])
    assert "--no-train with --no-eval measures nothing" in capsys.readouterr().err


def _composed(harness, tmp_path, *argv):
    args = harness.parse_args(["--experiment", *argv])
    return harness.compose_config(args, tmp_path)


def test_a_preset_without_data_runs_on_its_stand_in(harness, tmp_path):
    cfg, overrides, data = _composed(harness, tmp_path, "dlrm_criteo_kaggle")
    assert data == "synthetic_criteo"
    assert list(cfg.data.generator.cardinalities) == harness.KAGGLE_CARDINALITIES
    cfg, overrides, data = _composed(harness, tmp_path, "sasrec_ml-1m")
    assert data == "ml-1m" and cfg.data.ratings_path.endswith("ml-1m/ratings.partial.dat.gz")
    assert cfg.data.protocol == "reference"


def test_data_named_on_the_command_line_replaces_the_stand_in(harness, tmp_path):
    cfg, overrides, data = _composed(harness, tmp_path, "dlrm_criteo_kaggle", "--override", "data=synthetic_criteo")
    assert data == "synthetic_criteo" and "cardinalities" not in cfg.data.generator
    cfg, _, _ = _composed(harness, tmp_path, "gru4rec_rsc15_xe", "--override", "data.train_path=a.txt",
                          "--override", "data.test_path=b.txt", "--batch-size", "64")
    assert (cfg.data.train_path, cfg.data.batch_size) == ("a.txt", 64)


def test_clock_counts_rows_and_updates_from_the_lead_on(harness):
    class Batch:
        def __init__(self, size, n_steps=1):
            self.size, self.n_steps = size, n_steps

    syncs = []
    clock = harness.WindowClock(2, lambda: syncs.append(1))
    for index, batch in enumerate([Batch(5), Batch(6), Batch(7, 2), Batch(8, 3)]):
        clock.batch_start(index)
        clock.batch_end(batch, index, last=index == 3)
    rows, updates, seconds = clock.result()
    assert (rows, updates, len(syncs)) == (15, 5, 2) and seconds > 0
    assert harness.WindowClock(1, lambda: None).result() == (0, 0, 0.0)  # never started

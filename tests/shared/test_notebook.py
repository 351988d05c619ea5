"""notebooks/1.0-sweep-analysis.ipynb and the helpers it uses (recforge.analysis).

The unit tests read a hand-made sweep directory; the slow tests run the README's grid sweep as a
user types it (tiny data from the checkout's conf/local) and execute the notebook on it with nbclient.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from processes import run_child
import yaml

from conftest import readme_commands, tiny_profile
from recforge.analysis import (
    hyperparameter_columns,
    latest_sweep,
    load_epoch_logs,
    load_step_logs,
    load_sweep,
    metric_columns,
    optimized_metric,
)

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "1.0-sweep-analysis.ipynb"

# --------------------------------------------------------------------------- a hand-made sweep

# Lightning's CSVLogger layout: per-step loss rows, then per epoch one row of validation metrics
# and one of training epoch metrics (same epoch and step), and a final test row.
METRICS_CSV = {
    "0": """epoch,step,test/recall@20,train/loss_epoch,train/loss_step,val/mrr@20,val/recall@20
0,4,,,3.5,,
0,9,,,,0.25,0.5
0,9,,3.25,,,
1,14,,,3.0,,
1,19,,,,0.375,0.625
1,19,,2.75,,,
2,20,0.5,,,,
""",
    "1": """epoch,step,test/recall@20,train/loss_epoch,train/loss_step,val/mrr@20,val/recall@20
0,9,,,,0.125,0.25
0,9,,3.5,,,
1,19,,,,0.5,0.75
1,19,,3.0,,,
2,20,0.625,,,,
""",
}
JOBS = {
    "0": {"hidden": 16, "metrics": {"val/mrr@20": 0.375, "test/recall@20": 0.5, "epochs": 2}},
    "1": {"hidden": 32, "metrics": {"val/mrr@20": 0.5, "test/recall@20": 0.625, "epochs": 2}},
}


def _write_job(sweep: Path, name: str, overrides: list[str], metrics: dict | None, csv: str | None,
               config: dict | None = None):
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = {"optimized_metric": "val/mrr@20"} if config is None else config
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics, sort_keys=True))  # as write_metrics
    if csv is not None:
        (job / "csv").mkdir()
        (job / "csv" / "metrics.csv").write_text(csv)
    return job


@pytest.fixture
def fake_sweep(tmp_path: Path) -> Path:
    """``<tmp>/logs/train/multiruns/2024-01-02_00-00-00`` with jobs 0 and 1 (model.hidden_size=16,32)."""
    sweep = tmp_path / "logs" / "train" / "multiruns" / "2024-01-02_00-00-00"
    for name, job in JOBS.items():
        overrides = [f"model.hidden_size={job['hidden']}", "trainer.max_epochs=2", "trainer.limit_train_batches=30"]
        _write_job(sweep, name, overrides, job["metrics"], METRICS_CSV[name])
    (sweep / "multirun.yaml").write_text("{}\n")
    return sweep


def test_latest_sweep_is_newest_by_name(fake_sweep: Path, tmp_path: Path):
    log_dir = tmp_path / "logs"
    older = log_dir / "train" / "multiruns" / "2024-01-01_00-00-00"
    older.mkdir()
    (older / "sweep_analysis_metrics.png").write_bytes(b"")  # touched last: newer mtime, older name
    assert latest_sweep(log_dir) == fake_sweep
    assert latest_sweep(str(log_dir), task_name="train") == fake_sweep


def test_latest_sweep_names_the_missing_path(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "logs" / "eval" / "multiruns"))):
        latest_sweep(tmp_path / "logs", task_name="eval")


def test_load_sweep_rebuilds_a_missing_summary(fake_sweep: Path):
    assert not (fake_sweep / "summary.csv").exists()
    summary = load_sweep(fake_sweep)
    assert (fake_sweep / "summary.csv").exists()
    assert list(summary.columns) == [
        "job", "model.hidden_size", "trainer.max_epochs", "trainer.limit_train_batches",
        "epochs", "test/recall@20", "val/mrr@20", "status",
    ]
    assert summary["job"].tolist() == [0, 1]
    assert summary["model.hidden_size"].tolist() == [16, 32]
    assert summary["trainer.limit_train_batches"].tolist() == [30, 30]
    assert summary["val/mrr@20"].tolist() == [0.375, 0.5]
    assert summary["test/recall@20"].tolist() == [0.5, 0.625]
    assert summary["status"].tolist() == ["ok", "ok"]


def test_load_sweep_reads_an_existing_summary(fake_sweep: Path):
    (fake_sweep / "summary.csv").write_text("job,model.hidden_size,val/mrr@20,status\n0,8,0.125,ok\n")
    summary = load_sweep(fake_sweep)
    assert summary.to_dict("records") == [
        {"job": 0, "model.hidden_size": 8, "val/mrr@20": 0.125, "status": "ok"}
    ]
    assert len(load_sweep(fake_sweep, rebuild=True)) == 2


def test_load_sweep_keeps_failed_and_unfinished_jobs(fake_sweep: Path):
    failed = _write_job(fake_sweep, "2", ["model.hidden_size=64"], metrics=None, csv=None)
    (failed / ".hydra" / "failure.txt").write_text("recforge: sweep job 2: model.hidden_size=64: too wide\n")
    _write_job(fake_sweep, "3", ["model.hidden_size=128"], metrics=None, csv=None)  # running, or killed
    summary = load_sweep(fake_sweep)
    assert summary["job"].tolist() == [0, 1, 2, 3]
    assert summary["status"].tolist() == ["ok", "ok", "failed", "unfinished"]
    assert summary["val/mrr@20"].isna().tolist() == [False, False, True, True]
    assert summary["error"].fillna("").tolist() == ["", "", "recforge: sweep job 2: model.hidden_size=64: too wide", ""]
    assert "error" not in hyperparameter_columns(summary) and "status" not in hyperparameter_columns(summary)


@pytest.mark.parametrize("loader", [load_sweep, load_epoch_logs])
def test_loaders_name_a_sweep_without_jobs(tmp_path: Path, loader):
    empty = tmp_path / "2024-01-01_00-00-00"
    (empty / "not-a-job").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no jobs in sweep directory {empty}")):
        loader(empty)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing"))):
        loader(tmp_path / "missing")


def test_hyperparameter_columns(fake_sweep: Path):
    summary = load_sweep(fake_sweep)
    assert hyperparameter_columns(summary) == ["model.hidden_size"]
    assert hyperparameter_columns(summary, varying_only=False) == [
        "model.hidden_size", "trainer.max_epochs", "trainer.limit_train_batches",
    ]
    # Metric columns never count as hyper-parameters, whatever their values.
    real = pd.DataFrame({
        "job": [0, 1], "loss": ["xe", "bprmax"], "optimizer.lr": [0.1, 0.05], "epochs": [2, 3],
        "wall_time_s": [1.0, 2.0], "test_checkpoint": ["a", "b"], "train/loss": [1.0, 2.0],
        "val/mrr@20_best": [0.1, 0.2], "status": ["ok", "failed"],
    })
    assert hyperparameter_columns(real) == ["loss", "optimizer.lr"]


def test_load_epoch_logs(fake_sweep: Path):
    logs = load_epoch_logs(fake_sweep)
    expected = pd.DataFrame({
        "job": [0, 0, 1, 1],
        "model.hidden_size": [16, 16, 32, 32],
        "trainer.max_epochs": [2, 2, 2, 2],
        "trainer.limit_train_batches": [30, 30, 30, 30],
        "epoch": [0, 1, 0, 1],
        "step": [9, 19, 9, 19],
        "train/loss_epoch": [3.25, 2.75, 3.5, 3.0],
        "val/mrr@20": [0.25, 0.375, 0.125, 0.5],
        "val/recall@20": [0.5, 0.625, 0.25, 0.75],
    })
    pd.testing.assert_frame_equal(logs, expected, check_dtype=False)
    assert logs["model.hidden_size"].dtype.kind == "i"


def test_load_epoch_logs_skips_jobs_without_a_csv_log(fake_sweep: Path, tmp_path: Path):
    _write_job(fake_sweep, "2", ["model.hidden_size=64"], metrics=None, csv=None)
    assert load_epoch_logs(fake_sweep)["job"].unique().tolist() == [0, 1]

    no_csv = tmp_path / "no_csv"
    _write_job(no_csv, "0", ["model.hidden_size=8"], metrics={"val/mrr@20": 0.5}, csv=None)
    with pytest.raises(FileNotFoundError, match=re.escape(str(no_csv)) + ".*csv/metrics.csv"):
        load_epoch_logs(no_csv)


def test_optimized_metric_and_metric_columns(fake_sweep: Path):
    summary = load_sweep(fake_sweep)
    assert optimized_metric(fake_sweep) == "val/mrr@20"
    assert metric_columns(summary, ["val/mrr@20"]) == ["val/mrr@20", "test/recall@20"]
    assert metric_columns(summary, ["test/recall@20", None]) == ["test/recall@20", "val/mrr@20"]
    assert metric_columns(summary, ["nope"], defaults=()) == []


def test_optimized_metric_is_resolved_as_the_job_resolved_it(tmp_path: Path):
    # conf/train.yaml says optimized_metric: ${evaluation.monitor}; Hydra saves it unresolved
    sweep = tmp_path / "sweep"
    config = {"optimized_metric": "${evaluation.monitor}", "evaluation": {"monitor": "val/ndcg@10"},
              "callbacks": {"mode": "${recforge_metric_mode:${optimized_metric}}"}}
    _write_job(sweep, "0", ["model=hstu"], {"val/ndcg@10": 0.5}, None, config=config)
    assert optimized_metric(sweep) == "val/ndcg@10"
    # an interpolation the saved config cannot resolve (a key it lacks) comes back as written
    other = tmp_path / "other"
    _write_job(other, "0", ["model=hstu"], None, None, config={"optimized_metric": "${evaluation.monitor}"})
    assert optimized_metric(other) == "${evaluation.monitor}"


def test_each_family_gets_its_own_metrics_by_default():
    sequential = pd.DataFrame({"job": [0], "val/hr@10": [0.5], "val/ndcg@10": [0.25], "val/mrr": [0.125],
                               "test/hr@10": [0.5], "test/ndcg@10": [0.25], "test/hr@1": [0.1]})
    assert metric_columns(sequential, ["val/ndcg@10"]) == [
        "val/ndcg@10", "val/hr@10", "val/mrr", "test/hr@10", "test/ndcg@10",
    ]
    ctr = pd.DataFrame({"job": [0], "val/auc": [0.7], "val/logloss": [0.5], "test/auc": [0.7],
                        "test/logloss": [0.5], "test/accuracy": [0.75]})
    assert metric_columns(ctr, [None]) == ["val/auc", "val/logloss", "test/auc", "test/logloss"]


def test_load_step_logs(fake_sweep: Path, tmp_path: Path):
    logs = load_step_logs(fake_sweep)  # job 1 logged no per-step loss
    expected = pd.DataFrame({
        "job": [0, 0], "model.hidden_size": [16, 16], "trainer.max_epochs": [2, 2],
        "trainer.limit_train_batches": [30, 30], "epoch": [0, 1], "step": [4, 14],
        "train/loss_step": [3.5, 3.0],
    })
    pd.testing.assert_frame_equal(logs, expected, check_dtype=False)
    none = tmp_path / "none"
    _write_job(none, "0", ["model.hidden_size=8"], None, METRICS_CSV["1"])
    with pytest.raises(FileNotFoundError, match=re.escape(str(none)) + ".*step-level"):
        load_step_logs(none)


def test_one_epoch_curves_get_a_readable_axis(fake_sweep: Path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from recforge.analysis import plot_learning_curves

    one_epoch = load_epoch_logs(fake_sweep).query("epoch == 0")
    fig = plot_learning_curves(one_epoch, ["val/mrr@20"])
    assert fig.axes[0].get_xlim() == (-0.5, 0.5)  # matplotlib alone: (-0.055, 0.055)
    steps = plot_learning_curves(load_step_logs(fake_sweep), ["train/loss_step"], x="step")
    assert steps.axes[0].get_xlabel() == "step"
    assert steps.axes[0].lines[0].get_xdata().tolist() == [4, 14]
    plt.close("all")


def test_plots_save_pngs(fake_sweep: Path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from recforge.analysis import plot_learning_curves, plot_metrics_vs_hparams, save_figure

    summary = load_sweep(fake_sweep)
    fig = plot_metrics_vs_hparams(summary, ["val/mrr@20", "test/recall@20"], ["model.hidden_size"])
    assert len(fig.axes) == 2
    path = save_figure(fig, fake_sweep, "metrics")
    curves = plot_learning_curves(load_epoch_logs(fake_sweep), ["val/mrr@20", "train/loss_epoch"], ["model.hidden_size"])
    assert [len(ax.lines) for ax in curves.axes] == [2, 2]
    assert curves.axes[0].get_legend_handles_labels()[1] == [
        "job 0: model.hidden_size=16", "job 1: model.hidden_size=32",
    ]
    save_figure(curves, fake_sweep, "learning_curves")
    plt.close("all")
    assert path == fake_sweep / "sweep_analysis_metrics.png"
    assert sorted(p.name for p in fake_sweep.glob("sweep_analysis_*.png")) == [
        "sweep_analysis_learning_curves.png", "sweep_analysis_metrics.png",
    ]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_notebook_is_stored_clean():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    parameters = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(parameters) == 1 and "RECFORGE_SWEEP_DIR" in parameters[0].source


# --------------------------------------------------------------------------- a real tiny sweep

# The README's grid sweep, run as a user types it (tests/shared/test_sweeps.py runs it too: one run serves both).
README_GRID = "python src/train.py -m model=gru4rec loss=xe,bprmax model.hidden_size=64,128"


@pytest.fixture(scope="module")
def tiny_sweep(user_sweep) -> Path:
    """The README grid sweep on tiny synthetic data (CPU, 2 epochs each); its sweep directory."""
    assert README_GRID in readme_commands(), "the README no longer shows this sweep"
    checkout, proc = user_sweep(README_GRID)
    assert proc.returncode == 0, f"multirun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return latest_sweep(checkout / "outputs")


@pytest.mark.slow
def test_tiny_sweep_summary(tiny_sweep: Path):
    summary = pd.read_csv(tiny_sweep / "summary.csv")
    assert summary["job"].tolist() == [0, 1, 2, 3]
    assert summary[["loss", "model.hidden_size"]].values.tolist() == [
        ["xe", 64], ["xe", 128], ["bprmax", 64], ["bprmax", 128]
    ]
    assert summary["status"].tolist() == ["ok"] * 4
    for metric in ("val/recall@20", "val/mrr@20", "test/recall@20", "test/mrr@20", "epochs"):
        assert metric in summary.columns and summary[metric].notna().all(), metric
    # model=gru4rec is the same in every job: not a hyper-parameter of this sweep
    assert hyperparameter_columns(load_sweep(tiny_sweep)) == ["loss", "model.hidden_size"]
    logs = load_epoch_logs(tiny_sweep)
    assert logs[["job", "epoch"]].values.tolist() == [[j, e] for j in range(4) for e in range(2)]
    assert logs[["val/mrr@20", "train/loss_epoch"]].notna().all().all()


@pytest.fixture
def python3_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``python3`` kernelspec for this interpreter, in tmp_path (JUPYTER_PATH wins over the rest)."""
    pytest.importorskip("ipykernel")
    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager

    prefix = tmp_path / "jupyter-prefix"
    install(kernel_name="python3", prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable
    return "python3"


@pytest.mark.slow
def test_notebook_runs_on_the_tiny_sweep(tiny_sweep: Path, python3_kernel: str, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("RECFORGE_SWEEP_DIR", str(tiny_sweep))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # headless, no display needed

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=python3_kernel, timeout=180, startup_timeout=120,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"sweep: {tiny_sweep.resolve()}" in text
    pngs = sorted(p.name for p in tiny_sweep.glob("sweep_analysis_*.png"))
    assert pngs == ["sweep_analysis_learning_curves.png", "sweep_analysis_metrics.png",
                    "sweep_analysis_training_loss.png"]
    assert all((tiny_sweep / p).stat().st_size > 1000 for p in pngs)


# --------------------------------------------------------------------------- every family's sweep
# The README's no-download sweep of each other family, run as typed (tests/shared/test_sweeps.py
# runs the same commands with the same profile: one run serves both), then the notebook through
# the README's own command for it.
FAMILY_SWEEPS = {
    "sequential retrieval": ("python src/train.py -m model=hstu,sasrec ", ["model"],
                             ["val/ndcg@10", "val/hr@10", "val/mrr", "test/hr@10", "test/ndcg@10", "test/mrr"]),
    "click-through rate": ("python src/train.py -m model=dlrm ", ["model.embedding_dim"],
                           ["val/auc", "val/logloss", "test/auc", "test/logloss"]),
}
README_NOTEBOOK = "jupyter execute notebooks/1.0-sweep-analysis.ipynb"


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_SWEEPS))
def test_notebook_plots_each_familys_own_metrics(family: str, user_sweep, python3_kernel: str):

    prefix, swept, expected = FAMILY_SWEEPS[family]
    commands = [c for c in readme_commands() if c.startswith(prefix) and "..." not in c]
    assert commands, f"the README no longer shows a {family} sweep starting {prefix!r}"
    checkout, proc = user_sweep(commands[0], tiny_profile(commands[0]))
    assert proc.returncode == 0, f"{commands[0]} failed:\n{proc.stderr[-4000:]}"
    sweep = latest_sweep(checkout / "outputs")

    summary = load_sweep(sweep)
    assert summary["status"].tolist() == ["ok", "ok"]
    assert hyperparameter_columns(summary) == swept
    target = optimized_metric(sweep)
    assert target == expected[0]
    assert metric_columns(summary, [target]) == expected
    assert summary[expected].notna().all().all()

    assert README_NOTEBOOK in (REPO / "README.md").read_text()
    jupyter = Path(sys.executable).with_name("jupyter")
    env = {**os.environ, "RECFORGE_SWEEP_DIR": str(sweep), "MPLBACKEND": "Agg"}
    done = run_child([str(jupyter), *README_NOTEBOOK.split()[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    pngs = sorted(p.name for p in sweep.glob("sweep_analysis_*.png"))
    assert pngs == ["sweep_analysis_learning_curves.png", "sweep_analysis_metrics.png",
                    "sweep_analysis_training_loss.png"]
    assert all((sweep / p).stat().st_size > 1000 for p in pngs)

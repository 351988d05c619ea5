"""Read a finished sweep back for analysis (used by notebooks/1.0-sweep-analysis.ipynb), and
recforge-against-reference runs (benchmarks/*_reference.py ``--json``) for the README's figures.

A sweep directory is what ``python src/train.py -m ...`` leaves in
``<log_dir>/<task_name>/multiruns/<time>/``: one sub-directory per job (``.hydra/overrides.yaml``,
``metrics.json``, ``csv/metrics.csv``) and ``summary.csv`` at the root (see :mod:`recforge.runs`).

matplotlib is only imported by the plotting helpers (the ``notebooks`` extra).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import yaml

from recforge.runs import SUMMARY_FILE, read_job_overrides, write_sweep_summary

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EPOCH_LOG = Path("csv") / "metrics.csv"
"""Where the Lightning CSVLogger of a job writes (conf/logger/csv.yaml: name=csv, version="")."""

META_COLUMNS = ("job", "status", "error")
"""Columns of summary.csv that are neither overrides nor metrics."""

EXTRA_METRICS = ("epochs", "wall_time_s", "test_checkpoint")
"""Keys of metrics.json without a ``train/``, ``val/`` or ``test/`` prefix."""

FAMILY_METRICS = {
    "session next-item (GRU4Rec)": ("recall@20", "mrr@20"),
    "sequential retrieval (HSTU, SASRec)": ("hr@10", "ndcg@10", "mrr"),
    "click-through rate (DLRM)": ("auc", "logloss"),
}
"""The figures each family's papers report, by the name its evaluation logs them under."""

DEFAULT_METRICS = tuple(
    f"{split}/{name}" for split in ("val", "test") for names in FAMILY_METRICS.values() for name in names
)
"""Plotted, when present, after the sweep's ``optimized_metric``: a sweep's jobs log only their
family's names, so each family gets its own (several, for a sweep across families)."""

TRAIN_LOSS = "train/loss_epoch"
TRAIN_LOSS_STEP = "train/loss_step"


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """The job directories of a sweep (sub-directories with a ``.hydra`` folder), in job order.

    Raises ``FileNotFoundError`` naming the path when the sweep directory is missing or holds no job.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory not found: {sweep_dir}")
    jobs = sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()),
        key=lambda p: (len(p.name), p.name),
    )
    if not jobs:
        raise FileNotFoundError(
            f"no jobs in sweep directory {sweep_dir}: expected sub-directories with a .hydra/ "
            "folder, as written by `python src/train.py -m ...`"
        )
    return jobs


def latest_sweep(log_dir: str | Path, task_name: str = "train") -> Path:
    """The newest sweep directory under ``<log_dir>/<task_name>/multiruns/``.

    Sweep directories are named by start time (``%Y-%m-%d_%H-%M-%S``), so the newest is the last
    by name; modification times are not used, since writing figures into an older sweep changes them.
    """
    root = Path(log_dir) / task_name / "multiruns"
    sweeps = sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []
    if not sweeps:
        raise FileNotFoundError(
            f"no sweep directory under {root}: run a multirun first, e.g. "
            "`python src/train.py -m model.hidden_size=32,64`"
        )
    return sweeps[-1]


def load_sweep(sweep_dir: str | Path, rebuild: bool = False) -> pd.DataFrame:
    """The sweep's ``summary.csv`` (one row per job: ``job``, override columns, metrics, ``status``).

    When the file is absent (sweep interrupted, or still running) or ``rebuild`` is set, it is
    (re)written from the job directories with :func:`recforge.runs.write_sweep_summary`.
    """
    sweep_dir = Path(sweep_dir)
    path = sweep_dir / SUMMARY_FILE
    if rebuild or not path.exists():
        job_dirs(sweep_dir)  # a clear error when there is nothing to summarise
        path = write_sweep_summary(sweep_dir)
        if path is None:  # pragma: no cover - job_dirs() raised already
            raise FileNotFoundError(f"no jobs in sweep directory {sweep_dir}")
    summary = pd.read_csv(path)
    if summary.empty:
        raise ValueError(f"{path} has no rows: the sweep directory {sweep_dir} has no jobs")
    return summary


def is_metric(column: str) -> bool:
    """Whether a summary column holds a metric (a key of metrics.json) rather than an override."""
    if column in EXTRA_METRICS:
        return True
    return "/" in column and not column.startswith("hydra/")


def hyperparameter_columns(summary: pd.DataFrame, varying_only: bool = True) -> list[str]:
    """The override columns of a sweep summary, in column order.

    With ``varying_only`` (the default) only the overrides whose value differs between jobs are
    returned: the swept hyper-parameters, not the settings shared by every job
    (``trainer.max_epochs=2``, ``paths.log_dir=...``).
    """
    columns = [c for c in summary.columns if c not in META_COLUMNS and not is_metric(c)]
    if varying_only:
        columns = [c for c in columns if summary[c].nunique(dropna=False) > 1]
    return columns


def optimized_metric(sweep_dir: str | Path) -> str | None:
    """The sweep's ``optimized_metric``, resolved as its first job resolved it, if any.

    Hydra saves ``.hydra/config.yaml`` unresolved: ``optimized_metric`` is usually
    ``${evaluation.monitor}``, which names the metric only once interpolated within that config.
    """
    for job in job_dirs(sweep_dir):
        path = job / ".hydra" / "config.yaml"
        if path.exists():
            return _resolved_key(path, "optimized_metric")
    return None


def _resolved_key(path: Path, key: str) -> str | None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import recforge.utils.resolvers  # noqa: F401  (registers the configs' own resolvers)

    raw = yaml.safe_load(path.read_text()) or {}
    try:
        value = OmegaConf.select(OmegaConf.create(raw), key, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        # A key the saved file lacks, or Hydra's runtime (${hydra:...}) outside the job: the raw
        # text still tells a reader more than nothing.
        value = raw.get(key)
    return str(value) if value else None


def metric_columns(
    frame: pd.DataFrame, preferred: Iterable[str | None] = (), defaults: Sequence[str] = DEFAULT_METRICS
) -> list[str]:
    """``preferred`` then ``defaults``, without duplicates, kept when ``frame`` has a value for them."""
    columns: list[str] = []
    for name in [*preferred, *defaults]:
        if name and name not in columns and name in frame.columns and frame[name].notna().any():
            columns.append(name)
    return columns


def _coerce(column: pd.Series) -> pd.Series:
    try:
        return pd.to_numeric(column)
    except (ValueError, TypeError):
        return column


def _job_id(name: str) -> int | str:
    return int(name) if name.isdigit() else name


def _override_items(job_dir: Path) -> dict[str, str]:
    items = {}
    for item in read_job_overrides(job_dir):
        key, _, value = item.partition("=")
        items[key.lstrip("+~")] = value
    return items


def _epoch_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per epoch: drop per-step columns and test rows, merge rows of the same epoch."""
    frame = frame.drop(columns=[c for c in frame.columns if c.endswith("_step")])
    values = [c for c in frame.columns if c not in ("epoch", "step") and not c.startswith("test/")]
    frame = frame.dropna(subset=values, how="all")[["epoch", "step", *values]]
    if frame.empty:
        return frame
    # Lightning logs the validation and the training epoch metrics as separate rows of one epoch.
    return frame.groupby("epoch", as_index=False, sort=True).agg(
        {"step": "max", **{c: "first" for c in values}}
    )


def load_epoch_logs(sweep_dir: str | Path) -> pd.DataFrame:
    """Every job's ``csv/metrics.csv`` at epoch level, concatenated.

    Columns: ``job``, the job's overrides (as in summary.csv), ``epoch``, ``step``, then the epoch
    metrics (``val/...``, ``train/loss_epoch``, ``train/events_per_s``, ...). Per-step values
    (``*_step``) and the final test row are dropped. Jobs without a CSV log are skipped.
    """
    return _load_logs(sweep_dir, _epoch_rows, "epoch")


def load_step_logs(sweep_dir: str | Path, metric: str = TRAIN_LOSS_STEP) -> pd.DataFrame:
    """Every job's per-step ``metric`` (logged every ``trainer.log_every_n_steps``), concatenated.

    Columns: ``job``, the job's overrides, ``epoch``, ``step``, ``metric``. The curve to look at
    when the jobs ran one or two epochs, where an epoch-level curve is a point or a segment.
    Jobs without a CSV log, or that never logged ``metric``, are skipped.
    """

    def rows(frame: pd.DataFrame) -> pd.DataFrame:
        if metric not in frame.columns:
            return frame.iloc[0:0][["epoch", "step"]]
        return frame.dropna(subset=[metric])[["epoch", "step", metric]]

    return _load_logs(sweep_dir, rows, "step")


def _load_logs(sweep_dir: str | Path, rows, order: str) -> pd.DataFrame:
    sweep_dir = Path(sweep_dir)
    frames = []
    override_keys: list[str] = []
    for job in job_dirs(sweep_dir):
        path = job / EPOCH_LOG
        if not path.exists():
            continue
        logged = rows(pd.read_csv(path))
        if logged.empty:
            continue
        overrides = _override_items(job)
        override_keys.extend(k for k in overrides if k not in override_keys)
        frames.append(logged.assign(job=_job_id(job.name), **overrides))
    if not frames:
        raise FileNotFoundError(
            f"no job of sweep directory {sweep_dir} has a {EPOCH_LOG.as_posix()} "
            f"with {order}-level rows (train with logger=csv)"
        )
    logs = pd.concat(frames, ignore_index=True)
    for key in override_keys:
        logs[key] = _coerce(logs[key])
    metrics = [c for c in logs.columns if c not in ("job", "epoch", "step", *override_keys)]
    logs = logs[["job", *override_keys, "epoch", "step", *metrics]]
    return logs.dropna(axis="columns", how="all").reset_index(drop=True)


def job_labels(frame: pd.DataFrame, hparams: Sequence[str]) -> dict[int | str, str]:
    """``{job: "job 0: model.hidden_size=16"}`` for legends."""
    first = frame.drop_duplicates("job")
    hparams = [h for h in hparams if h in first.columns]
    labels = {}
    for i, job in enumerate(first["job"].tolist()):  # column-wise: keeps ints as ints
        settings = ", ".join(f"{h}={first[h].iloc[i]}" for h in hparams)
        labels[job] = f"job {job}" + (f": {settings}" if settings else "")
    return labels


def _is_numeric(column: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)


def plot_metrics_vs_hparams(
    summary: pd.DataFrame, metrics: Sequence[str], hparams: Sequence[str]
) -> Figure:
    """A grid of panels, one per hyper-parameter (rows) and metric (columns): one point per job.

    Numeric hyper-parameters get a line through the mean per value (log-scaled x when the values
    span two decades or more); others are plotted as categories. Failed jobs (no metric) are left out.
    """
    import matplotlib.pyplot as plt

    if not metrics or not hparams:
        raise ValueError(f"need at least one metric and one hyper-parameter, got {metrics!r}, {hparams!r}")
    fig, axes = plt.subplots(
        len(hparams), len(metrics), figsize=(4.0 * len(metrics), 3.2 * len(hparams)), squeeze=False
    )
    for i, hparam in enumerate(hparams):
        for j, metric in enumerate(metrics):
            ax = axes[i][j]
            data = summary[[hparam, metric]].dropna()
            if _is_numeric(data[hparam]):
                ax.scatter(data[hparam], data[metric], alpha=0.7)
                mean = data.groupby(hparam)[metric].mean().sort_index()
                ax.plot(mean.index, mean.to_numpy(), marker="o")
                values = data[hparam]
                if len(values) and (values > 0).all() and values.max() / values.min() >= 100:
                    ax.set_xscale("log")
            else:
                x = data[hparam].astype(str)
                ax.scatter(x, data[metric], alpha=0.7)
            ax.set_xlabel(hparam)
            ax.set_ylabel(metric)
            ax.grid(True, alpha=0.3)
    fig.suptitle("final metrics by hyper-parameter")
    fig.tight_layout()
    return fig


def plot_learning_curves(
    epochs: pd.DataFrame, metrics: Sequence[str], hparams: Sequence[str] = (), x: str = "epoch"
) -> Figure:
    """One panel per metric, one line per job, metric against ``x``: ``epoch`` (rows from
    :func:`load_epoch_logs`) or ``step`` (from :func:`load_step_logs`)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not metrics:
        raise ValueError("need at least one metric to plot")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.5), squeeze=False)
    labels = job_labels(epochs, hparams)
    for ax, metric in zip(axes[0], metrics):
        for job, rows in epochs.groupby("job", sort=False):
            rows = rows[[x, metric]].dropna().sort_values(x)
            ax.plot(rows[x], rows[metric], marker="o" if x == "epoch" else None, label=labels[job])
        ax.set_xlabel(x)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        values = epochs[x].dropna()
        if values.nunique() == 1:  # one epoch: matplotlib would centre a +-0.05 window on it
            ax.set_xlim(values.iloc[0] - 0.5, values.iloc[0] + 0.5)
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle("learning curves" if x == "epoch" else f"per {x}")
    fig.tight_layout()
    return fig


def load_reference_runs(path: str | Path) -> pd.DataFrame:
    """Whole runs of recforge and a reference implementation, as ``benchmarks/gru4rec_reference.py
    --json`` writes them: one row per run (``config``, ``seed``, ``arm``, ``wall_s`` and the test
    metrics), with the file's settings (``threads``, ``malloc``, ``epochs``) in ``.attrs``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference runs not found: {path} (benchmarks/gru4rec_reference.py --json writes it)")
    record = yaml.safe_load(path.read_text())  # JSON is YAML
    if not isinstance(record, dict) or not record.get("runs"):
        raise ValueError(f"{path}: expected a JSON object with a non-empty 'runs' list")
    runs = pd.DataFrame(record["runs"])
    missing = {"config", "arm", "wall_s"} - set(runs.columns)
    if missing:
        raise ValueError(f"{path}: runs lack {sorted(missing)}")
    runs.attrs.update({k: v for k, v in record.items() if k != "runs"})
    return runs


def plot_against_reference(
    runs: pd.DataFrame, metrics: Sequence[str], reference_arm: str = "official",
    title: str = "whole runs against the reference",
) -> Figure:
    """Bars per config and arm: the median wall time (whiskers: fastest and slowest run, and the
    reference's median over the arm's above each bar) and the mean of each metric (whiskers: the
    seed range). The reference arm is drawn first."""
    import matplotlib.pyplot as plt
    import numpy as np

    arms = [reference_arm] + [a for a in dict.fromkeys(runs["arm"]) if a != reference_arm]
    configs = list(dict.fromkeys(runs["config"]))
    panels = ["wall_s", *metrics]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    width = 0.8 / len(arms)
    for ax, column in zip(axes[0], panels):
        for k, arm in enumerate(arms):
            x = np.arange(len(configs)) + (k - (len(arms) - 1) / 2) * width
            groups = [runs[(runs["config"] == c) & (runs["arm"] == arm)][column] for c in configs]
            centre = [g.median() if column == "wall_s" else g.mean() for g in groups]
            low = [c - g.min() for c, g in zip(centre, groups)]
            high = [g.max() - c for c, g in zip(centre, groups)]
            bars = ax.bar(x, centre, width, yerr=[low, high], capsize=3, label=arm)
            if column == "wall_s" and arm != reference_arm:
                for bar, config, own in zip(bars, configs, centre):
                    reference = runs[(runs["config"] == config) & (runs["arm"] == reference_arm)]["wall_s"].median()
                    ax.annotate(f"{reference / own:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize="small", xytext=(0, 8), textcoords="offset points")
        ax.set_xticks(np.arange(len(configs)), configs)
        ax.set_ylabel("wall seconds (median)" if column == "wall_s" else f"{column} (mean)")
        if column != "wall_s":
            values = runs[column].dropna()
            spread = max(values.max() - values.min(), 1e-3)
            ax.set_ylim(values.min() - 2 * spread, values.max() + spread)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(arms), frameon=False)
    settings = ", ".join(f"{k} {runs.attrs[k]}" for k in ("threads", "malloc", "epochs") if k in runs.attrs)
    fig.suptitle(f"{title} ({settings})" if settings else title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def save_figure(fig: Figure, sweep_dir: str | Path, name: str) -> Path:
    """Save as ``<sweep_dir>/sweep_analysis_<name>.png``; return the path."""
    path = Path(sweep_dir) / f"sweep_analysis_{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path

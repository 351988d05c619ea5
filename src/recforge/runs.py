"""What a run leaves behind: metrics.json per run, summary.csv per sweep."""
from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode

from recforge.utils.atomic import atomic_output, atomic_write_text

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
SUMMARY_FILE = "summary.csv"
FAILURE_FILE = "failure.txt"
"""In a sweep job's ``.hydra/``: the one line that says why the job failed."""


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_metrics(output_dir: str | Path, metrics: Mapping[str, Any]) -> Path:
    """One flat JSON object of the run's final metrics (``val/recall@20``, ``test/mrr@20``, ...)."""
    flat = {k: _plain(v) for k, v in sorted(metrics.items())}
    path = Path(output_dir) / METRICS_FILE
    atomic_write_text(path, json.dumps(flat, indent=2) + "\n")
    return path


def read_job_overrides(job_dir: Path) -> list[str]:
    overrides = job_dir / ".hydra" / "overrides.yaml"
    if not overrides.exists():
        return []
    return list(yaml.safe_load(overrides.read_text()) or [])


def write_sweep_summary(sweep_dir: str | Path) -> Path | None:
    """``summary.csv`` at the sweep root: one row per job, its overrides and its metrics.

    Jobs are the sub-directories with a ``.hydra`` folder. ``status`` is ``ok`` for a job that wrote
    its ``metrics.json``, ``failed`` for one whose end recorded a failure (the reason in ``error``),
    and ``unfinished`` for one still running, or stopped before its end (killed, out of memory).
    """
    sweep_dir = Path(sweep_dir)
    rows: list[dict[str, Any]] = []
    for job_dir in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").exists()),
        key=lambda p: (len(p.name), p.name),
    ):
        row: dict[str, Any] = {"job": job_dir.name}
        for item in read_job_overrides(job_dir):
            key, _, value = item.partition("=")
            row[key.lstrip("+~")] = value
        metrics_path = job_dir / METRICS_FILE
        failure_path = job_dir / ".hydra" / FAILURE_FILE
        if metrics_path.exists():
            row.update(json.loads(metrics_path.read_text()))
            row["status"] = "ok"
        elif failure_path.exists():
            row["status"] = "failed"
            row["error"] = failure_path.read_text().strip()
        else:
            row["status"] = "unfinished"
        rows.append(row)
    if not rows:
        return None
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    path = sweep_dir / SUMMARY_FILE
    with atomic_output(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _failure_line(job_return: JobReturn) -> str:
    # the exception itself: reading ``return_value`` raises it, and prints Hydra's "Error
    # executing job" line, which Hydra prints once more when the sweep raises it
    error = getattr(job_return, "_return_value", None)
    first = (str(error).strip().splitlines() or [""])[0]
    return first if first.startswith("recforge: ") else f"{type(error).__name__}: {first}".rstrip(": ")


class SweepSummary(Callback):
    """Hydra callback: summary.csv after each job of a multirun (basic, joblib, submitit, Optuna)
    and at its end.

    Hydra raises a failed job's error once its batch of jobs is done, before the multirun's end:
    the summary written as each job ends is what such a sweep leaves.
    """

    def on_job_end(self, config, job_return: JobReturn, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        saved = Path(config.hydra.runtime.output_dir) / ".hydra"  # where the summary finds a job
        if job_return.status == JobStatus.FAILED and saved.is_dir():
            atomic_write_text(saved / FAILURE_FILE, _failure_line(job_return) + "\n")
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            write_sweep_summary(sweep_dir)

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            path = write_sweep_summary(sweep_dir)
            if path is not None:
                log.info("sweep summary: %s", path)

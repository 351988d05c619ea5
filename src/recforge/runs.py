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
from hydra.experimental.callback import Callback

from recforge.utils.atomic import atomic_output, atomic_write_text

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
SUMMARY_FILE = "summary.csv"


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

    Jobs are the sub-directories holding a ``metrics.json``; a job that failed leaves a row with
    its overrides and an empty ``status`` of metrics so failures stay visible.
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
        if metrics_path.exists():
            row.update(json.loads(metrics_path.read_text()))
            row["status"] = "ok"
        else:
            row["status"] = "failed"
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


class SweepSummary(Callback):
    """Hydra callback: after a multirun (basic, joblib, submitit, Optuna), write summary.csv."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            path = write_sweep_summary(sweep_dir)
            if path is not None:
                log.info("sweep summary: %s", path)

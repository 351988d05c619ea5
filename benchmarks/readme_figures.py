#!/usr/bin/env python
"""The README's figures, drawn by recforge's own analysis code (recforge.analysis) from real runs.

* ``learning_curves.png``: validation HR@10 and NDCG@10 and the training loss, per epoch, of each
  job of a sweep. By default the script runs the sweep itself: the README's HSTU/SASRec sweep on
  the generated ml-1m-shaped histories (no download), 4 epochs, about 3 minutes on 2 cores.
* ``gru4rec_vs_official.png``: whole GRU4Rec runs (start-up, 10 epochs, full-catalogue test) of
  recforge and of the official PyTorch code on the YooChoose sample: wall time with the ratio,
  test Recall@20 and MRR@20 with the seed range. Read from what
  ``benchmarks/gru4rec_reference.py --json`` wrote (default: the committed
  ``benchmarks/results/gru4rec_reference.json``; its measurement is in benchmarks/README.md).

    python benchmarks/readme_figures.py
    python benchmarks/readme_figures.py --sweep outputs/train/multiruns/<time> --out /tmp/figures
    python benchmarks/readme_figures.py --only gru4rec    # after new gru4rec_reference.py runs: no sweep
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "notebooks" / "figures"
GRU4REC_RUNS = REPO / "benchmarks" / "results" / "gru4rec_reference.json"
SWEEP = ["-m", "model=hstu,sasrec", "trainer.max_epochs=4"]
CURVES = ("val/hr@10", "val/ndcg@10", "train/loss_epoch")
GRU4REC_METRICS = ("recall@20", "mrr@20")
FIGURE_NAMES = ("curves", "gru4rec")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", type=Path, default=None,
                   help="a finished sweep directory to plot (default: run the README's HSTU/SASRec sweep)")
    p.add_argument("--gru4rec-runs", type=Path, default=GRU4REC_RUNS,
                   help="JSON of benchmarks/gru4rec_reference.py --json (default: %(default)s)")
    p.add_argument("--out", type=Path, default=FIGURES, help="where the PNGs go (default: %(default)s)")
    p.add_argument("--only", choices=FIGURE_NAMES, default=None,
                   help="draw this figure alone (gru4rec: without running or reading a sweep)")
    args = p.parse_args(argv)
    if args.only == "gru4rec" and args.sweep is not None:
        p.error("--sweep feeds the learning curves, which --only gru4rec does not draw")
    return args


def run_sweep(sweep_dir: Path) -> Path:
    command = [sys.executable, "src/train.py", *SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    print("# " + " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the sweep failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return sweep_dir


def save(fig, path: Path) -> Path:
    # written next to its final name, then renamed: a failed run leaves the old figure whole
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    fig.savefig(partial, dpi=80, bbox_inches="tight", format="png")
    partial.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    from recforge.analysis import (
        load_epoch_logs,
        load_reference_runs,
        plot_against_reference,
        plot_learning_curves,
    )

    wanted = FIGURE_NAMES if args.only is None else (args.only,)
    runs = load_reference_runs(args.gru4rec_runs) if "gru4rec" in wanted else None  # before the sweep's minutes
    if "curves" in wanted:
        with tempfile.TemporaryDirectory(prefix="recforge-figures-") as tmp:
            sweep = args.sweep if args.sweep is not None else run_sweep(Path(tmp) / "sweep")
            epochs = load_epoch_logs(sweep)
            missing = [m for m in CURVES if m not in epochs.columns]
            if missing:
                raise SystemExit(f"{sweep}: the jobs logged no {', '.join(missing)} (a sweep of HSTU/SASRec "
                                 "with a validation split logs them)")
            hparams = [c for c in ("model",) if c in epochs.columns]
            curves = save(plot_learning_curves(epochs, CURVES, hparams), args.out / "learning_curves.png")
        print(f"learning curves: {curves}")
    if "gru4rec" in wanted:
        bars = save(plot_against_reference(
            runs, GRU4REC_METRICS, title="GRU4Rec, YooChoose sample: recforge (task.fast_step) against the official code"),
            args.out / "gru4rec_vs_official.png")
        print(f"GRU4Rec against the official code: {bars}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

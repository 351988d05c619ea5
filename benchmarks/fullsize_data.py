"""Generate full-size stand-ins of the published datasets, in their real raw formats.

    python benchmarks/fullsize_data.py {ml-20m,amzn-books,criteo-kaggle,criteo-day} --out DIR \
        [--fraction F] [--seed S]

writes into DIR the files the real download has (ml-20m: ratings.csv + movies.csv; amzn-books:
ratings_Books.csv; criteo-kaggle: train.txt; criteo-day: day_0), with the published counts at
``--fraction 1`` and F times fewer users, items and rows below it, so that the project's own
commands take DIR as they take the real data. The same seed gives the same bytes. DIR must lie
outside the repository (the files are gigabytes). Prints a summary, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from recforge.cli import run_data_command  # noqa: E402
from recforge.errors import UserInputError  # noqa: E402

SEQUENCE_DATASETS = ("ml-20m", "amzn-books")
CRITEO_DATASETS = ("criteo-kaggle", "criteo-day")


def generator(dataset: str) -> Callable[[Path, float, int], dict[str, Any]]:
    """The dataset's generator; the Criteo module is imported only when a Criteo set is asked for."""
    if dataset in CRITEO_DATASETS:
        from recforge.data.criteo.fullsize import GENERATORS
    else:
        from recforge.data.sequences.fullsize import GENERATORS
    return GENERATORS[dataset]


def check_fraction(value: float) -> float:
    if not 0 < value <= 1:  # NaN fails too
        raise UserInputError(f"--fraction {value}: expected a number in (0, 1]")
    return value


def check_out(out: Path) -> Path:
    """``out`` resolved; inside the repository it is refused (gigabytes must not land in git)."""
    resolved = out.expanduser().resolve()
    if resolved == REPO or REPO in resolved.parents:
        raise UserInputError(f"--out {out}: inside the repository {REPO}; expected a directory "
                             "outside it (the files are gigabytes), e.g. /tmp/recforge-data")
    if resolved.exists() and not resolved.is_dir():
        raise UserInputError(f"--out {out}: exists and is not a directory")
    return resolved


def describe(summary: dict[str, Any]) -> str:
    files = ", ".join(f"{name} {size / 2**20:,.1f} MiB" for name, size in summary["files"].items())
    counts = ", ".join(f"{key} {value:,}" for key, value in summary.items()
                       if key in ("rows", "users", "items", "rated_items", "positives"))
    return f"{summary['out']}: {files}; {counts}; {summary['seconds']:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/fullsize_data.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=SEQUENCE_DATASETS + CRITEO_DATASETS)
    parser.add_argument("--out", required=True, type=Path, help="directory to write (outside the repo)")
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="share of the published users, items and rows, in (0, 1] (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    args = parser.parse_args(argv)

    def run() -> dict[str, Any]:
        out = check_out(args.out)
        return generator(args.dataset)(out, check_fraction(args.fraction), args.seed)

    summary = run_data_command(run)
    print(describe(summary))
    print(json.dumps({"dataset": args.dataset, **summary}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

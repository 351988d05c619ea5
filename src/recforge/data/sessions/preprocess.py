"""Raw public session datasets -> the GRU4Rec text format (spec §1.9).

Each dataset becomes four tab-separated files (``SessionId ItemId Time``, with a header) in
``out_dir``: ``train_full.txt`` and ``test.txt`` for the final evaluation, ``train_tr.txt`` and
``train_valid.txt`` for tuning. ``done.json`` is written after all four; a directory without it
is incomplete.

Two procedures exist, as in the authors' code:

* ``rsc15``: the original GRU4Rec script. No deduplication, one filtering pass, test = sessions
  whose last event is in the final day, restricted to training items.
* ``yoochoose``, ``retailrocket``, ``diginetica``, ``coveo``, ``rees46``: the RecSys'23
  third-party-comparison scripts. Keep views, sessionise, drop consecutive duplicates, filter
  iteratively, split by session start. ``yoochoose`` numbers are not comparable with ``rsc15``.

The steps live in :mod:`recforge.data.sessions.preprocessing` (re-exported here). Command line::

    python -m recforge.data.sessions.preprocess rsc15 --raw yoochoose-clicks.dat --out data/rsc15
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd

from recforge.cli import data_command_parser, run_data_command
from recforge.data.prepared_dir import MARKER as MARKER_FILE
from recforge.data.prepared_dir import (
    StagedDir,
    as_paths,
    build_once,
    fingerprint,
    parameters,
    read_marker,
    why_not_current,
)
from recforge.data.sessions.io import ITEM_KEY, SESSION_KEY, write_session_file
from recforge.data.sessions.preprocessing import (
    coveo,
    diginetica,
    rees46,
    retailrocket,
    rsc15,
    yoochoose,
)
from recforge.data.sessions.preprocessing.raw import RawDataError
from recforge.data.sessions.preprocessing.steps import (
    drop_short_sessions,
    filter_support,
    remove_consecutive_duplicates,
    rsc15_filter,
    rsc15_split,
    rsc15_train_test_valid,
    sessionize,
    third_party_pipeline,
    time_split,
    train_test_valid,
)
from recforge.errors import UserInputError

__all__ = [
    "DATASETS",
    "MARKER_FILE",
    "OUTPUT_FILES",
    "DatasetSpec",
    "RawDataError",
    "drop_short_sessions",
    "filter_support",
    "main",
    "prepare",
    "read_marker",
    "remove_consecutive_duplicates",
    "rsc15_filter",
    "rsc15_split",
    "rsc15_train_test_valid",
    "sessionize",
    "third_party_pipeline",
    "time_split",
    "train_test_valid",
]

log = logging.getLogger(__name__)

OUTPUT_FILES = {
    "train_full": "train_full.txt",
    "test": "test.txt",
    "train_tr": "train_tr.txt",
    "train_valid": "train_valid.txt",
}
# Bump when the output for the same inputs and parameters changes, so old outputs are redone.
_VERSION = 1
_DEFAULT_CHUNKSIZE = 1_000_000


@dataclass(frozen=True)
class DatasetSpec:
    """How one dataset is prepared: its raw files, defaults (spec §1.9 table) and pipeline."""

    name: str
    raw_files: tuple[str, ...]  # their public names, in the order the pipeline wants them
    n_files: tuple[int, int]  # (min, max) number of raw files accepted
    time_unit: str  # of the output Time column: "s" or "ms"
    defaults: dict[str, Any]  # the parameters, each overridable through prepare(**overrides)
    build: Callable[[Sequence[Path], dict[str, Any], int], dict[str, pd.DataFrame]]
    alternative_raw_files: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def from_module(cls, name: str, module: ModuleType, n_files: tuple[int, int]) -> DatasetSpec:
        """The spec of a dataset module (``RAW_FILES``, ``TIME_UNIT``, ``DEFAULTS``, ``build``)."""
        return cls(
            name=name,
            raw_files=module.RAW_FILES,
            n_files=n_files,
            time_unit=module.TIME_UNIT,
            defaults=dict(module.DEFAULTS),
            build=module.build,
            alternative_raw_files=getattr(module, "ALTERNATIVE_RAW_FILES", ()),
        )


DATASETS: dict[str, DatasetSpec] = {
    "rsc15": DatasetSpec.from_module("rsc15", rsc15, (1, 1)),
    # clicks and test are both needed: the comparison script concatenates them.
    "yoochoose": DatasetSpec.from_module("yoochoose", yoochoose, (2, 2)),
    "retailrocket": DatasetSpec.from_module("retailrocket", retailrocket, (1, 1)),
    "diginetica": DatasetSpec.from_module("diginetica", diginetica, (1, 1)),
    "coveo": DatasetSpec.from_module("coveo", coveo, (1, 1)),
    # Oct + Nov by default; other months can be given, in chronological order.
    "rees46": DatasetSpec.from_module("rees46", rees46, (1, 12)),
}


def prepare(
    dataset: str,
    raw_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    chunksize: int = _DEFAULT_CHUNKSIZE,
    **overrides: Any,
) -> dict[str, Path]:
    """Preprocess one raw dataset into ``out_dir``; returns the four paths keyed by split name.

    ``raw_paths`` is the raw file, the raw files (yoochoose: clicks then test; rees46: the
    months in chronological order), or a directory holding them under their public names.
    ``overrides`` replace entries of ``DATASETS[dataset].defaults``: ``test_days``,
    ``min_item_support``, and where the dataset has them ``tsplit`` (in the data's time unit;
    None = the last event) and ``session_gap_seconds``. ``chunksize`` rows are parsed at a time.

    A previous run's outputs are reused when its ``done.json`` records the same inputs (path,
    size, mtime) and parameters, unless ``force``. Otherwise the raw files are read (a bad one
    leaves ``out_dir`` as it was), then the four files are rewritten and the marker comes last
    (:func:`recforge.data.prepared_dir.build_once`).
    """
    spec = _spec(dataset)
    params = parameters(dataset, spec.defaults, overrides)
    if chunksize < 1:
        raise UserInputError(f"chunksize must be positive, got {chunksize}")
    paths = _resolve_raw_paths(spec, raw_paths)
    out = Path(out_dir)
    identity = {
        "dataset": dataset,
        "version": _VERSION,
        "inputs": [fingerprint(p) for p in paths],
        "params": params,
    }

    def build(target: Path) -> None:
        frames = spec.build(paths, params, chunksize)
        with StagedDir(target) as staged:
            stats = {}
            for name, frame in frames.items():
                write_session_file(frame, staged.path / OUTPUT_FILES[name])
                stats[name] = _stats(frame)
                log.info("%s %s: %s", dataset, name, stats[name])
            staged.publish({
                **identity,
                "time_unit": spec.time_unit,
                "files": OUTPUT_FILES,
                "stats": stats,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            })

    def why_stale(directory: Path) -> str | None:
        return why_not_current(directory, identity, files=OUTPUT_FILES.values())

    build_once(out, build, why_stale, force=force)
    return {name: out / filename for name, filename in OUTPUT_FILES.items()}


def _spec(dataset: str) -> DatasetSpec:
    try:
        return DATASETS[dataset]
    except KeyError:
        raise UserInputError(
            f"unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}"
        ) from None


def _resolve_raw_paths(
    spec: DatasetSpec, raw_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
) -> list[Path]:
    paths = as_paths(raw_paths)
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        for names in (spec.raw_files, *spec.alternative_raw_files):
            if all((folder / n).is_file() for n in names):
                return [folder / n for n in names]
        expected = " or ".join(
            " + ".join(names) for names in (spec.raw_files, *spec.alternative_raw_files)
        )
        raise RawDataError(f"{folder}: no {spec.name} raw files there; expected {expected}")
    low, high = spec.n_files
    if not low <= len(paths) <= high:
        count = f"{low}" if low == high else f"{low} to {high}"
        raise UserInputError(
            f"{spec.name} takes {count} raw file(s) (e.g. {', '.join(spec.raw_files)}), "
            f"got {len(paths)}"
        )
    for path in paths:
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise RawDataError(f"{spec.name} raw file {path} {what}")
    return paths


def _stats(frame: pd.DataFrame) -> dict[str, int]:
    return {
        "events": int(len(frame)),
        "sessions": int(frame[SESSION_KEY].nunique()),
        "items": int(frame[ITEM_KEY].nunique()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the process exit status."""
    parser = data_command_parser(
        "recforge.data.sessions.preprocess",
        "Preprocess a raw public session dataset into the GRU4Rec text format "
        "(train_full, test, train_tr, train_valid) as spec §1.9 describes.",
        "raw file(s) in order (yoochoose: clicks then test; rees46: months in order), "
        "or a directory holding them under their public names",
        DATASETS,
    )
    parser.add_argument("--test-days", type=float, help="test period in days")
    parser.add_argument("--min-item-support", type=int, help="minimum events per item (5)")
    parser.add_argument("--tsplit", type=float, help="split time, in the data's time unit")
    parser.add_argument("--session-gap-seconds", type=float, help="inactivity gap (3600)")
    parser.add_argument("--chunksize", type=int, default=_DEFAULT_CHUNKSIZE, help="rows per chunk")
    args = parser.parse_args(argv)
    given = {
        "test_days": args.test_days,
        "min_item_support": args.min_item_support,
        "tsplit": args.tsplit,
        "session_gap_seconds": args.session_gap_seconds,
    }
    overrides = {key: value for key, value in given.items() if value is not None}
    paths = run_data_command(lambda: prepare(
        args.dataset, args.raw, args.out, force=args.force, chunksize=args.chunksize, **overrides,
    ))
    stats = (read_marker(args.out) or {}).get("stats", {})
    for name, path in paths.items():
        counts = stats.get(name, {})
        print(
            f"{name:<12} {path}  events={counts.get('events')} "
            f"sessions={counts.get('sessions')} items={counts.get('items')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

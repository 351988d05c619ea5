"""Raw Criteo files -> a prepared directory (:mod:`recforge.data.criteo.prepared`), streaming.

Passes over the input, each chunk by chunk (memory follows ``chunk_rows``, not the file):

1. ``kaggle7`` and ``days`` only: count the data lines (bytes only, no parsing);
2. ``categorical="vocab"`` only: parse every row, count each feature's values on the training
   rows (memory: plus the vocabulary) and keep the parsed rows in a temporary file beside the
   output (:mod:`.spill`: 162 bytes a row on disk, removed at the end);
3. encode the kept rows (``hash``: parse, split, transform and encode the text) and write every
   row through :class:`PreparedWriter`, which leaves nothing behind when anything fails.

``spill=False`` (``--no-spill``) keeps nothing on disk: pass 2 then parses the training rows
only to count them and pass 3 parses every row again (the output is the same bytes).
Passes 2 and 3 cut the files into runs of ``chunk_rows`` lines; with ``workers=N`` the runs are
parsed (and encoded) in N worker processes (:mod:`.workers`, :mod:`.runs`) while this process
reads the files and writes, taking the results in file order: the output is the same bytes.

Row formats and malformed lines: :mod:`.raw`; dense transform and index layouts: :mod:`.transform`;
splits: :mod:`.splits`. Command line::

    python -m recforge.data.criteo.prepare --raw train.txt --out data/criteo_kaggle \\
        --categorical hash --max-ind-range 10000000
    python -m recforge.data.criteo.prepare --raw train.txt --out data/criteo_x1 \\
        --categorical vocab --min-frequency 10 --split random_7_2_1 --seed 0
    python -m recforge.data.criteo.prepare --raw day_0.gz ... day_23.gz --out data/criteo_tb \\
        --split days --max-ind-range 40000000 --workers 2
    python -m recforge.data.criteo.prepare --split files --raw train.csv --valid valid.csv \\
        --test test.csv --out data/criteo_x4 --categorical vocab --min-frequency 10

Metadata written beside the parts (besides what :class:`PreparedWriter` writes): ``source``
(inputs with path, size, mtime_ns, layout, role; lines read), ``categorical`` (mode, settings,
index layout, per-feature distinct values / vocabulary sizes or rows used), ``split`` (kind,
settings, ``rows`` per split), ``malformed`` (count, fraction, policy, ``file:line: reason``
examples) and ``conversion`` (``rows_read``, ``elapsed_seconds``, ``chunk_rows``, ``converter``).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recforge.cli import data_command_parser, run_data_command
from recforge.data.criteo.prepared import (
    METADATA,
    SPLITS,
    PreparedDataError,
    PreparedWriter,
    read_metadata,
)
from recforge.data.criteo.raw import (
    LAYOUTS,
    Layout,
    MalformedLog,
    RawInputError,
    RunReader,
    count_data_lines,
    detect_layout,
    iter_runs,
    take_rows,
)
from recforge.data.criteo.splits import (
    SPLIT_KINDS,
    SPLIT_NAMES,
    TEST,
    TRAIN,
    VALID,
    DaysSplit,
    FilesSplit,
    Kaggle7Split,
    RandomSplit,
    SplitPlan,
)
from recforge.data.criteo.transform import (
    CATEGORICAL_MODES,
    HashEncoder,
    ValueCounter,
    VocabEncoder,
    check_max_ind_range,
    check_min_frequency,
)
from recforge.data.criteo.runs import convert_run, count_and_transform_run, count_run, share
from recforge.data.criteo.spill import RunSpill
from recforge.data.criteo.workers import OrderedPool, check_workers
from recforge.data.prepared_dir import as_paths, build_once, cache_key, fingerprint
from recforge.errors import UserInputError

__all__ = ["CONVERTER_VERSION", "DEFAULT_CHUNK_ROWS", "ensure_prepared", "main", "prepare_criteo", "prepared_key"]

log = logging.getLogger(__name__)

# Bump when the same inputs and parameters would give different prepared data, so that
# ensure_prepared's cache keys change with it.
CONVERTER_VERSION = 1
DEFAULT_CHUNK_ROWS = 100_000
DEFAULT_MAX_MALFORMED_FRACTION = 0.001
_PROGRESS_SECONDS = 30.0
_DAY_FILE = re.compile(r"^day_(\d+)(\.gz)?$")

PathArg = str | os.PathLike[str]


@dataclass(frozen=True)
class _Source:
    path: Path
    layout: Layout
    role: int | None  # the split of every row ("files"), or None: the plan decides


def _day_files(paths: list[Path]) -> list[Path]:
    """A directory of ``day_N[.gz]`` files, or such files given in any order (a shell glob
    sorts day_10 before day_2), in day order."""
    if len(paths) == 1 and paths[0].is_dir():
        found = [p for p in paths[0].iterdir() if _DAY_FILE.match(p.name)]
        if not found:
            raise RawInputError(f"{paths[0]}: no day_N or day_N.gz files in this directory")
        paths = found
    if all(_DAY_FILE.match(p.name) for p in paths):
        ordered = sorted(paths, key=lambda p: int(_DAY_FILE.match(p.name).group(1)))
        if ordered != paths:
            log.info("days: taking the day files in day order: %s", ", ".join(p.name for p in ordered))
        return ordered
    return paths


def _params(
    layout: str, categorical: str | None, max_ind_range: int | None, min_frequency: int, split: str, seed: int,
    on_malformed: str, max_malformed_fraction: float, chunk_rows: int,
) -> dict[str, Any]:
    """Checked parameters, those that do not apply left out (they key ensure_prepared's cache)."""
    if categorical is None:
        # a table size asks for hashing; otherwise the reference's per-feature contiguous ids
        categorical = "hash" if max_ind_range is not None else "vocab"
    if layout not in LAYOUTS:
        raise UserInputError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if categorical not in CATEGORICAL_MODES:
        raise UserInputError(f"categorical must be one of {', '.join(CATEGORICAL_MODES)}, got {categorical!r}")
    if split not in SPLIT_KINDS:
        raise UserInputError(f"split must be one of {', '.join(SPLIT_KINDS)}, got {split!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise UserInputError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    MalformedLog(on_malformed, max_malformed_fraction)  # checks both
    params: dict[str, Any] = {"layout": layout, "categorical": categorical, "split": split,
                              "on_malformed": on_malformed, "max_malformed_fraction": float(max_malformed_fraction)}
    if categorical == "hash":
        if min_frequency != 1:
            raise UserInputError("min_frequency applies to categorical='vocab' only")
        params["max_ind_range"] = check_max_ind_range(max_ind_range)
    else:
        if max_ind_range is not None:
            raise UserInputError("max_ind_range applies to categorical='hash' only (vocab indexes every kept value)")
        params["min_frequency"] = check_min_frequency(min_frequency)
    if split.startswith("random"):
        RandomSplit(split, seed)  # checks the seed
        params["seed"] = int(seed)
    return params


def _sources(raw: list[Path], valid: list[Path], test: list[Path], split: str, layout: str) -> list[_Source]:
    if not raw:
        raise UserInputError("no raw input given")
    if split == "files":
        if not valid and not test:
            raise UserInputError(
                "split='files' needs the valid and/or test files (the raw files are the train split)")
        roles = [(p, TRAIN) for p in raw] + [(p, VALID) for p in valid] + [(p, TEST) for p in test]
    else:
        if valid or test:
            raise UserInputError(
                f"valid/test files are for split='files'; split={split!r} cuts the raw input itself")
        if split == "days":
            raw = _day_files(raw)
        roles = [(p, None) for p in raw]
    resolved = [p.resolve() for p, _ in roles]
    if len(set(resolved)) != len(resolved):
        raise UserInputError(f"an input is given twice: {[str(p) for p, _ in roles]}")
    return [_Source(p, detect_layout(p, layout), role) for p, role in roles]


def _plan(sources: list[_Source], split: str, seed: int) -> SplitPlan:
    if split == "files":
        return FilesSplit([s.role for s in sources])
    if split.startswith("random"):
        return RandomSplit(split, seed)
    if split == "days":
        last = sources[-1]
        return DaysSplit(len(sources), count_data_lines(last.path, last.layout))
    return Kaggle7Split([count_data_lines(s.path, s.layout) for s in sources])


def _check_out_dir(out_dir: Path, sources: list[_Source]) -> None:
    """Refuse an output directory that holds the input or anything a conversion does not write:
    it is no place for prepared data, and its files would be mixed with the parts."""
    for source in sources:
        if out_dir.resolve() in source.path.resolve().parents:
            raise UserInputError(f"the output directory {out_dir} holds the input {source.path}; choose another one")
    if out_dir.is_dir():
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in (METADATA, *SPLITS))
        if foreign:
            raise UserInputError(
                f"{out_dir}: exists and is not a prepared Criteo directory; refusing to replace it "
                f"(it holds {foreign[0]!r}; remove it or choose another --out)"
            )


class _Progress:
    def __init__(self, what: str) -> None:
        self.what = what
        self.start = self.last = time.perf_counter()
        self.lines = 0

    def add(self, lines: int) -> None:
        self.lines += lines
        now = time.perf_counter()
        if now - self.last >= _PROGRESS_SECONDS:
            self.last = now
            rate = self.lines / (now - self.start)
            log.info("%s: %s lines (%s lines/s)", self.what, f"{self.lines:,}", f"{rate:,.0f}")


def _tasks(sources: list[_Source], chunk_rows: int, keep: int, limits: list[int | None] | None = None):
    """``(run, path, layout, source index, data index, keep)`` for every run of every source in
    order; with ``limits``, only the runs that start before ``limits[source]`` data lines."""
    for index, source in enumerate(sources):
        limit = None if limits is None else limits[index]
        if limit == 0:
            continue
        for buf, data_index in iter_runs(source.path, source.layout, chunk_rows):
            if limit is not None and data_index >= limit:
                break
            yield buf, source.path, source.layout, index, data_index, keep
            del buf


def _readers(sources: list[_Source], malformed: MalformedLog) -> list[RunReader]:
    return [RunReader(s.path, s.layout, malformed) for s in sources]


def _build_vocabulary(
    sources: list[_Source], plan: SplitPlan, min_frequency: int, chunk_rows: int, malformed: MalformedLog,
    workers: int,
) -> VocabEncoder:
    counter = ValueCounter()
    progress = _Progress("vocabulary pass")
    readers = _readers(sources, malformed)
    limits = [plan.train_lines(i) for i in range(len(sources))]
    with OrderedPool(workers, share, (plan, None)) as pool:
        for source, run, counted, rows in pool.map(count_run, _tasks(sources, chunk_rows, malformed.keep, limits)):
            readers[source].take(run)
            progress.add(run.chunk.n_lines)
            counter.update_counted(counted, rows)
    return VocabEncoder.from_counter(counter, min_frequency)


def _count_and_keep(
    sources: list[_Source], plan: SplitPlan, min_frequency: int, chunk_rows: int, readers: list[RunReader],
    keep: int, workers: int, kept: RunSpill,
) -> VocabEncoder:
    """Pass 2 with the parsed rows kept: every run parsed once (malformed lines counted by
    ``readers``, for good), its training rows counted and all its rows written to ``kept``."""
    counter = ValueCounter()
    progress = _Progress("vocabulary pass")
    with OrderedPool(workers, share, (plan, None)) as pool:
        finished = 0  # readers before this one have seen their whole file
        for source, run, counted, rows, codes in pool.map(count_and_transform_run,
                                                          _tasks(sources, chunk_rows, keep)):
            for reader in readers[finished:source]:
                reader.finish()
            finished = source
            chunk = readers[source].take(run)
            progress.add(chunk.n_lines)
            counter.update_counted(counted, rows)
            kept.write(codes, chunk.labels, chunk.dense, chunk.sparse)
            del chunk, run
        for reader in readers[finished:]:
            reader.finish()
    return VocabEncoder.from_counter(counter, min_frequency)


def _write_chunk(writer: PreparedWriter, codes: np.ndarray, labels: np.ndarray, dense: np.ndarray,
                 sparse: np.ndarray) -> None:
    present = np.unique(codes).tolist()
    if len(present) == 1:  # most runs of kaggle7 and days: no copies
        writer.write(SPLIT_NAMES[present[0]], labels, dense, sparse)
        return
    for code in present:
        take = codes == code
        writer.write(SPLIT_NAMES[code], labels[take], take_rows(dense, take), take_rows(sparse, take))


def prepare_criteo(
    raw: PathArg | Sequence[PathArg],
    out_dir: PathArg,
    *,
    layout: str = "auto",
    categorical: str | None = None,
    max_ind_range: int | None = None,
    min_frequency: int = 1,
    split: str = "kaggle7",
    seed: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    on_malformed: str = "skip",
    max_malformed_fraction: float = DEFAULT_MAX_MALFORMED_FRACTION,
    valid: PathArg | Sequence[PathArg] | None = None,
    test: PathArg | Sequence[PathArg] | None = None,
    force: bool = False,
    workers: int = 0,
    spill: bool = True,
) -> Path:
    """Convert raw Criteo files into the prepared directory ``out_dir``; returns it.

    ``raw``: one file or several, read in order as one stream of rows (``split="days"``: the day
    files, or a directory of ``day_N[.gz]`` files; ``split="files"``: the training files).
    ``layout``: ``auto`` | ``tsv`` | ``csv`` (:mod:`.raw`). ``categorical``: ``hash`` (needs
    ``max_ind_range``) or ``vocab`` (``min_frequency``, counted on train only); None (default):
    ``hash`` when ``max_ind_range`` is given, else ``vocab``; see
    :mod:`.transform`. ``split``: ``kaggle7`` | ``random_7_2_1`` | ``random_8_1_1`` (``seed``) |
    ``days`` | ``files`` (with ``valid`` and/or ``test`` files), see :mod:`.splits`.
    ``chunk_rows``: lines parsed at a time (memory; the output does not depend on it).
    ``on_malformed``: ``skip`` (at most ``max_malformed_fraction`` of the lines read) or ``fail``.
    ``workers``: processes that parse and encode runs of lines while this one reads and writes
    (0: all in this process); the output is the same bytes whatever it is. ``spill``
    (``vocab`` only): keep the parsed rows in a temporary file beside ``out_dir`` between the
    vocabulary pass and the encoding pass (:mod:`.spill`; about 162 bytes a row of disk) instead
    of parsing the text twice; the output is the same bytes either way.

    An ``out_dir`` whose metadata records the same inputs and parameters is reused unless
    ``force``. Errors are one-line :class:`UserInputError`; a failed conversion leaves no
    complete ``out_dir`` (:func:`recforge.data.prepared_dir.build_once`), and a directory that
    holds other files is never written into.
    """
    params = _params(layout, categorical, max_ind_range, min_frequency, split, seed, on_malformed,
                     max_malformed_fraction, chunk_rows)
    workers = check_workers(workers)
    spill = _check_spill(spill)
    out_dir = Path(out_dir)
    sources = _sources(as_paths(raw), as_paths(valid), as_paths(test), split, layout)
    _check_out_dir(out_dir, sources)
    inputs = _recorded_inputs(sources)

    def why_stale(directory: Path) -> str | None:
        try:
            meta = read_metadata(directory)
        except PreparedDataError as error:
            return str(error)
        recorded = (meta.get("source", {}).get("inputs"), meta.get("conversion", {}).get("params"))
        if recorded != (inputs, params):  # the synthetic generator's directories record neither
            return f"its {METADATA} records other inputs or settings than this run's"
        return None

    return build_once(out_dir, lambda target: _convert(sources, params, target, chunk_rows, workers, spill), why_stale,
                      force=force)


def _recorded_inputs(sources: list[_Source]) -> list[dict[str, Any]]:
    return [{**fingerprint(s.path), "layout": s.layout.name,
             "role": SPLIT_NAMES[s.role] if s.role is not None else "split"} for s in sources]


def _check_spill(spill: Any) -> bool:
    if not isinstance(spill, bool):
        raise UserInputError(f"spill must be True or False, got {spill!r}")
    return spill


def _convert(sources: list[_Source], params: dict[str, Any], out_dir: Path, chunk_rows: int, workers: int,
             spill: bool = True) -> Path:
    """The streaming conversion (see the module docstring) of ``sources`` into ``out_dir``."""
    started = time.perf_counter()
    split = params["split"]
    plan = _plan(sources, split, params.get("seed", 0))
    policy = (params["on_malformed"], params["max_malformed_fraction"])
    malformed = MalformedLog(*policy)
    readers = _readers(sources, malformed)
    with ExitStack() as stack:
        kept: RunSpill | None = None
        encoder: HashEncoder | VocabEncoder
        if params["categorical"] == "hash":
            encoder = HashEncoder(params["max_ind_range"])
        elif spill:
            kept = stack.enter_context(RunSpill(out_dir))
            encoder = _count_and_keep(sources, plan, params["min_frequency"], chunk_rows, readers, malformed.keep,
                                      workers, kept)
        else:
            # Its own log: the conversion pass below sees these lines again and reports them.
            encoder = _build_vocabulary(sources, plan, params["min_frequency"], chunk_rows, MalformedLog(*policy),
                                        workers)
        writer = stack.enter_context(PreparedWriter(out_dir))
        if kept is not None:
            progress = _Progress("encoding pass")
            for codes, labels, dense, values, missing in kept.runs():
                progress.add(len(labels))
                _write_chunk(writer, codes, labels, dense, encoder.encode_values(values, missing))
        else:
            _parse_and_write(sources, plan, encoder, chunk_rows, readers, malformed.keep, workers, writer)
        malformed.check()
        rows = writer.rows
        if rows["train"] == 0:
            raise RawInputError(
                f"no training rows: {split!r} put none of the {malformed.rows_read:,} lines read in train")
        for name in ("valid", "test"):
            if rows[name] == 0:
                log.warning("split %r has no rows (%s lines read)", name, f"{malformed.rows_read:,}")
        elapsed = time.perf_counter() - started
        path = writer.finish(
            encoder.cardinalities,
            source={"inputs": _recorded_inputs(sources), "lines_read": malformed.rows_read},
            categorical=encoder.metadata(),
            split={**plan.metadata(), "rows": rows},
            malformed=malformed.summary(),
            conversion={"rows_read": malformed.rows_read, "rows_written": sum(rows.values()),
                        "elapsed_seconds": round(elapsed, 3), "chunk_rows": int(chunk_rows), "workers": workers,
                        "converter": f"recforge.data.criteo.prepare v{CONVERTER_VERSION}", "params": params},
        )
    log.info("prepared %s: %s in %.1f s (%s malformed lines skipped)", path,
             ", ".join(f"{k} {v:,}" for k, v in rows.items()), elapsed, f"{malformed.count:,}")
    if malformed.count:
        shown = malformed.examples[:CONSOLE_EXAMPLES]
        log.warning("%s malformed lines skipped, the first %d:\n  %s\n(up to %d in %s, under \"malformed\")",
                    f"{malformed.count:,}", len(shown), "\n  ".join(shown), malformed.keep,
                    Path(path) / METADATA)
    return path


CONSOLE_EXAMPLES = 5
"""Malformed lines shown on the console as ``file:line: reason``; metadata.json keeps more."""


def _parse_and_write(sources: list[_Source], plan: SplitPlan, encoder: HashEncoder | VocabEncoder, chunk_rows: int,
                     readers: list[RunReader], keep: int, workers: int, writer: PreparedWriter) -> None:
    """Pass 3 from the text: every run parsed, split, transformed, encoded and written."""
    progress = _Progress("conversion")
    with OrderedPool(workers, share, (plan, encoder)) as pool:
        # Runs are parsed and encoded in the workers; they come back in file order and are
        # written here, so the parts are the same bytes whatever the number of workers.
        finished = 0  # readers before this one have seen their whole file
        for source, run, codes in pool.map(convert_run, _tasks(sources, chunk_rows, keep)):
            for reader in readers[finished:source]:
                reader.finish()
            finished = source
            chunk = readers[source].take(run)
            progress.add(chunk.n_lines)
            encoder.record_used(chunk.sparse)
            _write_chunk(writer, codes, chunk.labels, chunk.dense, chunk.sparse)
            del chunk, run  # before the next run is taken: memory holds a few runs at a time
        for reader in readers[finished:]:
            reader.finish()


def prepared_key(
    raw: PathArg | Sequence[PathArg],
    *,
    valid: PathArg | Sequence[PathArg] | None = None,
    test: PathArg | Sequence[PathArg] | None = None,
    layout: str = "auto",
    categorical: str | None = None,
    max_ind_range: int | None = None,
    min_frequency: int = 1,
    split: str = "kaggle7",
    seed: int = 0,
    on_malformed: str = "skip",
    max_malformed_fraction: float = DEFAULT_MAX_MALFORMED_FRACTION,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> str:
    """16 hex digits of a hash of the inputs (resolved paths, sizes, mtimes), the parameters that
    apply (``chunk_rows`` excluded: it does not change the output) and :data:`CONVERTER_VERSION`."""
    return _keys(raw, valid, test, _params(layout, categorical, max_ind_range, min_frequency, split, seed,
                                           on_malformed, max_malformed_fraction, chunk_rows))[0]


def _keys(raw, valid, test, params: dict[str, Any]) -> tuple[str, str]:
    """(the key, the key as versions before the one fingerprint computed it: the size spelt
    ``bytes``), so that caches converted before are found under their old name."""
    inputs = {}
    for role, paths in (("raw", as_paths(raw)), ("valid", as_paths(valid)), ("test", as_paths(test))):
        if params["split"] == "days" and role == "raw":
            paths = _day_files(paths)
        for path in paths:
            if not path.is_file():
                raise RawInputError(f"{path}: no such file (the raw Criteo input)")
        inputs[role] = [fingerprint(p) for p in paths]
    legacy = {role: [{"path": f["path"], "bytes": f["size"], "mtime_ns": f["mtime_ns"]} for f in found]
              for role, found in inputs.items()}
    return tuple(cache_key({"converter": CONVERTER_VERSION, "inputs": spelt, "params": params}, 16)
                 for spelt in (inputs, legacy))


def ensure_prepared(
    raw: PathArg | Sequence[PathArg],
    cache_root: PathArg,
    *,
    valid: PathArg | Sequence[PathArg] | None = None,
    test: PathArg | Sequence[PathArg] | None = None,
    layout: str = "auto",
    categorical: str | None = None,
    max_ind_range: int | None = None,
    min_frequency: int = 1,
    split: str = "kaggle7",
    seed: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    on_malformed: str = "skip",
    max_malformed_fraction: float = DEFAULT_MAX_MALFORMED_FRACTION,
    workers: int = 0,
    spill: bool = True,
) -> Path:
    """``cache_root/<prepared_key(raw, ...)>``, converted as :func:`prepare_criteo` does (same
    parameters; ``workers`` and ``spill`` are not part of the key: the output does not depend on
    them) unless it
    already holds a complete prepared directory. Concurrent callers (one
    per process of a distributed run) wait for the first, which converts
    (:func:`recforge.data.prepared_dir.build_once`).
    """
    params = _params(layout, categorical, max_ind_range, min_frequency, split, seed, on_malformed,
                     max_malformed_fraction, chunk_rows)
    workers = check_workers(workers)
    spill = _check_spill(spill)
    root = Path(cache_root)
    key, legacy_key = _keys(raw, valid, test, params)
    target, legacy = root / key, root / legacy_key
    if not target.exists() and _why_incomplete(legacy) is None:
        try:
            os.rename(legacy, target)
            log.info("criteo cache %s: renamed to %s (the key now spells the input sizes 'size')",
                     legacy, target.name)
            return target
        except OSError:
            pass  # another process renamed it first

    def build(target: Path) -> Path:
        sources = _sources(as_paths(raw), as_paths(valid), as_paths(test), split, layout)
        log.info("converting %s into %s", [str(s.path) for s in sources], target)
        return _convert(sources, params, target, chunk_rows, workers, spill)

    return build_once(target, build, _why_incomplete)


def _why_incomplete(prepared_dir: Path) -> str | None:
    try:
        read_metadata(prepared_dir)
    except PreparedDataError as error:
        return str(error)
    return None


# ---------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    parser = data_command_parser(
        "recforge.data.criteo.prepare",
        "Convert raw Criteo click logs (Kaggle train.txt / dac_sample.txt, Terabyte day_N, plain or "
        "gzip; or the Kaggle/BARS CSV layout with a header) into the prepared parquet format, "
        "streaming in bounded memory.",
        "raw file(s), read in order; --split days: the day files (or their directory); --split files: "
        "the training file(s)",
    )
    parser.add_argument("--layout", choices=LAYOUTS, default="auto",
                        help="tsv: label, I1..I13, C1..C26 tab-separated, no header; csv: a header naming "
                        "Label, I1..I13, C1..C26 (Id ignored); auto: from the first line (default)")
    parser.add_argument("--categorical", choices=CATEGORICAL_MODES, default=None,
                        help="hash: 0 = missing, 1 + (value mod --max-ind-range); vocab: 0 = missing, "
                        "1 = out of vocabulary, 2.. = values seen --min-frequency times in train (default: hash "
                        "when --max-ind-range is given, else vocab: the reference's per-feature ids)")
    parser.add_argument("--max-ind-range", type=int, help="hash: rows per table minus one (required)")
    parser.add_argument("--min-frequency", type=int, default=1, help="vocab: keep values seen this often in train")
    parser.add_argument("--split", choices=SPLIT_KINDS, default="kaggle7",
                        help="kaggle7: facebookresearch/dlrm's 7 parts (default); random_7_2_1 / random_8_1_1: "
                        "seeded per-row (BARS-like, not BARS's files); days: Terabyte day files; files: "
                        "--raw is train, plus --valid / --test")
    parser.add_argument("--seed", type=int, default=0, help="random splits: the seed")
    parser.add_argument("--valid", nargs="+", help="--split files: the validation file(s)")
    parser.add_argument("--test", nargs="+", help="--split files: the test file(s)")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                        help=f"lines parsed at a time; memory follows it (default {DEFAULT_CHUNK_ROWS:,})")
    parser.add_argument("--workers", type=int, default=0,
                        help="worker processes that parse and encode runs of lines in parallel (any number of "
                        "files; the output is the same bytes as with 0, which converts in this process)")
    parser.add_argument("--no-spill", dest="spill", action="store_false",
                        help="vocab: parse the text twice instead of keeping the parsed rows in a temporary "
                        "file beside --out between the two passes (that file needs about 162 bytes a row: "
                        "7.4 GB for Criteo Kaggle; without it the conversion takes about 1.5x the CPU time)")
    parser.add_argument("--on-malformed", choices=("skip", "fail"), default="skip",
                        help="skip malformed lines (counted, with examples) or fail at the first")
    parser.add_argument("--max-malformed-fraction", type=float, default=DEFAULT_MAX_MALFORMED_FRACTION,
                        help=f"skip: fail when more than this fraction of lines is malformed "
                        f"(default {DEFAULT_MAX_MALFORMED_FRACTION:g})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; a user error is one ``recforge:`` line and a non-zero exit."""
    args = _parser().parse_args(argv)
    out = run_data_command(lambda: prepare_criteo(
        args.raw, args.out, layout=args.layout, categorical=args.categorical,
        max_ind_range=args.max_ind_range, min_frequency=args.min_frequency, split=args.split,
        seed=args.seed, chunk_rows=args.chunk_rows, on_malformed=args.on_malformed,
        max_malformed_fraction=args.max_malformed_fraction, valid=args.valid, test=args.test,
        force=args.force, workers=args.workers, spill=args.spill,
    ))
    meta = read_metadata(out)
    rows = meta["split"]["rows"]
    print(f"{out}  " + "  ".join(f"{k}={v}" for k, v in rows.items())
          + f"  malformed={meta['malformed']['count']}  seconds={meta['conversion']['elapsed_seconds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

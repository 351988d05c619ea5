"""What is done with one run of raw lines, in a worker process or in the converting one.

The conversion (:mod:`recforge.data.criteo.prepare`) hands runs to
:class:`recforge.data.criteo.workers.OrderedPool`; these are its tasks. They live in a module of
their own so that a worker can import them by name whatever module runs as ``__main__``.
:func:`share` sets what every task of a pass uses (the split plan; the encoder of the conversion
pass), once per process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from recforge.data.criteo.raw import Layout, ParsedRun, parse_run
from recforge.data.criteo.splits import TRAIN, SplitPlan
from recforge.data.criteo.transform import HashEncoder, VocabEncoder, count_chunk, dense_log1p

__all__ = ["convert_run", "count_and_transform_run", "count_run", "share"]

_SHARED: dict[str, Any] = {}


def share(plan: SplitPlan, encoder: HashEncoder | VocabEncoder | None) -> None:
    """Set the split plan and the encoder the tasks of this process use."""
    _SHARED.update(plan=plan, encoder=encoder)


def count_run(buf: np.ndarray, path: Path, layout: Layout, source: int, data_index: int,
              keep: int) -> tuple[int, ParsedRun, list[tuple[np.ndarray, np.ndarray]], int]:
    """Vocabulary pass: ``(source, the parsed run without its rows, the per-feature value counts
    of its training rows, how many training rows)``."""
    run = parse_run(buf, path, layout, data_index, keep)
    chunk = run.chunk
    train = _SHARED["plan"].assign(source, chunk.rows) == TRAIN
    sparse = chunk.sparse if train.all() else chunk.sparse[train]
    counted = count_chunk(sparse)
    empty = np.empty((0, 0))
    chunk.labels, chunk.dense, chunk.sparse = empty, empty, empty  # not needed back: not sent back
    return source, run, counted, len(sparse)


def convert_run(buf: np.ndarray, path: Path, layout: Layout, source: int, data_index: int,
                keep: int) -> tuple[int, ParsedRun, np.ndarray]:
    """Conversion pass: ``(source, the run with its dense values transformed and its categorical
    values encoded, the split code of each row)``."""
    run = parse_run(buf, path, layout, data_index, keep)
    chunk = run.chunk
    chunk.dense = dense_log1p(chunk.dense)
    chunk.sparse = _SHARED["encoder"].encode(chunk.sparse)
    return source, run, _SHARED["plan"].assign(source, chunk.rows)


def count_and_transform_run(buf: np.ndarray, path: Path, layout: Layout, source: int, data_index: int,
                            keep: int) -> tuple[int, ParsedRun, list[tuple[np.ndarray, np.ndarray]], int, np.ndarray]:
    """Vocabulary pass of a conversion that keeps the parsed rows (:mod:`.spill`): ``(source, the
    run with its dense values transformed and its categorical values as read, the per-feature
    value counts of its training rows, how many training rows, the split code of each row)``."""
    run = parse_run(buf, path, layout, data_index, keep)
    chunk = run.chunk
    codes = _SHARED["plan"].assign(source, chunk.rows)
    train = codes == TRAIN
    sparse = chunk.sparse if train.all() else chunk.sparse[train]
    counted = count_chunk(sparse)
    chunk.dense = dense_log1p(chunk.dense)
    return source, run, counted, len(sparse), codes

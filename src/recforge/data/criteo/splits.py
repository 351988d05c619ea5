"""Which split each raw row goes to, decided row by row while streaming.

Rows are named by ``(source, line)``: the input file's position in the list and the row's
data-line index in it (0-based, header excluded, malformed lines keeping their place, so the
boundaries are where the file's lines are whatever gets skipped). Kinds:

* ``kaggle7`` (facebookresearch/dlrm's Kaggle split, ``data_utils.getCriteoAdData``): the data
  lines of all inputs, in order, are cut into 7 consecutive parts; with ``q, r = divmod(lines,
  7)`` every part has ``q`` lines and the first ``r`` parts one more. Parts 0-5 are train; part 6
  is halved as ``np.array_split(part, 2)`` does: the first ``ceil(len / 2)`` lines are test, the
  rest valid. Needs the line count first (a pass over the bytes, no parsing).
* ``random_7_2_1`` / ``random_8_1_1``: each row independently, train / valid / test with
  probabilities 0.7 / 0.2 / 0.1 (like BARS's Criteo_x1) or 0.8 / 0.1 / 0.1 (like Criteo_x4), from
  a counter-based hash of ``(seed, source, line)``: reproducible, chunk-independent, streaming.
  Caveat: these are *not* BARS's released files (their assignment is a different shuffle), so
  numbers are comparable in spirit, not row for row; to use BARS's exact rows, convert their
  released train/valid/test files with ``files``.
* ``days`` (Terabyte, facebookresearch/dlrm's ``--data-set=terabyte``): one input per day, in
  day order; all days but the last are train, the last day's first ``ceil(len / 2)`` lines test,
  the rest valid.
* ``files``: pre-split inputs, each file's rows go to the split it was given for.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from recforge.errors import UserInputError

__all__ = [
    "RANDOM_FRACTIONS",
    "SPLIT_KINDS",
    "SPLIT_NAMES",
    "TEST",
    "TRAIN",
    "VALID",
    "DaysSplit",
    "FilesSplit",
    "Kaggle7Split",
    "RandomSplit",
    "SplitPlan",
    "kaggle7_part_sizes",
]

TRAIN, VALID, TEST = 0, 1, 2
SPLIT_NAMES = ("train", "valid", "test")
SPLIT_KINDS = ("kaggle7", "random_7_2_1", "random_8_1_1", "days", "files")
RANDOM_FRACTIONS = {"random_7_2_1": (0.7, 0.2, 0.1), "random_8_1_1": (0.8, 0.1, 0.1)}
RANDOM_CAVEAT = (
    "a seeded per-row assignment with these proportions, not BARS's released Criteo_x1/x4 files "
    "(a different shuffle): comparable in spirit, not row for row; for BARS's exact rows convert "
    "its released train/valid/test files with split='files'"
)


class SplitPlan:
    """``assign(source, lines)`` -> split codes (TRAIN, VALID, TEST) [n] int8 for data-line
    indices ``lines`` [n] of input ``source``."""

    kind: str

    def assign(self, source: int, lines: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def train_lines(self, source: int) -> int | None:
        """Training rows of ``source`` lie among its first this many lines (None: anywhere),
        so a pass over training rows only can stop early or skip the file (0)."""
        return None

    def metadata(self) -> dict[str, Any]:
        raise NotImplementedError


def kaggle7_part_sizes(lines: int, parts: int = 7) -> list[int]:
    """Sizes of ``parts`` consecutive parts of ``lines`` lines, the first ``lines % parts`` one
    longer (facebookresearch/dlrm's ``total_per_file``)."""
    size, extra = divmod(int(lines), parts)
    return [size + (i < extra) for i in range(parts)]


def _halves(lines: int) -> tuple[int, int]:
    """(first, second) half sizes as ``np.array_split(x, 2)`` cuts: the first gets the odd one."""
    first = (lines + 1) // 2
    return first, lines - first


class Kaggle7Split(SplitPlan):
    kind = "kaggle7"

    def __init__(self, source_lines: Sequence[int]) -> None:
        self.source_lines = [int(n) for n in source_lines]
        self.offsets = np.concatenate([[0], np.cumsum(self.source_lines)]).astype(np.int64)
        total = int(self.offsets[-1])
        self.parts = kaggle7_part_sizes(total)
        self.train_end = sum(self.parts[:6])
        self.test_end = self.train_end + _halves(self.parts[6])[0]
        self.total = total

    def assign(self, source: int, lines: np.ndarray) -> np.ndarray:
        at = lines.astype(np.int64) + self.offsets[source]
        codes = np.full(len(at), VALID, dtype=np.int8)
        codes[at < self.test_end] = TEST
        codes[at < self.train_end] = TRAIN
        return codes

    def train_lines(self, source: int) -> int | None:
        return int(np.clip(self.train_end - self.offsets[source], 0, self.source_lines[source]))

    def metadata(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "lines": self.total,
            "part_lines": self.parts,
            "train": "parts 0-5",
            "test": "part 6, first half (the odd line included)",
            "valid": "part 6, second half",
            "line_ranges": {"train": [0, self.train_end], "test": [self.train_end, self.test_end],
                            "valid": [self.test_end, self.total]},
            "by": "data line across the inputs in order (malformed lines keep their place)",
            "reference": "facebookresearch/dlrm data_utils.getCriteoAdData(days=7): divmod(lines, 7), "
                         "the first lines % 7 parts one line longer; np.array_split(part 6, 2)",
        }


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function: a bijection of uint64 that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_uniforms(seed: int, source: int, lines: np.ndarray) -> np.ndarray:
    """[n] float64 in [0, 1): one uniform per (seed, source, line), SplitMix64 over the line
    index from a start drawn from (seed, source): the same value however rows are chunked."""
    start = _mix64(np.array([(int(seed) % 2**64)], dtype=np.uint64))
    start = _mix64(start ^ np.array([int(source)], dtype=np.uint64) * _GOLDEN)
    z = _mix64(start + (lines.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


class RandomSplit(SplitPlan):
    def __init__(self, kind: str, seed: int) -> None:
        if kind not in RANDOM_FRACTIONS:
            raise UserInputError(f"random split kind must be one of {sorted(RANDOM_FRACTIONS)}, got {kind!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise UserInputError(f"seed must be an integer >= 0, got {seed!r}")
        self.kind = kind
        self.seed = int(seed)
        self.fractions = RANDOM_FRACTIONS[kind]

    def assign(self, source: int, lines: np.ndarray) -> np.ndarray:
        u = row_uniforms(self.seed, source, lines)
        train, valid, _ = self.fractions
        codes = np.full(len(u), TEST, dtype=np.int8)
        codes[u < train + valid] = VALID
        codes[u < train] = TRAIN
        return codes

    def metadata(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "seed": self.seed,
            "fractions": dict(zip(SPLIT_NAMES, self.fractions)),
            "assignment": "u = SplitMix64(seed, input index, data-line index) / 2**64; "
                          "train if u < f_train, valid if u < f_train + f_valid, else test",
            "caveat": RANDOM_CAVEAT,
        }


class DaysSplit(SplitPlan):
    kind = "days"

    def __init__(self, n_days: int, last_day_lines: int) -> None:
        if n_days < 2:
            raise UserInputError(
                f"split 'days' needs at least 2 day files (train days, then the test day), got {n_days}")
        self.n_days = int(n_days)
        self.last_day_lines = int(last_day_lines)
        self.test_lines = _halves(self.last_day_lines)[0]

    def assign(self, source: int, lines: np.ndarray) -> np.ndarray:
        if source < self.n_days - 1:
            return np.full(len(lines), TRAIN, dtype=np.int8)
        return np.where(lines < self.test_lines, TEST, VALID).astype(np.int8)

    def train_lines(self, source: int) -> int | None:
        return None if source < self.n_days - 1 else 0

    def metadata(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "days": self.n_days,
            "train": f"days 0-{self.n_days - 2}",
            "last_day_lines": self.last_day_lines,
            "test": f"the last day's first {self.test_lines} lines",
            "valid": f"the last day's other {self.last_day_lines - self.test_lines} lines",
        }


class FilesSplit(SplitPlan):
    kind = "files"

    def __init__(self, roles: Sequence[int]) -> None:
        self.roles = [int(r) for r in roles]

    def assign(self, source: int, lines: np.ndarray) -> np.ndarray:
        return np.full(len(lines), self.roles[source], dtype=np.int8)

    def train_lines(self, source: int) -> int | None:
        return None if self.roles[source] == TRAIN else 0

    def metadata(self) -> dict[str, Any]:
        return {"kind": self.kind, "roles": [SPLIT_NAMES[r] for r in self.roles]}

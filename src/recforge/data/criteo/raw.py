"""Reading raw Criteo click logs in bounded-memory chunks, with every malformed line counted.

Two layouts, plain or gzip-compressed (recognised by the gzip magic bytes, not the name):

* ``tsv``: the raw Criteo text format (Kaggle ``train.txt``, ``dac_sample.txt``, Terabyte
  ``day_N``): ``label \\t I1 .. I13 \\t C1 .. C26``, 40 tab-separated fields, no header.
* ``csv``: a header line naming the columns (case-insensitive, any order, other columns such as
  the Kaggle competition files' ``Id`` ignored), comma-separated (tab-separated when the header
  holds tabs): ``Id,Label,I1..,C1..`` or BARS's ``label,I1..I13,C1..C26``. No quoting: Criteo
  values never contain a comma.

``layout="auto"`` decides from the first line: a line naming ``label`` is a header, anything
else must be a raw ``tsv`` row.

A valid row: the label is ``0`` or ``1``; a dense value is empty (missing) or ``-?[0-9]{1,18}``;
a categorical value is empty (missing) or 1 to 8 hex digits (Criteo's are 32-bit hashes
written as 8 lower-case digits; either case is accepted). CRLF line ends and a UTF-8
byte-order mark are accepted. Anything else (a wrong field count, a blank line, a bad value)
makes the line malformed: :class:`MalformedLog` counts it with its file and line number and
applies the ``skip``/``fail`` policy.

Parsing is vectorised over a whole chunk of lines held as one byte buffer: numpy finds the line
and field boundaries, fetches each field's last 8 bytes as one 64-bit word and validates and
decodes all 8 bytes at once with integer arithmetic, so no Python code runs per value. Memory
follows the chunk (the bytes plus boundary and value arrays, about 1 KB per row), not the file.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from recforge.data.compressed import describe_compression, open_decompressed
from recforge.data.criteo.prepared import DENSE_COLUMNS, N_DENSE, N_SPARSE, SPARSE_COLUMNS
from recforge.errors import UserInputError

__all__ = [
    "LAYOUTS",
    "TSV",
    "Layout",
    "MalformedInputError",
    "MalformedLog",
    "ParsedRun",
    "RawChunk",
    "RawInputError",
    "RunReader",
    "count_data_lines",
    "detect_layout",
    "explain",
    "iter_raw_chunks",
    "iter_runs",
    "open_raw",
    "parse_run",
    "take_rows",
]

LAYOUTS = ("auto", "tsv", "csv")
HEX_DIGITS = 8
DENSE_DIGITS = 18  # at most 18 decimal digits always fit in int64
# A file whose first lines are all malformed is the wrong file, not a dirty one.
PROBE_LINES = 1000
_BLOCK = 1 << 22
_GUESS_LINE_BYTES = 320
# A "line" this long without a line break means the input is not a text file of rows.
_MAX_LINE_BYTES = 1 << 26
_BOM = b"\xef\xbb\xbf"
_NL, _CR, _MINUS = ord("\n"), ord("\r"), ord("-")
_BAD = 255
# Bytes in front of a run of lines, so that an 8-byte window ending near its start stays inside.
_PAD = 8


def _lookup(digits: str) -> np.ndarray:
    table = np.full(256, _BAD, dtype=np.uint8)
    for value, ch in enumerate(digits):
        table[ord(ch)] = value
    return table


_DEC = _lookup("0123456789")


class RawInputError(UserInputError):
    """A raw input file is missing, empty, unreadable or not in a Criteo layout."""


class MalformedInputError(RawInputError):
    """Too many malformed lines (or one, under ``on_malformed="fail"``)."""


# ---------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """Where the columns sit in a line: 0-based field positions of the label, ``I1..I13`` and
    ``C1..C26`` among ``n_fields`` fields separated by ``sep``; ``header``: the first line is
    a header, not data."""

    name: str
    sep: str
    header: bool
    n_fields: int
    label: int
    dense: tuple[int, ...]
    sparse: tuple[int, ...]

    def describe(self) -> str:
        sep = "tab" if self.sep == "\t" else repr(self.sep)
        head = "a header line, then " if self.header else "no header, "
        return f"{self.name}: {head}{self.n_fields} fields separated by {sep}"


TSV = Layout("tsv", "\t", False, 1 + N_DENSE + N_SPARSE, 0,
             tuple(range(1, 1 + N_DENSE)), tuple(range(1 + N_DENSE, 1 + N_DENSE + N_SPARSE)))


def _header_layout(path: Path, first: str) -> Layout:
    sep = "\t" if "\t" in first else ","
    names = [f.strip().strip('"').lower() for f in first.split(sep)]
    wanted = ["label", *(c.lower() for c in DENSE_COLUMNS), *(c.lower() for c in SPARSE_COLUMNS)]
    missing = [w for w in wanted if w not in names]
    if missing:
        raise RawInputError(
            f"{path}, line 1 (header): missing column(s) {', '.join(missing)}; expected a header "
            f"naming Label, I1..I13, C1..C26 (an Id column may come first), found {names[:45]}"
        )
    repeated = sorted({n for n in names if n in wanted and names.count(n) > 1})
    if repeated:
        raise RawInputError(f"{path}, line 1 (header): column(s) named twice: {', '.join(repeated)}")
    pos = {name: names.index(name) for name in wanted}
    return Layout(
        "csv" if sep == "," else "tsv-header", sep, True, len(names), pos["label"],
        tuple(pos[c.lower()] for c in DENSE_COLUMNS), tuple(pos[c.lower()] for c in SPARSE_COLUMNS),
    )


def _looks_like_header(first: str) -> bool:
    sep = "\t" if "\t" in first else ","
    return "label" in {f.strip().strip('"').lower() for f in first.split(sep)}


def detect_layout(path: str | os.PathLike[str], layout: str = "auto") -> Layout:
    """The layout of ``path`` (``auto``: from its first line); one-line errors for a missing,
    empty, unreadable or unrecognised file."""
    if layout not in LAYOUTS:
        raise RawInputError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    path = Path(path)
    first = _first_line(path)
    if layout == "tsv":
        return TSV
    if layout == "csv" or _looks_like_header(first):
        if not _looks_like_header(first):
            raise RawInputError(
                f"{path}, line 1: layout 'csv' needs a header naming Label, I1..I13, C1..C26; "
                f"found {first[:120]!r}"
            )
        return _header_layout(path, first)
    fields = first.split("\t")
    if len(fields) != TSV.n_fields:
        hint = " (a CSV file needs its header line)" if first.count(",") >= TSV.n_fields - 1 else ""
        raise RawInputError(
            f"{path}, line 1: not a Criteo row ({TSV.n_fields} tab-separated fields: label, "
            f"I1..I13, C1..C26) nor a CSV header naming Label, I1..I13, C1..C26; found "
            f"{len(fields)} tab-separated field(s): {first[:120]!r}{hint}"
        )
    return TSV


# ---------------------------------------------------------------------------- opening
def _check_file(path: Path) -> None:
    if not path.exists():
        raise RawInputError(f"{path}: no such file (the raw Criteo input)")
    if not path.is_file():
        raise RawInputError(f"{path}: is a directory, not a raw Criteo file")
    if path.stat().st_size == 0:
        raise RawInputError(f"{path}: the file is empty (expected Criteo rows)")


def open_raw(path: str | os.PathLike[str]) -> IO[bytes]:
    """The decompressed bytes of ``path`` (gzip when it starts with the gzip magic bytes)."""
    path = Path(path)
    _check_file(path)
    return open_decompressed(path)


def _read_error(path: Path, error: BaseException) -> RawInputError:
    reason = str(error) or type(error).__name__
    return RawInputError(f"{path}: cannot be read as {describe_compression(path)} (truncated or corrupt?): {reason}")


_READ_ERRORS = (OSError, EOFError, zlib.error)


def _first_line(path: Path) -> str:
    try:
        with open_raw(path) as handle:
            line = handle.readline(_MAX_LINE_BYTES)
    except _READ_ERRORS as error:
        raise _read_error(path, error) from None
    if line.startswith(_BOM):
        line = line[len(_BOM):]
    if not line:
        raise RawInputError(f"{path}: no data (the decompressed file is empty)")
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    if not text.strip():
        raise RawInputError(f"{path}, line 1: blank first line (expected a Criteo row or a CSV header)")
    return text


def _blocks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of ``path`` in blocks, the byte-order mark dropped."""
    try:
        with open_raw(path) as handle:
            first = True
            while True:
                block = handle.read(_BLOCK)
                if first and block.startswith(_BOM):
                    block = block[len(_BOM):]
                first = False
                if not block:
                    return
                yield block
    except _READ_ERRORS as error:
        raise _read_error(path, error) from None


def count_data_lines(path: str | os.PathLike[str], layout: Layout) -> int:
    """Data lines in ``path`` (a last line without a line break counts; a header does not):
    a pass over the bytes, no parsing."""
    path = Path(path)
    lines, last = 0, b"\n"
    for block in _blocks(path):
        lines += block.count(b"\n")
        last = block[-1:]
    lines += last != b"\n"
    return max(lines - layout.header, 0)


def _open_stream(path: Path) -> IO[bytes]:
    try:
        return open_raw(path)
    except _READ_ERRORS as error:
        raise _read_error(path, error) from None


def _line_chunks(path: Path, chunk_rows: int) -> Iterator[np.ndarray]:
    """Successive runs of ``chunk_rows`` whole lines (the last run may be shorter), each a uint8
    array of :data:`_PAD` bytes of context (zeros, or the bytes just before), then the lines,
    ending in a line break (one is added after a last line without).

    The file is read straight into the buffer that is handed out (no joining of blocks), so a
    run of lines costs its bytes once; a buffer is never written again once handed out.
    """
    # np.zeros maps fresh pages, which take memory only once written: a generous guess of a
    # run's size (Criteo lines are 200-300 bytes) costs nothing and spares regrowing copies.
    capacity = _PAD + chunk_rows * _GUESS_LINE_BYTES + _BLOCK
    buf = np.zeros(capacity, dtype=np.uint8)
    start = filled = _PAD  # lines not handed out yet: buf[start:filled]
    lines = 0  # line breaks in buf[start:filled]
    first = True
    with _open_stream(path) as handle:
        while True:
            if lines == 0 and filled - start > _MAX_LINE_BYTES:
                raise RawInputError(f"{path}: no line break in {filled - start:,} bytes: not a text file of rows")
            if filled == buf.size:
                grown = np.zeros(buf.size + max(buf.size // 2, _BLOCK), dtype=np.uint8)
                grown[:filled] = buf[:filled]
                buf = grown
            try:
                got = handle.readinto(memoryview(buf)[filled:min(buf.size, filled + _BLOCK)])
            except _READ_ERRORS as error:
                raise _read_error(path, error) from None
            if not got:
                break
            if first and bytes(buf[_PAD:_PAD + len(_BOM)]) == _BOM and filled + got >= _PAD + len(_BOM):
                start = _PAD + len(_BOM)
            first = False
            lines += int(np.count_nonzero(buf[filled:filled + got] == _NL))
            filled += got
            if lines < chunk_rows:
                continue
            ends = np.flatnonzero(buf[start:filled] == _NL) + start
            cuts = ends[chunk_rows - 1::chunk_rows] + 1
            # The rest moves to a fresh buffer sized for a whole run, so that no handed-out
            # buffer is written again and none has to grow.
            taken = int(cuts[-1]) - start
            per_line = taken / (len(cuts) * chunk_rows)
            rest = buf[int(cuts[-1]):filled]
            capacity = _PAD + max(int(per_line * chunk_rows * 1.25), len(rest)) + _BLOCK
            fresh = np.zeros(capacity, dtype=np.uint8)
            fresh[:_PAD + len(rest)] = buf[int(cuts[-1]) - _PAD:filled]
            bounds = [start, *cuts.tolist()]
            # Last first, so that pop() hands them out in order; yielding pop()'s result keeps
            # no reference here, so a run's buffer is freed as soon as its reader drops it.
            runs = [buf[a - _PAD:b] for a, b in zip(bounds[-2::-1], bounds[:0:-1])]
            buf, start, filled, lines = fresh, _PAD, _PAD + len(rest), lines - len(cuts) * chunk_rows
            del rest
            while runs:
                yield runs.pop()
    if filled > start:
        if buf[filled - 1] != _NL:
            if filled == buf.size:
                buf = np.concatenate([buf, np.zeros(1, dtype=np.uint8)])
            buf[filled] = _NL
            filled += 1
        yield buf[start - _PAD:filled]


# ---------------------------------------------------------------------------- malformed lines
class MalformedLog:
    """Counts malformed lines over a conversion and applies the policy.

    ``policy="fail"``: the first malformed line raises :class:`MalformedInputError`.
    ``policy="skip"``: lines are skipped and counted; :meth:`check` raises when more than
    ``max_fraction`` of the data lines read were malformed. The first ``keep`` lines are kept
    as ``"file:line: reason"`` examples.
    """

    def __init__(self, policy: str = "skip", max_fraction: float = 0.001, keep: int = 10) -> None:
        if policy not in ("skip", "fail"):
            raise RawInputError(f"on_malformed must be 'skip' or 'fail', got {policy!r}")
        if not 0.0 <= float(max_fraction) <= 1.0:
            raise RawInputError(f"max_malformed_fraction must be in [0, 1], got {max_fraction!r}")
        self.policy = policy
        self.max_fraction = float(max_fraction)
        self.keep = int(keep)
        self.count = 0
        self.rows_read = 0
        self.examples: list[str] = []

    def record(self, path: Path, lines: np.ndarray, reason_of: Callable[[int], str]) -> None:
        """Count malformed ``lines`` (1-based line numbers in ``path``); ``reason_of(k)`` explains
        the k-th of them (called only for the ones kept as examples)."""
        if len(lines) == 0:
            return
        for k in range(min(len(lines), max(self.keep - len(self.examples), 0))):
            self.examples.append(f"{path}:{int(lines[k])}: {reason_of(k)}")
        self.count += len(lines)
        if self.policy == "fail":
            first = f"{path}:{int(lines[0])}: {reason_of(0)}"
            raise MalformedInputError(f"malformed line (on_malformed='fail'): {first}")

    def check(self) -> None:
        """Raise when more than ``max_fraction`` of the lines read were malformed."""
        if self.count > self.max_fraction * self.rows_read:
            raise MalformedInputError(
                f"{self.count:,} of {self.rows_read:,} lines malformed "
                f"({self.count / max(self.rows_read, 1):.4%}, more than max_malformed_fraction="
                f"{self.max_fraction:g}); first: {'; '.join(self.examples[:3])}"
            )

    def summary(self) -> dict:
        return {
            "count": self.count,
            "lines_read": self.rows_read,
            "fraction": self.count / self.rows_read if self.rows_read else 0.0,
            "policy": self.policy,
            "max_fraction": self.max_fraction,
            "examples": list(self.examples),
        }


# ---------------------------------------------------------------------------- parsing
@dataclass
class RawChunk:
    """The valid rows of one run of lines of one file, in file order.

    ``rows`` [n] int64: each row's data-line index in its file (0-based, malformed lines and
    the header not skipped over, so split boundaries stay where the file's lines are);
    ``labels`` [n] int8; ``dense`` [n, 13] int64 (missing = 0, as the reference reads an empty
    field); ``sparse`` [n, 26] int64 (missing = -1, else the hex value, 0 .. 2**32 - 1);
    ``first_line`` and ``n_lines``: the run's first data-line index and its data lines,
    malformed ones included.
    """

    path: Path
    first_line: int
    n_lines: int
    rows: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class _Lines:
    """Line and field boundaries in a padded run of lines (offsets into ``buf``; ends exclusive).

    ``seps`` [good lines, n_fields - 1]: the separators of each line with the right field count;
    ``words``: :func:`_words` of ``buf``.
    """

    buf: np.ndarray
    words: np.ndarray
    line_start: np.ndarray  # [lines]
    line_end: np.ndarray  # [lines], before "\r\n" or "\n"
    good: np.ndarray  # [lines] bool
    seps: np.ndarray
    n_fields: int

    def field(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Start and end offsets [good lines] of field ``j``."""
        start = self.line_start[self.good] if j == 0 else self.seps[:, j - 1] + 1
        end = self.line_end[self.good] if j == self.n_fields - 1 else self.seps[:, j]
        return start, end


def _words(buf: np.ndarray) -> np.ndarray:
    """Every 8-byte window of ``buf`` as one little-endian uint64 (overlapping, no copy): a
    field's last 8 bytes come with one gather, and are then decoded 8 at a time."""
    return np.ndarray((max(buf.size - 7, 0),), dtype="<u8", buffer=buf, strides=(1,))


def _positions(buf: np.ndarray, byte: int, start: int, dtype: type) -> np.ndarray:
    """Offsets of ``byte`` in ``buf[start:]`` as ``dtype``, a slice at a time: no int64 array
    the size of the whole run (separators are a sixth of a Criteo line's bytes)."""
    step = 1 << 20
    bounds = range(start, buf.size, step)
    counts = [int(np.count_nonzero(buf[a:a + step] == byte)) for a in bounds]
    out = np.empty(sum(counts), dtype=dtype)
    k = 0
    for a, count in zip(bounds, counts):
        out[k:k + count] = np.flatnonzero(buf[a:a + step] == byte) + a
        k += count
    return out


def _split_lines(buf: np.ndarray, sep: int, n_fields: int) -> _Lines:
    """``buf``: :data:`_PAD` bytes of context, then whole lines ending with a line break."""
    index = np.int32 if buf.size < 2**31 else np.int64
    ends = _positions(buf, _NL, _PAD, index)
    line_start = np.empty_like(ends)
    line_start[:1] = _PAD
    line_start[1:] = ends[:-1] + 1
    line_end = ends - ((buf[ends - 1] == _CR) & (ends > line_start)).astype(index)
    seps = _positions(buf, sep, _PAD, index)
    per_line = np.diff(np.searchsorted(seps, ends), prepend=0)
    good = per_line == n_fields - 1
    if not good.all():
        seps = seps[np.repeat(good, per_line)]
    # Column-major: each field's boundaries are then one contiguous column, read twice (the end
    # of field j, the start of field j + 1), rather than a strided gather across every line.
    seps = np.asfortranarray(seps.reshape(-1, n_fields - 1))
    return _Lines(buf, _words(buf), line_start, line_end, good, seps, n_fields)


# Byte-parallel arithmetic on the 8 bytes of a uint64 ("SWAR"). A field's window is its last 8
# bytes, the field right-aligned: in a little-endian word its first byte is the least
# significant inside it. Bytes before the field are replaced by "0" before decoding.
_U64 = np.uint64
_ONES = 0x0101010101010101
_HIGH = _U64(0x8080808080808080)
_LOW7 = _U64(0x7F7F7F7F7F7F7F7F)
_ZEROS = _U64(0x30 * _ONES)
_NIB = _U64(0x0F * _ONES)
# _INSIDE[k]: the mask of the last k bytes of the window (its k most significant bytes).
_INSIDE = np.array([0] + [((1 << 64) - 1) & ~((1 << (8 * (8 - k))) - 1) for k in range(1, 9)], dtype=np.uint64)
_SHIFT = np.array([0] + [8 * (8 - k) for k in range(1, 9)], dtype=np.uint64)


def _in_range(w7: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per byte of ``w7`` (bytes < 0x80): high bit set where lo <= byte <= hi. No byte's sum
    carries into the next, so the 8 tests run in one addition each."""
    at_least = w7 + _U64((0x80 - lo) * _ONES)
    above = w7 + _U64((0x7F - hi) * _ONES)
    return at_least & ~above & _HIGH


def _all_bytes(w: np.ndarray, ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    """[n] bool: every byte of ``w`` lies in one of ``ranges`` (ASCII bounds)."""
    w7 = w & _LOW7
    ok = _in_range(w7, *ranges[0])
    for lo, hi in ranges[1:]:
        ok |= _in_range(w7, lo, hi)
    return (ok & ~w) == _HIGH  # a byte >= 0x80 has its high bit in w: not ASCII, not valid


def _fill(w: np.ndarray, n_inside: np.ndarray) -> np.ndarray:
    """``w`` with the bytes before the last ``n_inside`` replaced by "0"."""
    inside = _INSIDE[n_inside]
    return (w & inside) | (_ZEROS & ~inside)


def parse_hex(lines: _Lines, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values [n] int64 (-1 where empty) and a bad mask [n] of hex fields ``[start, end)``."""
    length = (end - start).astype(np.int64)
    w = _fill(lines.words[end.astype(np.int64) - 8], np.minimum(length, HEX_DIGITS))
    bad = ~_all_bytes(w, ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))) | (length > HEX_DIGITS)
    # digit = low nibble, + 9 for letters (bit 6 set): "a" (0x61) and "A" (0x41) -> 1 + 9
    nib = (w & _NIB) + ((w >> _U64(6)) & _U64(_ONES)) * _U64(9)
    # Nibbles to one number, most significant first: pairs into bytes, bytes into a uint32.
    pairs = ((nib & _U64(0x000F000F000F000F)) << _U64(4)) | ((nib >> _U64(8)) & _U64(0x000F000F000F000F))
    pairs = (pairs | (pairs >> _U64(8))) & _U64(0x0000FFFF0000FFFF)
    pairs = (pairs | (pairs >> _U64(16))) & _U64(0xFFFFFFFF)
    values = pairs.astype(np.uint32).byteswap().astype(np.int64)
    values[bad] = 0
    values[length == 0] = -1
    return values, bad


def _decimal(w: np.ndarray) -> np.ndarray:
    """8 ASCII digits (first = least significant byte) -> their value: pairs, quads, octet."""
    v = w - _ZEROS
    v = (v * _U64(10) + (v >> _U64(8))) & _U64(0x00FF00FF00FF00FF)
    v = (v * _U64(100) + (v >> _U64(16))) & _U64(0x0000FFFF0000FFFF)
    v = (v * _U64(10000) + (v >> _U64(32))) & _U64(0xFFFFFFFF)
    return v.astype(np.int64)


def parse_int(lines: _Lines, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values [n] int64 (0 where empty) and a bad mask [n] of fields ``-?[0-9]{1,18}`` at
    ``[start, end)``. Fields of up to 8 bytes (all of Criteo's) are decoded 8 bytes at a time;
    longer ones through :func:`_parse_long_int`."""
    length = (end - start).astype(np.int64)
    short = np.minimum(length, 8)
    w = lines.words[end.astype(np.int64) - 8]
    first = (w >> _SHIFT[short]) & _U64(0xFF)
    negative = (length >= 2) & (first == _MINUS)
    w = _fill(w, short - negative)
    bad = ~_all_bytes(w, ((0x30, 0x39),))
    values = _decimal(w)
    long = np.flatnonzero(length > 8)
    if len(long):
        values[long], bad[long] = _parse_long_int(lines.buf, start[long], end[long])
        negative[long] = lines.buf[start[long]] == _MINUS
    values[bad] = 0
    values[negative] *= -1
    return values, bad


def _parse_long_int(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Magnitudes and bad mask of fields longer than 8 bytes, a digit table per byte."""
    length = (end - start).astype(np.int64)
    negative = buf[start] == _MINUS
    n_digits = length - negative
    width = DENSE_DIGITS
    k = np.arange(width)
    idx = end.astype(np.int64)[:, None] - width + k
    inside = k >= (width - np.minimum(n_digits, width))[:, None]
    digits = _DEC[buf[np.maximum(idx, 0)]]
    digits[~inside] = 0
    bad = (digits == _BAD).any(axis=1) | (n_digits > DENSE_DIGITS)
    digits[bad] = 0
    values = digits.astype(np.int64) @ 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return values, bad


def _parse(lines: _Lines, layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """labels, dense, sparse of the good lines and the mask [good lines] of bad values."""
    buf = lines.buf
    start, end = lines.field(layout.label)
    first = buf[np.minimum(start, buf.size - 1)]
    bad = ((end - start) != 1) | ((first != ord("0")) & (first != ord("1")))
    labels = (first - ord("0")).astype(np.int8)
    n = len(start)
    # Column-major, like every array downstream: each column is read, transformed and handed to
    # pyarrow as one contiguous block.
    dense = np.empty((n, N_DENSE), dtype=np.int64, order="F")
    for j, position in enumerate(layout.dense):
        dense[:, j], wrong = parse_int(lines, *lines.field(position))
        bad |= wrong
    sparse = np.empty((n, N_SPARSE), dtype=np.int64, order="F")
    for j, position in enumerate(layout.sparse):
        sparse[:, j], wrong = parse_hex(lines, *lines.field(position))
        bad |= wrong
    return labels, dense, sparse, bad


def take_rows(array: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``array[mask]`` for a 2-d array, column-major like ``array`` (numpy's result is row-major)."""
    out = np.empty((int(np.count_nonzero(mask)), array.shape[1]), dtype=array.dtype, order="F")
    for j in range(array.shape[1]):
        out[:, j] = array[:, j][mask]
    return out


def explain(line: bytes, layout: Layout) -> str:
    """Why one line (without its line break) is malformed, read naively; "" when it is not."""
    text = line.decode("utf-8", errors="replace").rstrip("\r")
    if not text.strip():
        return "empty line"
    fields = text.split(layout.sep)
    if len(fields) != layout.n_fields:
        sep = "tab" if layout.sep == "\t" else repr(layout.sep)
        return f"expected {layout.n_fields} fields separated by {sep}, found {len(fields)}"
    checks = [(layout.label, "label", _label_problem)]
    checks += [(p, name, _int_problem) for p, name in zip(layout.dense, DENSE_COLUMNS)]
    checks += [(p, name, _hex_problem) for p, name in zip(layout.sparse, SPARSE_COLUMNS)]
    for position, name, problem in sorted(checks):
        found = problem(fields[position])
        if found:
            return f"{name} (field {position + 1}): {found}, got {fields[position][:40]!r}"
    return ""


def _label_problem(value: str) -> str:
    return "" if value in ("0", "1") else "expected a label 0 or 1"


def _int_problem(value: str) -> str:
    digits = value[1:] if value.startswith("-") else value
    if value and not (digits and all(c in "0123456789" for c in digits)):
        return "expected an integer or an empty field"
    return f"expected at most {DENSE_DIGITS} digits" if len(digits) > DENSE_DIGITS else ""


def _hex_problem(value: str) -> str:
    if any(c not in "0123456789abcdefABCDEF" for c in value):
        return "expected hex digits or an empty field"
    return f"expected at most {HEX_DIGITS} hex digits" if len(value) > HEX_DIGITS else ""


@dataclass
class ParsedRun:
    """One run of lines parsed on its own (in any process): its valid rows and what was wrong
    with the others. ``bad_lines``: 1-based file line numbers of the malformed lines;
    ``reasons``: why, for the first ``keep`` of them; ``good_in_probe``: valid rows among the
    file's first :data:`PROBE_LINES` data lines that fall in this run."""

    chunk: RawChunk
    bad_lines: np.ndarray
    reasons: list[str]
    good_in_probe: int


def parse_run(buf: np.ndarray, path: Path, layout: Layout, data_index: int, keep: int) -> ParsedRun:
    """Parse one padded run of lines whose first line is data line ``data_index`` of ``path``.

    A pure function of its arguments, so runs can be parsed in worker processes and taken in
    file order by :class:`RunReader`, with the same result as one process reading them in turn.
    """
    lines = _split_lines(buf, ord(layout.sep), layout.n_fields)
    labels, dense, sparse, bad_values = _parse(lines, layout)
    ok = np.zeros(len(lines.good), dtype=bool)
    ok[lines.good] = ~bad_values
    bad_at = np.flatnonzero(~ok)
    reasons = [explain(buf[lines.line_start[i]:lines.line_end[i]].tobytes(), layout) or "malformed"
               for i in bad_at[:max(keep, 1)]]
    good_in_probe = int(ok[:max(PROBE_LINES - data_index, 0)].sum())
    rows = np.flatnonzero(ok).astype(np.int64) + data_index
    if len(rows) < len(labels):
        keep_rows = ok[lines.good]
        labels, dense, sparse = labels[keep_rows], take_rows(dense, keep_rows), take_rows(sparse, keep_rows)
    first_line = 2 if layout.header else 1
    chunk = RawChunk(path, data_index, len(ok), rows, labels, dense, sparse)
    return ParsedRun(chunk, bad_at + data_index + first_line, reasons, good_in_probe)


def iter_runs(path: str | os.PathLike[str], layout: Layout, chunk_rows: int) -> Iterator[tuple[np.ndarray, int]]:
    """``(run, data_index)``: the padded runs of ``chunk_rows`` lines of ``path`` (the header cut
    off the first) and the data-line index of each run's first line, read in order."""
    if chunk_rows < 1:
        raise RawInputError(f"chunk_rows must be at least 1, got {chunk_rows}")
    path = Path(path)
    data_index = 0
    skip_header = layout.header
    for buf in _line_chunks(path, chunk_rows):
        lines = chunk_rows  # every run but the last holds chunk_rows lines; the last is not followed
        if skip_header:
            header_end = _PAD + int(np.argmax(buf[_PAD:] == _NL)) + 1
            buf, skip_header, lines = buf[header_end - _PAD:], False, chunk_rows - 1
            if buf.size == _PAD:
                continue
        yield buf, data_index
        del buf
        data_index += lines


class RunReader:
    """The parent's side of reading one file run by run: it takes the :class:`ParsedRun` s in file
    order (:meth:`take`), counts malformed lines into ``malformed`` (and applies its policy),
    refuses a file whose first :data:`PROBE_LINES` lines are all malformed, and at the end
    (:meth:`finish`) a file without data lines."""

    def __init__(self, path: str | os.PathLike[str], layout: Layout, malformed: MalformedLog) -> None:
        self.path = Path(path)
        self.layout = layout
        self.malformed = malformed
        self.data_lines = 0
        self.good_in_probe = 0
        self.first_problem = ""

    def take(self, run: ParsedRun) -> RawChunk:
        chunk = run.chunk
        self.malformed.rows_read += chunk.n_lines
        if len(run.bad_lines) and not self.first_problem:
            self.first_problem = f"{self.path}:{int(run.bad_lines[0])}: {run.reasons[0]}"
        self.malformed.record(self.path, run.bad_lines, run.reasons.__getitem__)
        if chunk.first_line < PROBE_LINES:
            self.good_in_probe += run.good_in_probe
            if chunk.first_line + chunk.n_lines >= PROBE_LINES and self.good_in_probe == 0:
                self._refuse(f"the first {PROBE_LINES} lines")
        self.data_lines = chunk.first_line + chunk.n_lines
        return chunk

    def finish(self) -> None:
        if self.data_lines == 0:
            what = "after the header " if self.layout.header else ""
            raise RawInputError(f"{self.path}: no data lines {what}(expected Criteo rows)")
        if self.data_lines < PROBE_LINES and self.good_in_probe == 0:
            self._refuse(f"its {self.data_lines} line(s)")

    def _refuse(self, which: str) -> None:
        raise MalformedInputError(
            f"{self.path}: none of {which} is a valid Criteo row ({self.layout.describe()}); "
            f"first: {self.first_problem}"
        )


def iter_raw_chunks(
    path: str | os.PathLike[str],
    layout: Layout,
    chunk_rows: int,
    malformed: MalformedLog,
) -> Iterator[RawChunk]:
    """The valid rows of ``path``, ``chunk_rows`` lines at a time (see :class:`RawChunk`), parsed
    in this process (:mod:`recforge.data.criteo.workers` parses runs in worker processes).

    Malformed lines go to ``malformed``; a file whose first :data:`PROBE_LINES` lines (or all,
    if fewer) are all malformed raises :class:`MalformedInputError` at once, whatever the policy.
    A header (``layout.header``) is skipped. Memory: one run of lines and its arrays (drop each
    chunk before asking for the next to keep it at one).
    """
    reader = RunReader(path, layout, malformed)
    for buf, data_index in iter_runs(path, layout, chunk_rows):
        chunk = reader.take(parse_run(buf, reader.path, layout, data_index, malformed.keep))
        del buf
        yield chunk
        del chunk
    reader.finish()

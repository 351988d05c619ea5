#!/usr/bin/env python
"""Peak memory and speed of the raw Criteo conversion: memory follows the chunk, not the file.

Writes a raw Criteo text file of ``--rows`` rows (default 10**7, about 2.4 GB; valid lines of the
real layout: label, 13 integers, 26 8-digit hex values, tab-separated, some fields empty) in
chunks, then converts it once per ``--chunk-rows`` value, each time in a fresh child process
(``python -m recforge.data.criteo.prepare``, one thread), and prints per run:

* peak RSS of the child (``ru_maxrss`` from ``os.wait4``), and the same for a child that only
  imports the converter (the interpreter, numpy, pyarrow: the part no chunk size changes). The
  file is written by another child, since Linux counts the parent's resident memory at the fork
  into a child's ``ru_maxrss``;
* wall seconds and rows/s from the conversion's own clock (``conversion.elapsed_seconds`` in the
  metadata), and rows per CPU second of the child (user + system): the figure that load from
  other jobs on a shared box disturbs least.

The generated file and the prepared directories are deleted at the end (``--keep`` keeps them).
``--malloc-mmap-threshold 131072`` pins glibc's mmap threshold in the children (freed large
arrays are then returned at once, so the peak is closer to the live arrays; by default glibc
raises the threshold after the first large free and keeps freed chunks on its heap).

    python benchmarks/criteo_prepare_memory.py                                  # 10**7 rows
    python benchmarks/criteo_prepare_memory.py --rows 1000000 --chunk-rows 20000,200000,1000000
    python benchmarks/criteo_prepare_memory.py --dir /tmp/bench --keep        # then --reuse

A measurement tool: nothing here asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HEX_CHARS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
TAB, NL = ord("\t"), ord("\n")
# Per feature: how often it is missing, and (dense) the log-scale of its values or
# (categorical) its vocabulary size: roughly Criteo's shapes, enough to exercise every path.
DENSE_MISSING = [0.45, 0.0, 0.2, 0.2, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.76, 0.2]
DENSE_SCALE = [1.0, 2.5, 2.0, 1.5, 8.0, 3.5, 2.0, 2.0, 3.0, 0.5, 1.0, 1.0, 2.0]
CAT_MISSING = [0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0,
               0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.03]
CAT_VOCAB = [1460, 583, 10_131_227, 2_202_608, 305, 24, 12_517, 633, 3, 93_145, 5_683, 8_351_593,
             3_194, 27, 14_992, 5_461_306, 10, 5_652, 2_173, 4, 7_046_547, 18, 15, 286_181, 105, 142_572]


def _mix32(x: np.ndarray) -> np.ndarray:
    """A scrambling of uint64 ids to 32-bit values (SplitMix64's finaliser, top bits)."""
    z = x.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(32)).astype(np.int64)


def generate_lines(n: int, rng: np.random.Generator) -> bytes:
    """``n`` valid raw Criteo lines, built as one byte array (no Python loop over rows)."""
    labels = (rng.random(n) < 0.26).astype(np.int64)
    dense, dense_len = [], []
    for j in range(13):
        values = np.floor(np.expm1(rng.random(n) * DENSE_SCALE[j] * 2)).astype(np.int64)
        if j == 1:  # I2 holds a few negatives in the real data
            values -= rng.random(n) < 0.05
        missing = rng.random(n) < DENSE_MISSING[j]
        digits = np.where(values == 0, 1, np.floor(np.log10(np.maximum(np.abs(values), 1))).astype(np.int64) + 1)
        dense.append((values, missing))
        dense_len.append(np.where(missing, 0, digits + (values < 0)))
    cats, cat_len = [], []
    for j in range(26):
        ids = np.floor(CAT_VOCAB[j] * rng.random(n) ** 3).astype(np.int64)  # skewed, like real counts
        missing = rng.random(n) < CAT_MISSING[j]
        cats.append((_mix32(ids + (j << 40)), missing))
        cat_len.append(np.where(missing, 0, 8))
    lengths = np.stack([np.ones(n, dtype=np.int64), *dense_len, *cat_len], axis=1)
    line_len = lengths.sum(axis=1) + 40  # 39 tabs and the line break
    line_start = np.concatenate([[0], np.cumsum(line_len)[:-1]])
    field_start = line_start[:, None] + np.concatenate(
        [np.zeros((n, 1), dtype=np.int64), np.cumsum(lengths[:, :-1], axis=1)], axis=1) + np.arange(40)
    out = np.full(int(line_len.sum()), TAB, dtype=np.uint8)
    out[line_start + line_len - 1] = NL
    out[field_start[:, 0]] = ord("0") + labels
    for j, (values, missing) in enumerate(dense):
        start, length = field_start[:, 1 + j], dense_len[j]
        negative = ~missing & (values < 0)
        out[start[negative]] = ord("-")
        magnitude = np.abs(values)
        for k in range(int(length.max(initial=0))):
            at = ~missing & (k < length - negative)
            out[(start + length - 1 - k)[at]] = ord("0") + (magnitude[at] // 10**k) % 10
    for j, (values, missing) in enumerate(cats):
        start, present = field_start[:, 14 + j], ~missing
        for k in range(8):
            out[(start + k)[present]] = HEX_CHARS[(values[present] >> (4 * (7 - k))) & 15]
    return out.tobytes()


def write_raw(path: Path, rows: int, seed: int, chunk: int = 500_000) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as handle:
        for start in range(0, rows, chunk):
            handle.write(generate_lines(min(chunk, rows - start), rng))


def _child_env(mmap_threshold: int | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def run_child(args: list[str], env: dict[str, str]) -> tuple[int, float, float, float]:
    """(exit status, peak RSS MiB, wall s, CPU s) of ``python args``."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode:
        sys.stderr.write(output.decode(errors="replace")[-3000:])
    return proc.returncode, usage.ru_maxrss / 1024, wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10**7)
    parser.add_argument("--chunk-rows", default="50000,500000", help="comma-separated chunk sizes")
    parser.add_argument("--max-ind-range", type=int, default=10_000_000)
    parser.add_argument("--split", default="kaggle7")
    parser.add_argument("--dir", help="where to write (default: a new temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc-mmap-threshold", type=int)
    parser.add_argument("--keep", action="store_true", help="keep the generated file and outputs")
    parser.add_argument("--reuse", action="store_true", help="use DIR/train.txt if it is there (with --dir)")
    parser.add_argument("--write", help=argparse.SUPPRESS)  # internal: only write the raw file
    args = parser.parse_args()

    if args.write:
        write_raw(Path(args.write), args.rows, args.seed)
        return
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="criteo_prepare_bench."))
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "train.txt"
    env = _child_env(args.malloc_mmap_threshold)
    try:
        started = time.perf_counter()
        if not (args.reuse and raw.is_file()):
            # In a child: Linux counts the parent's resident memory at fork into a child's
            # ru_maxrss, so this process stays small while the children are measured.
            subprocess.run([sys.executable, __file__, "--write", str(raw), "--rows", str(args.rows),
                            "--seed", str(args.seed)], env=env, check=True)
        size = raw.stat().st_size
        print(f"raw file {raw}: {args.rows:,} rows, {size / 1e9:.2f} GB ({size / args.rows:.0f} bytes/row), "
              f"written in {time.perf_counter() - started:.0f} s")
        _, base_rss, _, _ = run_child(["-c", "import recforge.data.criteo.prepare"], env)
        print(f"baseline (imports only): peak RSS {base_rss:.0f} MiB")
        results = []
        for chunk_rows in [int(c) for c in args.chunk_rows.split(",")]:
            out = work / f"prepared_{chunk_rows}"
            status, rss, wall, cpu = run_child(
                ["-m", "recforge.data.criteo.prepare", "--raw", str(raw), "--out", str(out), "--split", args.split,
                 "--max-ind-range", str(args.max_ind_range), "--chunk-rows", str(chunk_rows)], env)
            if status:
                print(f"chunk_rows={chunk_rows}: the conversion failed (exit {status})")
                continue
            meta = json.loads((out / "metadata.json").read_text())
            elapsed = meta["conversion"]["elapsed_seconds"]
            rows = meta["conversion"]["rows_read"]
            result = {"chunk_rows": chunk_rows, "rows": rows, "file_bytes": size, "peak_rss_mib": round(rss, 1),
                      "peak_above_baseline_mib": round(rss - base_rss, 1), "elapsed_s": elapsed,
                      "rows_per_s": round(rows / elapsed), "child_wall_s": round(wall, 1),
                      "child_cpu_s": round(cpu, 1), "rows_per_cpu_s": round(rows / cpu),
                      "load_avg": os.getloadavg()[0]}
            results.append(result)
            print(f"chunk_rows={chunk_rows:>9,}  peak RSS {rss:7.0f} MiB ({rss - base_rss:6.0f} above baseline)  "
                  f"{elapsed:6.1f} s  {rows / elapsed:9,.0f} rows/s  {rows / cpu:9,.0f} rows/CPU-s  "
                  f"load {result['load_avg']:.1f}")
            if not args.keep:
                shutil.rmtree(out)
        print(json.dumps({"baseline_rss_mib": round(base_rss, 1), "results": results}))
    finally:
        if args.keep:
            pass
        elif args.dir:
            raw.unlink(missing_ok=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

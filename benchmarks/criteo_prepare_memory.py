#!/usr/bin/env python
"""Speed and peak memory of the raw Criteo conversion at full size: memory follows the chunk, not the file.

For each ``--fractions`` value, writes Criteo Kaggle's ``train.txt`` at that share of its
45,840,617 rows with the full-size generator (:mod:`recforge.data.criteo.fullsize`: the real
format, Kaggle's table sizes scaled by the fraction), then converts it once per
(``--chunk-rows``, ``--workers``) pair, each time in a fresh child process
(``python -m recforge.data.criteo.prepare``), and prints per run:

* peak RSS of the conversion: the largest ``ru_maxrss`` of the child and of its worker
  processes (``os.wait4`` and ``RUSAGE_CHILDREN`` of the child itself), and the same for a
  child that only imports the converter (the interpreter, numpy, pyarrow: the part no chunk size
  changes). The file is written by another child, since Linux counts the parent's resident
  memory at the fork into a child's ``ru_maxrss``;
* wall seconds and rows/s from the conversion's own clock (``conversion.elapsed_seconds``), and
  rows per CPU second of the child and its workers (user + system): the figure that load from
  other jobs on a shared box disturbs least;
* the vocabulary (``--categorical vocab``): distinct values kept, the one thing that grows with
  the file.

``--categorical vocab --split kaggle7`` are conf/data/criteo_kaggle.yaml's settings (the
reference's per-feature ids); ``hash --max-ind-range 10000000`` is the Terabyte setting. The
generated file is deleted after its conversions unless ``--keep``; the prepared directories always.
``--malloc-mmap-threshold 131072`` pins glibc's mmap threshold in the children (freed large
arrays are then returned at once, so the peak is closer to the live arrays).

    python benchmarks/criteo_prepare_memory.py --fractions 0.01                 # ~460k rows
    python benchmarks/criteo_prepare_memory.py --fractions 0.125,0.25,0.5,1 --categorical vocab \\
        --workers 0,2 --dir /big/scratch
    python benchmarks/criteo_prepare_memory.py --fractions 0.125 --chunk-rows 20000,100000,500000

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

# Run as a child: the conversion, then its own and its workers' peak RSS and CPU on stdout's last line.
_MEASURED = """
import resource, runpy, sys, json
sys.argv = ["recforge.data.criteo.prepare"] + sys.argv[1:]
try:
    runpy.run_module("recforge.data.criteo.prepare", run_name="__main__")
except SystemExit as stop:
    if stop.code:
        raise
workers = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"workers_maxrss_kib": workers.ru_maxrss, "workers_cpu_s": workers.ru_utime + workers.ru_stime}))
"""


def _child_env(mmap_threshold: int | None, threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "OPENBLAS_NUM_THREADS": str(threads)}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def run_child(args: list[str], env: dict[str, str]) -> tuple[int, float, float, float, str]:
    """(exit status, peak RSS MiB, wall s, CPU s, output) of ``python args``."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if code:
        sys.stderr.write(output[-3000:])
    return code, usage.ru_maxrss / 1024, wall, usage.ru_utime + usage.ru_stime, output


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fractions", default="0.01", help="comma-separated shares of Kaggle's rows")
    parser.add_argument("--chunk-rows", default="100000", help="comma-separated chunk sizes")
    parser.add_argument("--workers", default="0", help="comma-separated --workers values")
    parser.add_argument("--categorical", choices=("vocab", "hash"), default="vocab")
    parser.add_argument("--max-ind-range", type=int, default=10_000_000, help="with --categorical hash")
    parser.add_argument("--split", default="kaggle7")
    parser.add_argument("--threads", type=int, default=2, help="OMP/MKL threads of the children")
    parser.add_argument("--dir", help="where to write (default: a new temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc-mmap-threshold", type=int)
    parser.add_argument("--no-spill", action="store_true",
                        help="vocab: convert with --no-spill (parse the text twice, no temporary file)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--reuse", action="store_true", help="use DIR/<fraction>/train.txt if it is there")
    args = parser.parse_args()

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="criteo_prepare_bench."))
    work.mkdir(parents=True, exist_ok=True)
    env = _child_env(args.malloc_mmap_threshold, args.threads)
    _, base_rss, _, _, _ = run_child(["-c", "import recforge.data.criteo.prepare"], env)
    print(f"baseline (imports only): peak RSS {base_rss:.0f} MiB; threads {args.threads}")
    results = []
    try:
        for fraction in [float(f) for f in args.fractions.split(",")]:
            folder = work / f"kaggle_{fraction:g}"
            raw = folder / "train.txt"
            if not (args.reuse and raw.is_file()):
                generate = ("import json, sys; from pathlib import Path; "
                            "from recforge.data.criteo.fullsize import generate_kaggle; "
                            "print(json.dumps(generate_kaggle(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))))")
                code, rss, wall, cpu, out = run_child(["-c", generate, str(folder), str(fraction), str(args.seed)], env)
                if code:
                    raise SystemExit(f"generating fraction {fraction} failed")
                summary = json.loads(out.strip().splitlines()[-1])
                print(f"fraction {fraction:g}: generated {summary['rows']:,} rows, {raw.stat().st_size / 1e9:.2f} GB "
                      f"in {summary['seconds']:.0f} s ({summary['rows'] / summary['seconds']:,.0f} rows/s, "
                      f"peak RSS {rss:.0f} MiB, CPU {cpu:.0f} s)")
            size = raw.stat().st_size
            for chunk_rows in _ints(args.chunk_rows):
                for workers in _ints(args.workers):
                    out_dir = folder / f"prepared_{chunk_rows}_{workers}"
                    command = ["-c", _MEASURED, "--raw", str(raw), "--out", str(out_dir), "--split", args.split,
                               "--categorical", args.categorical, "--chunk-rows", str(chunk_rows),
                               "--workers", str(workers)]
                    if args.categorical == "hash":
                        command += ["--max-ind-range", str(args.max_ind_range)]
                    if args.no_spill:
                        command += ["--no-spill"]
                    status, rss, wall, cpu, output = run_child(command, env)
                    if status:
                        print(f"fraction {fraction:g} chunk_rows={chunk_rows} workers={workers}: failed (exit {status})")
                        continue
                    pool = json.loads(output.strip().splitlines()[-1])
                    peak = max(rss, pool["workers_maxrss_kib"] / 1024)
                    meta = json.loads((out_dir / "metadata.json").read_text())
                    elapsed = meta["conversion"]["elapsed_seconds"]
                    rows = meta["conversion"]["rows_read"]
                    vocab = meta["categorical"].get("vocab_sizes")
                    result = {"fraction": fraction, "rows": rows, "file_bytes": size, "chunk_rows": chunk_rows,
                              "workers": workers, "categorical": args.categorical, "spill": not args.no_spill,
                              "peak_rss_mib": round(rss, 1), "workers_peak_rss_mib": round(pool["workers_maxrss_kib"] / 1024, 1),
                              "peak_above_baseline_mib": round(peak - base_rss, 1), "elapsed_s": elapsed,
                              "rows_per_s": round(rows / elapsed), "child_wall_s": round(wall, 1),
                              "cpu_s": round(cpu, 1), "rows_per_cpu_s": round(rows / cpu),
                              "vocabulary_values": sum(vocab) if vocab else None,
                              "load_avg": round(os.getloadavg()[0], 1)}
                    results.append(result)
                    print(f"fraction {fraction:<6g} {rows:>11,} rows  chunk {chunk_rows:>7,}  workers {workers}  "
                          f"peak RSS {rss:6.0f} MiB (workers {result['workers_peak_rss_mib']:5.0f})  "
                          f"{elapsed:7.1f} s  {rows / elapsed:9,.0f} rows/s  {rows / cpu:9,.0f} rows/CPU-s"
                          + (f"  vocabulary {sum(vocab):,}" if vocab else "") + f"  load {result['load_avg']}",
                          flush=True)
                    shutil.rmtree(out_dir)
            if not args.keep:
                raw.unlink()
        print(json.dumps({"baseline_rss_mib": round(base_rss, 1), "results": results}))
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

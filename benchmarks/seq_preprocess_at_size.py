"""Sequence preprocessing at full size: wall time, CPU time and peak RSS of the real command.

    python benchmarks/seq_preprocess_at_size.py {ml-20m,amzn-books} --raw DIR --out DIR \
        [--repeat N] [--src SRC_DIR]

runs ``python -m recforge.data.sequences.preprocess DATASET --raw DIR --out OUT --force`` N
times in a fresh process (``--src``: another checkout's ``src`` directory, e.g. to measure the code
before a change), with OMP_NUM_THREADS=1, and prints per run the wall seconds, the CPU seconds
(user + system of the process and its threads) and the peak RSS the kernel reports for it, with
the load average before and after; then the minimum and the median. Make the raw data with
``benchmarks/fullsize_data.py``. Issue 17's targets on a 2-core, 24 GiB machine: ml-20m under
2 minutes and 3 GiB, Books under 5 minutes and 6 GiB.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_once(dataset: str, raw: Path, out: Path, src: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)}
    command = [sys.executable, "-m", "recforge.data.sequences.preprocess", dataset, "--raw", str(raw),
               "--out", str(out), "--force"]
    before = load()
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(command, env=env, stdout=out_file, stderr=err_file)
        # wait4 gives this child's own rusage: its CPU time and its peak RSS (ru_maxrss, KiB)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read().decode(), err_file.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr}")
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024), "load_before": before,
            "load_after": load(), "result": stdout.strip().split("  ", 1)[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/seq_preprocess_at_size.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=("ml-1m", "ml-20m", "amzn-books"))
    parser.add_argument("--raw", required=True, type=Path, help="the raw files' directory")
    parser.add_argument("--out", required=True, type=Path, help="the prepared directory to write")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the src directory to import")
    args = parser.parse_args(argv)
    runs = []
    for i in range(args.repeat):
        run = run_once(args.dataset, args.raw, args.out, args.src.resolve())
        runs.append(run)
        print(f"run {i + 1}: wall {run['wall_s']:.2f} s, CPU {run['cpu_s']:.2f} s, peak RSS "
              f"{run['peak_rss_mib']:,} MiB, load {run['load_before']} -> {run['load_after']}; "
              f"{run['result']}", flush=True)
    summary = {key: {"min": min(r[key] for r in runs), "median": round(statistics.median(r[key] for r in runs), 2)}
               for key in ("wall_s", "cpu_s", "peak_rss_mib")}
    print(" ".join(f"{key} min {v['min']} median {v['median']};" for key, v in summary.items()))
    print(json.dumps({"dataset": args.dataset, "raw": str(args.raw), "src": str(args.src),
                      "runs": runs, "summary": summary}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

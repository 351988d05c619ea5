"""A run beside a CPU-bound job: how much of its quiet speed it keeps, by thread setting (issue 21).

Runs ``python src/train.py`` (the default experiment unless ``--override`` says otherwise) in a
fresh process, quiet and then beside ``--busy`` processes that spin on a CPU each, for each
``--threads`` setting (``auto``: recforge's default, which counts the free CPUs at start; a number:
a fixed count, e.g. every CPU, what PyTorch takes by itself). Settings and conditions alternate
within each round. Reads training events/s from the run's metrics.json (timed by the throughput
callback over the training batches only) and prints, per setting, min / median over rounds and
the busy-to-quiet ratio of the medians.

    python benchmarks/busy_machine.py --threads auto,2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"
RUN = ["trainer.max_epochs=1", "trainer.limit_train_batches=600", "trainer.limit_val_batches=2",
       "trainer.limit_test_batches=2", "callbacks.progress_bar.refresh_rate=0", "logger=csv"]


def one_run(threads: str, overrides: list[str], work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "_RECFORGE_THREADS_SET")}
    done = subprocess.run(
        [sys.executable, str(REPO / "src" / "train.py"), *RUN, *overrides, f"extras.threads={threads}",
         f"paths.log_dir={out}", f"paths.data_dir={work / 'data'}"],
        env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"train.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    chosen = [line.split("] - ", 1)[-1] for line in done.stdout.splitlines() + done.stderr.splitlines()
              if "] - threads: " in line]
    (metrics,) = out.glob("train/runs/*/metrics.json")
    rate = float(json.loads(metrics.read_text())["train/events_per_s"])
    print(f"#   {rate:10,.0f} events/s   {chosen[0] if chosen else ''}", flush=True)
    return rate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="auto,2", help="extras.threads settings, comma-separated")
    parser.add_argument("--busy", type=int, default=1, help="CPU-spinning processes beside the busy runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    settings = args.threads.split(",")
    rates: dict[tuple[str, str], list[float]] = {(s, c): [] for s in settings for c in ("quiet", "busy")}
    with tempfile.TemporaryDirectory(prefix="busy_machine.") as tmp:
        work = Path(tmp)
        one_run(settings[0], args.override, work)  # generates the data once, untimed
        for round_ in range(args.rounds):
            for condition in ("quiet", "busy"):
                spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy if condition == "busy" else 0)]
                try:
                    for setting in settings:
                        print(f"# round {round_} {condition} extras.threads={setting}", flush=True)
                        rates[setting, condition].append(one_run(setting, args.override, work))
                finally:
                    for spinner in spinners:
                        spinner.kill()
                        spinner.wait()
    print(f"\n{os.cpu_count()} CPUs, {args.busy} spinning process(es) beside the busy runs, {args.rounds} rounds")
    print("| extras.threads | quiet events/s min / median | busy min / median | busy / quiet (medians) |")
    print("|---|---:|---:|---:|")
    for setting in settings:
        quiet, busy = rates[setting, "quiet"], rates[setting, "busy"]
        print(f"| {setting} | {min(quiet):,.0f} / {statistics.median(quiet):,.0f} | {min(busy):,.0f} / "
              f"{statistics.median(busy):,.0f} | {statistics.median(busy) / statistics.median(quiet):.2f} |")
    print(json.dumps({"benchmark": "busy_machine", "cpus": os.cpu_count(), "busy": args.busy,
                      "overrides": args.override, "rates": {f"{s}/{c}": v for (s, c), v in rates.items()}}))


if __name__ == "__main__":
    main()

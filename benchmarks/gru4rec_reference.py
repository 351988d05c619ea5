"""Whole GRU4Rec runs, recforge against the official PyTorch code, on the same data and machine.

Each run is one process from start to exit, as a user types it: load the training file, train
every epoch (negative-sample store fills included), evaluate the test file against the whole
catalogue. Arms, run one after another in rotation so that load from other jobs hits them alike:

* ``official``: ``run.py`` of hidasib/GRU4Rec_PyTorch_Official (not shipped with recforge: pass
  ``--official-dir``, a checkout or exported tree) with the parameters of recforge's preset,
  ``-d cpu``, cut-offs 1, 5, 10, 20. It is copied to a temporary directory and given the two edits
  it needs under numpy 2 and pandas 3, which leave its arithmetic alone (the init's sigma as a
  Python float, so that numpy keeps float32; ``.values`` on a pandas Series in the logq setup).
  ``torch.manual_seed(seed)`` before it starts seeds its sampling and dropout (its weights are
  drawn from numpy's seed 42 in its compatibility mode, whatever the seed).
* ``exact``: ``src/train.py experiment=gru4rec_rsc15_<config> seed=<seed>``, the default step,
  which retraces the official code bit for bit given the same draws.
* ``fast``: the same with ``task.fast_step=true``.

Every arm runs with ``--threads`` OpenMP/MKL/torch threads. Printed per config: wall seconds of
each run, R@20 and MRR@20 of each run (the seed spread), the median wall time and the
official / arm ratio of the medians (above 1: faster than the official code), the median of the
per-seed ratios (each run against the official run of its own rotation), and the CPU seconds
of each run (user + system of its process and children, which leave out time spent waiting for
a core) with their ratio of medians. On a shared machine other tenants' load moves wall time by a
quarter and more from one run to the next. On the 2-core box of 2026-12-07 the CPU seconds moved
with it (about 1.9x the wall time for both codes at 2 threads): the runs were slower per
instruction (shared caches and memory), not kept waiting. It asserts nothing.

    python benchmarks/gru4rec_reference.py --official-dir /path/to/GRU4Rec_PyTorch_Official \\
        --configs xe,bprmax --seeds 0,1,2 --threads 2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recforge.utils.allocator import USER_VARIABLES, keep_environment

REPO_ROOT = Path(__file__).resolve().parent.parent
OFFICIAL_URL = "https://github.com/hidasib/GRU4Rec_PyTorch_Official"
SAMPLE = REPO_ROOT.parent / "shared" / "data" / "yoochoose"

# recforge's presets (conf/experiment/gru4rec_rsc15_<config>.yaml) in run.py's parameter string
OFFICIAL_PARAMS = {
    "xe": "loss=cross-entropy,constrained_embedding=True,embedding=0,elu_param=0,layers=100,"
          "n_epochs={epochs},batch_size=32,dropout_p_embed=0.0,dropout_p_hidden=0.4,learning_rate=0.2,"
          "momentum=0.2,n_sample=2048,sample_alpha=0.5,bpreg=0.0,logq=1.0",
    "bprmax": "loss=bpr-max,constrained_embedding=True,embedding=0,elu_param=0.5,layers=100,"
              "n_epochs={epochs},batch_size=32,dropout_p_embed=0.0,dropout_p_hidden=0.0,learning_rate=0.2,"
              "momentum=0.1,n_sample=2048,sample_alpha=0.0,bpreg=0.5,logq=0.0",
}
# (file, text in the official code, replacement): numpy 2 / pandas 3 compatibility only
COMPAT_EDITS = [
    ("gru4rec_pytorch.py", "sigma = np.sqrt(6.0 / (shape[0] + shape[1]))",
     "sigma = float(np.sqrt(6.0 / (shape[0] + shape[1])))"),
    ("gru4rec_pytorch.py", "torch.tensor(pop[self.data_iterator.itemidmap.index.values], dtype",
     "torch.tensor(pop[self.data_iterator.itemidmap.index.values].values, dtype"),
]
ARMS = ("official", "exact", "fast")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--official-dir", type=Path, required=True, help=f"a tree of {OFFICIAL_URL}")
    p.add_argument("--train", type=Path, default=SAMPLE / "yoochoose-clicks-100k_train_full.txt")
    p.add_argument("--test", type=Path, default=SAMPLE / "yoochoose-clicks-100k_test.txt")
    p.add_argument("--configs", default="xe,bprmax", help="comma-separated, of xe, bprmax")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=10, help="the presets' 10 unless set")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="glibc allocator settings for every arm: keep (recforge's default extras.malloc=keep, set "
                        "through the environment) or glibc's defaults (default: keep)")
    p.add_argument("--work-dir", type=Path, default=None, help="run folders (default: a temporary dir)")
    p.add_argument("--json", type=Path, default=None, help="also write every run as JSON here")
    args = p.parse_args(argv)
    for name in ("train", "test"):
        if not getattr(args, name).is_file():
            p.error(f"--{name} {getattr(args, name)}: no such file")
    if not (args.official_dir / "run.py").is_file():
        p.error(f"--official-dir {args.official_dir}: no run.py there (expected a tree of {OFFICIAL_URL})")
    args.configs = args.configs.split(",")
    args.arms = args.arms.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    for config in args.configs:
        if config not in OFFICIAL_PARAMS:
            p.error(f"--configs: {config!r} is not one of {', '.join(OFFICIAL_PARAMS)}")
    for arm in args.arms:
        if arm not in ARMS:
            p.error(f"--arms: {arm!r} is not one of {', '.join(ARMS)}")
    return args


def prepare_official(source: Path, dest: Path) -> Path:
    """A copy of the official tree with the compatibility edits (each must apply exactly once)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "img"))
    for name, old, new in COMPAT_EDITS:
        path = dest / name
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{path}: expected one occurrence of {old!r} (another version of the official code?)")
        path.write_text(text.replace(old, new))
    return dest


def _env(threads: int, malloc: str) -> dict:
    # the same allocator for both arms (issue 22): recforge runs with extras.malloc=default, so
    # the environment decides for it as for the official code
    env = {k: v for k, v in os.environ.items() if k not in USER_VARIABLES}
    if malloc == "keep":
        env.update(keep_environment())
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


@contextlib.contextmanager
def _clocked():
    """Fills the yielded dict with ``wall_s`` and ``cpu_s`` of the block: the CPU seconds (user +
    system) of the child processes it ran and waited for."""
    clock: dict = {}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    yield clock
    clock["wall_s"] = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    clock["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_official(args, tree: Path, config: str, seed: int, out: Path) -> dict:
    params = OFFICIAL_PARAMS[config].format(epochs=args.epochs)
    driver = (
        "import sys, runpy, torch\n"
        f"torch.set_num_threads({args.threads}); torch.manual_seed({seed})\n"
        f"sys.argv = ['run.py', {str(args.train)!r}, '-ps', {params!r}, '-t', {str(args.test)!r},"
        " '-m', '1', '5', '10', '20', '-d', 'cpu']\n"
        "runpy.run_path('run.py', run_name='__main__')\n"
    )
    with _clocked() as clock:
        proc = subprocess.run([sys.executable, "-c", driver], cwd=tree, env=_env(args.threads, args.malloc),
                              capture_output=True, text=True)
    (out / "official.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"official run failed (rc {proc.returncode}), see {out / 'official.log'}")
    found = re.search(r"Recall@20: ([0-9.]+) MRR@20: ([0-9.]+)", proc.stdout)
    if not found:
        raise SystemExit(f"official run printed no Recall@20 line, see {out / 'official.log'}")
    return {**clock, "recall@20": float(found.group(1)), "mrr@20": float(found.group(2))}


def run_recforge(args, arm: str, config: str, seed: int, out: Path) -> dict:
    command = [
        sys.executable, "src/train.py", f"experiment=gru4rec_rsc15_{config}",
        f"data.train_path={args.train}", f"data.test_path={args.test}", f"seed={seed}",
        f"trainer.max_epochs={args.epochs}", f"task.fast_step={str(arm == 'fast').lower()}",
        "logger=csv", "extras.print_config=false", "extras.malloc=default", f"hydra.run.dir={out}",
    ]
    with _clocked() as clock:
        proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(args.threads, args.malloc), capture_output=True,
                              text=True)
    (out / "recforge.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"recforge run failed (rc {proc.returncode}), see {out / 'recforge.log'}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {**clock, "recall@20": metrics["test/recall@20"], "mrr@20": metrics["test/mrr@20"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gru4rec-ref-")) if args.work_dir is None else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    tree = prepare_official(args.official_dir, work / "official") if "official" in args.arms else None
    print(f"# {len(args.configs)} configs x {len(args.seeds)} seeds x arms {', '.join(args.arms)}; "
          f"{args.epochs} epochs, {args.threads} threads, load average {os.getloadavg()}", flush=True)
    runs = []
    for config in args.configs:
        for seed in args.seeds:
            for arm in args.arms:
                out = work / f"{config}-{seed}-{arm}"
                out.mkdir(parents=True, exist_ok=True)
                result = (run_official(args, tree, config, seed, out) if arm == "official"
                          else run_recforge(args, arm, config, seed, out))
                runs.append({"config": config, "seed": seed, "arm": arm, **result})
                print(f"{config} seed {seed} {arm:8s} {result['wall_s']:7.1f} s (CPU {result['cpu_s']:6.1f} s)"
                      f"  R@20 {result['recall@20']:.4f}  MRR@20 {result['mrr@20']:.4f}", flush=True)
    print(f"# load average at end {os.getloadavg()}")
    print("\n| config | arm | wall s per run | median s | official / arm | per-seed ratios (median) "
          "| CPU s per run | official / arm, CPU | R@20 per seed | MRR@20 per seed |")
    print("|---|---|---|---:|---:|---|---|---:|---|---|")
    for config in args.configs:
        for arm in args.arms:
            print(_table_row(runs, config, arm))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "malloc": args.malloc, "epochs": args.epochs, "runs": runs}, indent=1))
    return 0


def _table_row(runs: list[dict], config: str, arm: str) -> str:
    mine = {r["seed"]: r for r in runs if r["config"] == config and r["arm"] == arm}
    official = {r["seed"]: r for r in runs if r["config"] == config and r["arm"] == "official"}

    def median(key: str, of: dict) -> float:
        return statistics.median(r[key] for r in of.values())

    def listed(key: str, fmt: str) -> str:
        return ", ".join(format(r[key], fmt) for r in mine.values())

    ratio = cpu_ratio = per_seed = "-"
    if official:
        ratio = f"{median('wall_s', official) / median('wall_s', mine):.2f}x"
        cpu_ratio = f"{median('cpu_s', official) / median('cpu_s', mine):.2f}x"
    if official and arm != "official":
        pairs = [official[seed]["wall_s"] / r["wall_s"] for seed, r in mine.items() if seed in official]
        per_seed = f"{', '.join(f'{x:.2f}' for x in pairs)} ({statistics.median(pairs):.2f}x)"
    return (f"| {config} | {arm} | {listed('wall_s', '.1f')} | {median('wall_s', mine):.1f} | {ratio} | {per_seed} "
            f"| {listed('cpu_s', '.1f')} | {cpu_ratio} | {listed('recall@20', '.4f')} | {listed('mrr@20', '.4f')} |")


if __name__ == "__main__":
    sys.exit(main())

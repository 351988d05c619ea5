#!/usr/bin/env python
"""How recforge's cost grows with the data: the published configurations at fractions of their real size.

For one dataset and each ``--fractions`` value, through the project's own commands, each a child
process whose wall time and peak memory are measured:

1. ``generate``: ``benchmarks/fullsize_data.py DATASET --fraction F`` writes the raw files (kept
   and reused by later runs with the same seed; ``--regenerate`` to redo);
2. ``prepare``: the dataset's preparation command on those files, into a fresh directory
   (``python -m recforge.data.sequences.preprocess`` or ``python -m recforge.data.criteo.prepare``);
3. ``train``: ``benchmarks/train_throughput.py --level lightning`` for each published preset of
   the dataset on the prepared data: updates/s over fixed windows, the epoch time it projects
   (updates per epoch / updates per s), and the model's state (parameters, optimizer state);
4. ``eval``: one evaluation pass of each preset (``--eval-batches N`` caps it; the full pass
   is then projected from the batches' rate).

Peak memory is the largest memory of the child's whole process tree (the sum of its processes'
proportional set sizes, so that pages a forked worker shares with its parent count once), sampled
every 0.1 s from ``/proc`` (Linux), and the kernel's own peak resident set of the child itself
(``wait4``), whichever is larger; the kernel's figure only where it exceeds this process's own
peak, since it includes the memory the child was started from. Then, per stage, the exponent of a least-squares fit of log(cost) on log(raw rows): 1.0 is
linear, above it superlinear. Printed as tables (markdown) and one JSON line; ``--json FILE`` also
writes it there.

    python benchmarks/scale.py ml-20m --fractions 0.125,0.25,0.5,1
    python benchmarks/scale.py amzn-books --fractions 0.125,0.25 --eval-batches 16
    python benchmarks/scale.py criteo-kaggle --fractions 0.125,0.25,0.5,1 --presets dlrm_criteo_kaggle

A measurement tool, not a test: nothing here asserts on a timing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from timing import last_json_line

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


@dataclass(frozen=True)
class Dataset:
    """How one dataset is prepared and which published presets train on it."""

    raw_input: str  # what the preparation command's --raw gets, relative to the raw directory
    prepare: tuple[str, ...]  # the preparation command before --raw / --out
    presets: tuple[str, ...]
    # per preset, overrides that make it fit this machine (said in the output)
    fit_overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)


DATASETS = {
    "ml-20m": Dataset(".", ("-m", "recforge.data.sequences.preprocess", "ml-20m"),
                      ("hstu_ml-20m", "sasrec_ml-20m", "hstu_large_ml-20m")),
    "amzn-books": Dataset("ratings_Books.csv", ("-m", "recforge.data.sequences.preprocess", "amzn-books"),
                          ("hstu_amzn-books",)),
    "criteo-kaggle": Dataset("train.txt", ("-m", "recforge.data.criteo.prepare"), ("dlrm_criteo_kaggle",)),
    # one Terabyte day, hashed; one day has no later day to test on, so it is cut like Kaggle's file
    # (7 parts: train on 6, test and validate on halves of the 7th). MLPerf's DCNv2 hashes mod 40M:
    # 26 tables x 40M rows x 128 floats = 532 GB, which no 24 GiB machine holds, so the tables are
    # hashed mod 500k here (6.7 GB) and the global batch cut to 16,384 (MLPerf's 65,536 of multi-hot
    # bags, ~214 ids a row, puts several GB of activations and sparse gradients on top). The
    # conversion's cost hardly depends on the range (a modulo per value; a bitmap of 26 x range bits).
    "criteo-day": Dataset("day_0", ("-m", "recforge.data.criteo.prepare", "--categorical", "hash",
                                    "--max-ind-range", "500000", "--split", "kaggle7"),
                          ("dlrm_dcnv2_criteo_terabyte",),
                          {"dlrm_dcnv2_criteo_terabyte": ("data.batch_size=16384",)}),
}
STAGES = ("generate", "prepare", "train", "eval")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=sorted(DATASETS))
    p.add_argument("--fractions", default="0.125,0.25,0.5,1",
                   help="comma-separated fractions of the published size, each in (0, 1]")
    p.add_argument("--work-dir", default=os.environ.get("RECFORGE_SCALE_DIR", str(Path(tempfile.gettempdir()) / "recforge-scale")),
                   help="raw and prepared data go here, one folder per dataset and fraction "
                        "(default $RECFORGE_SCALE_DIR or the system temp dir; never the repo)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--threads", type=int, default=2, help="OMP/MKL/torch threads of every child")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    p.add_argument("--presets", default=None, help="comma-separated presets (default: the dataset's published ones)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every train/eval run (repeatable)")
    p.add_argument("--windows", type=int, default=3, help="training windows per preset")
    p.add_argument("--train-steps", type=int, default=20, help="timed updates per training window")
    p.add_argument("--eval-batches", type=int, default=0,
                   help="test batches of the evaluation pass (0: the whole test split)")
    p.add_argument("--regenerate", action="store_true", help="write the raw files again even if present")
    p.add_argument("--keep-prepared", action="store_true", help="keep each fraction's prepared data")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    try:
        args.fractions = sorted({float(f) for f in args.fractions.split(",") if f.strip()})
    except ValueError:
        p.error(f"--fractions: expected comma-separated numbers, got {args.fractions!r}")
    if not args.fractions or not all(0 < f <= 1 for f in args.fractions):
        p.error(f"--fractions: expected numbers in (0, 1], got {args.fractions}")
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not args.stages or any(s not in STAGES for s in args.stages):
        p.error(f"--stages: expected some of {', '.join(STAGES)}, got {','.join(args.stages)!r}")
    args.presets = (args.presets.split(",") if args.presets else list(DATASETS[args.dataset].presets))
    args.work_dir = Path(args.work_dir).resolve()
    if args.work_dir == REPO or REPO in args.work_dir.parents:
        p.error(f"--work-dir: {args.work_dir} is inside the repository; full-size data goes elsewhere")
    for name in ("threads", "windows", "train_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    return args


# ----------------------------------------------------------------------------------- measuring
def _proc_bytes(path: str, field: str) -> int | None:
    """The ``FIELD:  N kB`` line of a ``/proc`` file, in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _tree_rss(root: int) -> int:
    """Memory held by ``root`` and all its descendants now (0 once they are gone): the sum of their
    proportional set sizes, where the kernel gives them, else of their resident sets.

    Resident sets are not additive: a forked data-loader worker maps its parent's pages, and each
    process's RSS counts every page it maps, so summing them counts the model and data once per
    worker (a DCNv2 step with 6.7 GB of tables and 2 workers read as 26 GiB on a 23 GiB box). PSS
    divides a shared page among its sharers, so the sum counts it once."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # the name may hold spaces and parentheses: the fields start after the last ')'
            fields = stat[stat.rindex(")") + 2:].split()
            parents[int(entry)] = int(fields[1])
            rss[int(entry)] = int(fields[21]) * page
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    total = 0
    for pid in tree:
        if pid not in rss:
            continue
        # PSS: private pages plus a share of each shared one
        pss = _proc_bytes(f"/proc/{pid}/smaps_rollup", "Pss")
        if pss is None and _pss_readable():
            # it exited since the listing above: it holds nothing now (its resident set, read
            # before, would count the pages it shared with its parent a second time)
            continue
        total += rss[pid] if pss is None else pss
    return total


def _pss_readable() -> bool:
    """Whether this kernel gives proportional set sizes (``/proc/<pid>/smaps_rollup``, Linux 4.14+)."""
    return _proc_bytes("/proc/self/smaps_rollup", "Pss") is not None


@dataclass
class Measured:
    seconds: float
    peak_bytes: int
    returncode: int
    stdout: str
    stderr: str


def run_measured(command: list[str], env: dict[str, str], cwd: Path = REPO) -> Measured:
    """Runs ``command``, sampling its process tree's memory; wall time, peak resident bytes, output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        own_peak = _proc_bytes("/proc/self/status", "VmHWM")
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.1):
                peak = max(peak, _tree_rss(child.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        # ru_maxrss (KiB on Linux) catches a spike between two samples, but the kernel folds into it
        # the peak of the memory the child ran in before its exec, which is this process's: at or
        # below our own peak it says nothing about the child, and only the samples count.
        kernel_peak = usage.ru_maxrss * 1024
        if own_peak is None or kernel_peak <= own_peak:
            kernel_peak = 0
        return Measured(seconds, max(peak, kernel_peak), child.returncode, out.read(), err.read())


def fitted_exponent(sizes: list[float], costs: list[float]) -> float | None:
    """The slope of the least-squares line through (log size, log cost): cost ~ size ** slope.
    None with fewer than two distinct sizes or a cost that is not positive."""
    points = [(math.log(s), math.log(c)) for s, c in zip(sizes, costs) if s > 0 and c is not None and c > 0]
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


class StageFailed(RuntimeError):
    pass


def _check(measured: Measured, what: str) -> Measured:
    if measured.returncode != 0:
        tail = (measured.stderr.strip() or measured.stdout.strip()).splitlines()[-5:]
        raise StageFailed(f"{what} failed (exit {measured.returncode}): " + " | ".join(tail))
    return measured


# ----------------------------------------------------------------------------------- stages
def generate(args, raw: Path, fraction: float, env) -> dict:
    summary = raw / "scale_generated.json"
    if summary.exists() and not args.regenerate:
        recorded = json.loads(summary.read_text())
        if recorded.get("seed") == args.seed and recorded.get("fraction") == fraction:
            return {**recorded, "reused": True}
    if raw.exists():
        shutil.rmtree(raw)
    m = _check(run_measured([sys.executable, "benchmarks/fullsize_data.py", args.dataset, "--out", str(raw),
                             "--fraction", str(fraction), "--seed", str(args.seed)], env), "generation")
    result = {"seed": args.seed, "fraction": fraction, "seconds": m.seconds, "peak_bytes": m.peak_bytes,
              "generator": last_json_line(m.stdout)}
    tmp = summary.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(summary)
    return {**result, "reused": False}


def prepare(args, raw: Path, prepared: Path, env) -> dict:
    if prepared.exists():
        shutil.rmtree(prepared)  # a conversion from scratch is what is measured
    spec = DATASETS[args.dataset]
    m = _check(run_measured([sys.executable, *spec.prepare, "--raw", str(raw / spec.raw_input),
                             "--out", str(prepared)], env), "preparation")
    return {"seconds": m.seconds, "peak_bytes": m.peak_bytes,
            "bytes": sum(p.stat().st_size for p in prepared.rglob("*") if p.is_file())}


def _throughput(args, preset: str, prepared: Path, env, extra: list[str]) -> tuple[Measured, dict]:
    overrides = [f"data.prepared_dir={prepared}", *DATASETS[args.dataset].fit_overrides.get(preset, ()), *args.override]
    command = [sys.executable, "benchmarks/train_throughput.py", "--experiment", preset, "--level", "lightning",
               "--threads", str(args.threads), "--data-dir", str(args.work_dir / "train_throughput"),
               *[a for o in overrides for a in ("--override", o)], *extra]
    m = _check(run_measured(command, env), f"{preset} throughput")
    return m, last_json_line(m.stdout)


def train(args, preset: str, prepared: Path, env) -> dict:
    m, report = _throughput(args, preset, prepared, env, [
        "--no-eval", "--windows", str(args.windows), "--steps", str(args.train_steps), "--warmup", "3"])
    level = report["levels"]["lightning"]
    unit = report["unit"]
    updates_per_s = level["train_updates_per_s"]["median"]
    updates = report["epoch"]["train_updates"]
    return {"unit": unit, "updates_per_s": updates_per_s, "updates_per_s_min": level["train_updates_per_s"]["min"],
            "rows_per_s": level[f"train_{unit}_per_s"]["median"], "epoch_updates": updates,
            "epoch_seconds": updates / updates_per_s if updates else None, "peak_bytes": m.peak_bytes,
            "state_bytes": report["state_bytes"], "load_average": report["load_average"]}


def evaluate(args, preset: str, prepared: Path, env) -> dict:
    # evaluation only: its process's peak is the pass's own, not a training step's
    m, report = _throughput(args, preset, prepared, env, ["--no-train", "--windows", "1", "--eval-batches", str(args.eval_batches)])
    level = report["levels"]["lightning"]
    batches = report["epoch"]["test_batches"]
    per_s = level["eval_batches_per_s"]["median"]
    measured = min(batches, args.eval_batches) if args.eval_batches and batches else batches
    return {"rows_per_s": level[f"eval_{report['unit']}_per_s"]["median"], "test_batches": batches,
            "batches_run": measured, "pass_seconds": batches / per_s if batches else None,
            "projected": bool(args.eval_batches) and measured != batches, "peak_bytes": m.peak_bytes}


# ----------------------------------------------------------------------------------- report
def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 3600:.1f} h" if x >= 3600 else f"{x / 60:.1f} min" if x >= 120 else f"{x:.1f} s"


def _exp(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def tables(result: dict) -> str:
    rows = result["fractions"]
    lines = ["| fraction | raw rows | generate | prepare | prepare peak GiB | prepared GiB |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g, p = r.get("generate", {}), r.get("prepare", {})
        lines.append(f"| {r['fraction']:g} | {r['raw_rows']:,} | {_s(g.get('seconds'))}{' (kept)' if g.get('reused') else ''} "
                     f"| {_s(p.get('seconds'))} | {_gib(p.get('peak_bytes'))} | {_gib(p.get('bytes'))} |")
    ex = result["exponents"]
    lines.append(f"| exponent | 1.00 | {_exp(ex.get('generate_seconds'))} | {_exp(ex.get('prepare_seconds'))} "
                 f"| {_exp(ex.get('prepare_peak'))} | {_exp(ex.get('prepared_bytes'))} |")
    for preset in result["presets"]:
        lines += ["", f"**{preset}**", "",
                  "| fraction | train updates/s (min) | rows/s | epoch (projected) | train peak GiB | params + optim GiB "
                  "| eval pass | eval peak GiB |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            t, e = r.get("train", {}).get(preset, {}), r.get("eval", {}).get(preset, {})
            state = t.get("state_bytes") or {}
            both = (state.get("parameters") or 0) + (state.get("optimizer_state") or 0) if state else None
            ups = f"{t['updates_per_s']:.2f} ({t['updates_per_s_min']:.2f})" if t else "-"
            rate = f"{t['rows_per_s']:,.0f} {t['unit']}" if t else "-"
            ev = _s(e.get("pass_seconds")) + (f" (projected from {e['batches_run']} of {e['test_batches']} batches)"
                                               if e.get("projected") else "")
            lines.append(f"| {r['fraction']:g} | {ups} | {rate} | {_s(t.get('epoch_seconds'))} "
                         f"| {_gib(t.get('peak_bytes'))} | {_gib(both)} | {ev if e else '-'} | {_gib(e.get('peak_bytes'))} |")
        pe = ex.get(preset, {})
        lines.append(f"| exponent | {_exp(pe.get('seconds_per_update'))} (s/update) | | {_exp(pe.get('epoch_seconds'))} "
                     f"| {_exp(pe.get('train_peak'))} | | {_exp(pe.get('eval_seconds'))} | {_exp(pe.get('eval_peak'))} |")
    return "\n".join(lines)


def exponents(rows: list[dict], presets: list[str]) -> dict:
    sizes = [r["raw_rows"] for r in rows]

    def fit(get) -> float | None:
        return fitted_exponent(sizes, [get(r) for r in rows])

    out: dict = {
        "generate_seconds": fit(lambda r: None if r.get("generate", {}).get("reused") else r.get("generate", {}).get("seconds")),
        "prepare_seconds": fit(lambda r: r.get("prepare", {}).get("seconds")),
        "prepare_peak": fit(lambda r: r.get("prepare", {}).get("peak_bytes")),
        "prepared_bytes": fit(lambda r: r.get("prepare", {}).get("bytes")),
    }
    for preset in presets:
        def t(r, key):
            return r.get("train", {}).get(preset, {}).get(key)

        def e(r, key):
            return r.get("eval", {}).get(preset, {}).get(key)

        out[preset] = {
            "seconds_per_update": fit(lambda r: 1 / t(r, "updates_per_s") if t(r, "updates_per_s") else None),
            "epoch_seconds": fit(lambda r: t(r, "epoch_seconds")),
            "train_peak": fit(lambda r: t(r, "peak_bytes")),
            "eval_seconds": fit(lambda r: e(r, "pass_seconds")),
            "eval_peak": fit(lambda r: e(r, "peak_bytes")),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           **{v: str(args.threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    base = args.work_dir / args.dataset
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    spec = DATASETS[args.dataset]
    print(f"# prepare: python {' '.join(spec.prepare)} --raw <raw>/{spec.raw_input} --out <prepared>", flush=True)
    for preset in args.presets:
        if spec.fit_overrides.get(preset):
            print(f"# {preset} on this machine: {' '.join(spec.fit_overrides[preset])} (see scale.py's DATASETS)", flush=True)
    try:
        for fraction in args.fractions:
            raw, prepared = base / f"f{fraction:g}" / "raw", base / f"f{fraction:g}" / "prepared"
            row: dict = {"fraction": fraction}
            print(f"# {args.dataset} at fraction {fraction:g}", flush=True)
            if "generate" in args.stages or not (raw / "scale_generated.json").exists():
                row["generate"] = generate(args, raw, fraction, env)
            generated = json.loads((raw / "scale_generated.json").read_text())
            row["raw_rows"] = int(generated["generator"]["rows"])
            print(f"#   raw: {row['raw_rows']:,} rows", flush=True)
            if "prepare" in args.stages:
                row["prepare"] = prepare(args, raw, prepared, env)
                print(f"#   prepare: {_s(row['prepare']['seconds'])}, peak {_gib(row['prepare']['peak_bytes'])} GiB", flush=True)
            for stage, run in (("train", train), ("eval", evaluate)):
                if stage in args.stages:
                    row[stage] = {}
                    for preset in args.presets:
                        row[stage][preset] = run(args, preset, prepared, env)
                        print(f"#   {stage} {preset}: {json.dumps(row[stage][preset])}", flush=True)
            if not args.keep_prepared and prepared.exists():
                shutil.rmtree(prepared)
            rows.append(row)
    except StageFailed as failure:
        print(f"scale: {failure}", file=sys.stderr)
        if not rows:
            return 1
    result = {"benchmark": "scale", "dataset": args.dataset, "started": started, "threads": args.threads,
              "seed": args.seed, "presets": args.presets, "overrides": args.override,
              "prepare_command": list(spec.prepare),
              "fit_overrides": {p: list(spec.fit_overrides.get(p, ())) for p in args.presets},
              "eval_batches": args.eval_batches or "all", "fractions": rows,
              "exponents": exponents(rows, args.presets), "load_average": os.getloadavg()}
    print(tables(result))
    text = json.dumps(result, separators=(",", ":"))
    print(text, flush=True)
    if args.json:
        target = Path(args.json)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(target)
    return 0 if len(rows) == len(args.fractions) else 1


if __name__ == "__main__":
    sys.exit(main())

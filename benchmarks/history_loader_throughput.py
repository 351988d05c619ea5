#!/usr/bin/env python
"""Sequences/s of the history loader into ready :class:`HistoryBatch` es, against training.

The loader is the one a Trainer iterates: ``HistoryDataModule(prepared_dir=...).train_dataloader()``
(the resumable loader over a DataLoader with the module's DistributedSampler: each epoch shuffled
by (seed, epoch), a rank's share when ``--world`` > 1), timed from ``iter()`` to the last batch of
an epoch (or of its first ``--max-seqs`` sequences). Each workers count of ``--workers`` runs
``--repeats`` windows, each a different epoch's order, the counts alternating window by window so
that load from other jobs hits them alike. Threads are fixed (``--threads``: torch, OpenMP, arrow).
Per window: wall sequences/s and batches/s, and CPU seconds per 1,000 sequences (this process plus
its worker processes, read from ``/proc``: the cost the loader takes from the cores training needs).
The module's construction and ``setup`` (reading the parquet files, cutting the splits) are timed
once: they touch every user. ``--shm-handoff`` adds, per workers count > 0, a row with torch's
own pickling of the batch (a shared-memory segment per tensor; ``HistoryBatch`` pickles its
tensors as numpy arrays, this row shows what that saves).

Data: ``--prepared-dir`` (a directory prepared by ``python -m recforge.data.sequences.preprocess``),
or ``--generate ml-20m|amzn-books --fraction F --work-dir DIR``: ``benchmarks/fullsize_data.py``
writes the raw files under DIR and the preprocessing command prepares them there (both reused when
already there). ``--max-seq-len`` defaults to the dataset's preset (200 for ml-20m, 50 for Books).

Training: ``--train EXPERIMENT[,EXPERIMENT]`` runs ``benchmarks/train_throughput.py --level
lightning --no-eval`` of each preset on the same prepared directory (``--train-threads``, default
2), or ``--train-rate EXP=SEQ_PER_S`` takes a rate measured before; the ratio loader / training
is printed (the issue asks >= 10x).

    python benchmarks/history_loader_throughput.py --generate ml-20m --fraction 1 \\
        --work-dir /big/disk/hist --train hstu_ml-20m
    python benchmarks/history_loader_throughput.py --prepared-dir data/ml-20m --workers 0,2 \\
        --train-rate hstu_ml-20m=43

A measurement tool, not a test: nothing here asserts on a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
# the presets' history length per dataset (conf/data/*.yaml, spec §1.6)
MAX_SEQ_LEN = {"ml-20m": 200, "amzn-books": 50, "ml-1m": 200}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--prepared-dir", help="a prepared histories directory")
    data.add_argument("--generate", choices=("ml-20m", "amzn-books"),
                      help="generate this dataset's raw files and prepare them under --work-dir")
    p.add_argument("--fraction", type=float, default=1.0, help="with --generate: of the published size")
    p.add_argument("--seed", type=int, default=0, help="with --generate")
    p.add_argument("--work-dir", default=os.environ.get("RECFORGE_SCALE_DIR"),
                   help="with --generate: where the raw and prepared files go (outside the repo)")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the dataset's preset")
    p.add_argument("--protocol", default=None, choices=("loo", "reference"), help="default: loo, the presets'")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", default="0,2", help="DataLoader worker counts, comma-separated")
    p.add_argument("--shm-handoff", action="store_true",
                   help="also time each workers count > 0 with torch's own pickling of the batch "
                   "(a shared-memory segment per tensor: before HistoryBatch pickled as numpy)")
    p.add_argument("--world", type=int, default=1, help="ranks: time rank --rank's share of them")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="windows (epochs) per workers count")
    p.add_argument("--max-seqs", type=int, default=None,
                   help="time the first this many sequences of each epoch (default: whole epochs)")
    p.add_argument("--train", default="", help="presets whose training rate to measure, comma-separated")
    p.add_argument("--train-rate", action="append", default=[], metavar="EXPERIMENT=SEQ_PER_S",
                   help="a training rate measured before (repeatable)")
    p.add_argument("--train-threads", type=int, default=2,
                   help="threads of the training runs (default 2: the presets' best on a 2-core box)")
    p.add_argument("--train-steps", type=int, default=4, help="timed updates per training window")
    p.add_argument("--train-windows", type=int, default=3)
    args = p.parse_args(argv)
    if args.max_seq_len is not None and args.max_seq_len < 1:
        p.error("--max-seq-len: expected an integer >= 1")
    if args.generate and not args.work_dir:
        p.error("--generate needs --work-dir (or $RECFORGE_SCALE_DIR): the raw files are gigabytes")
    if not 0 <= args.rank < args.world:
        p.error(f"--rank {args.rank}: expected 0 <= rank < --world {args.world}")
    for name in ("batch_size", "threads", "repeats", "train_threads", "train_steps", "train_windows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1")
    return args


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _run(command: list[str], what: str) -> str:
    """``command``'s stdout; its output tail and a one-line reason when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"})
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{what} failed (rc {done.returncode}): {' '.join(command)}")
    return done.stdout


def generated(dataset: str, fraction: float, seed: int, work_dir: str) -> Path:
    """The prepared directory of ``dataset`` at ``fraction``, generated and prepared when missing.

    The raw files are reused only under the summary written after the generator finished (a run
    killed halfway leaves none, and the next one starts over); fresh raw files are prepared
    afresh."""
    base = Path(work_dir).expanduser().resolve() / f"{dataset}-f{fraction:g}-s{seed}"
    raw, prepared, summary = base / "raw", base / "prepared", base / "generated.json"
    if not summary.is_file():
        for stale in (raw, prepared):
            shutil.rmtree(stale, ignore_errors=True)
        started = time.perf_counter()
        out = _run([sys.executable, str(REPO / "benchmarks" / "fullsize_data.py"), dataset, "--out", str(raw),
                    "--fraction", str(fraction), "--seed", str(seed)], "generation")
        print(f"# generated {dataset} fraction {fraction:g} in {time.perf_counter() - started:.0f} s -> {raw}")
        tmp = summary.with_suffix(".tmp")
        tmp.write_text(out.strip().splitlines()[-1])  # the generator's JSON line
        tmp.replace(summary)
    if not (prepared / "done.json").is_file():
        started = time.perf_counter()
        source = raw if dataset == "ml-20m" else raw / "ratings_Books.csv"
        _run([sys.executable, "-m", "recforge.data.sequences.preprocess", dataset, "--raw", str(source),
              "--out", str(prepared)], "preprocessing")
        print(f"# prepared in {time.perf_counter() - started:.0f} s -> {prepared}")
    return prepared


def _ticks(pid: int) -> int:
    """User + system clock ticks of process ``pid`` (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))


def _children() -> dict[int, int]:
    """This process's live children (the loader's workers) and their CPU ticks so far."""
    me, out = str(os.getpid()), {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                out[int(entry.name)] = int(fields[11]) + int(fields[12])
    return out


class CpuClock:
    """CPU seconds of this process and its workers between :meth:`start` and :meth:`stop`; a
    worker started inside the window counts from zero, one ended inside it is lost (persistent
    workers do not end inside an epoch)."""

    tick = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self.own, self.kids = time.process_time(), _children()

    def stop(self) -> float:
        kids = _children()
        spent = sum(t - self.kids.get(pid, 0) for pid, t in kids.items())
        return time.process_time() - self.own + spent / self.tick


def train_rate(experiment: str, prepared: Path, max_seq_len: int, args) -> dict:
    """Median and min sequences/s of ``experiment``'s training on ``prepared`` (Lightning level)."""
    out = _run([sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--experiment", experiment,
                "--level", "lightning", "--no-eval", "--threads", str(args.train_threads), "--warmup", "2",
                "--lead", "1", "--steps", str(args.train_steps), "--windows", str(args.train_windows),
                "--batch-size", str(args.batch_size), "--override", f"data.prepared_dir={prepared}",
                # the preset's own history length and protocol unless the loader was given others
                *(["--override", f"data.max_seq_len={max_seq_len}"] if args.max_seq_len else []),
                *(["--override", f"data.protocol={args.protocol}"] if args.protocol else [])],
               f"training throughput of {experiment}")
    result = json.loads(out.strip().splitlines()[-1])
    stats = result["levels"]["lightning"]
    return {"seq_per_s": stats["train_sequences_per_s"], "updates_per_s": stats["train_updates_per_s"],
            "load_average": result["load_average"], "threads": args.train_threads, "measured": "now"}


def main(argv=None) -> int:
    args = _args(argv)
    # before torch and numpy load their thread pools
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    import numpy as np
    import pyarrow as pa
    import torch
    from timing import cpu_model, load_average

    from recforge.data.batches import HistoryBatch
    from recforge.data.sequences.datamodule import HistoryDataModule
    from recforge.data.sequences.prepared import read_marker

    torch.set_num_threads(args.threads)
    pa.set_cpu_count(args.threads)
    load_start = load_average()

    prepared = Path(args.prepared_dir) if args.prepared_dir else \
        generated(args.generate, args.fraction, args.seed, args.work_dir)
    marker = read_marker(prepared) or {}
    dataset = marker.get("dataset", "?")
    max_seq_len = args.max_seq_len or MAX_SEQ_LEN.get(dataset, 200)

    def module(workers: int) -> HistoryDataModule:
        dm = HistoryDataModule(prepared_dir=str(prepared), protocol=args.protocol or "loo", max_seq_len=max_seq_len,
                               batch_size=args.batch_size, num_workers=workers)
        # a stand-in trainer: the rank and world the loader shares users by (no process group)
        dm.trainer = SimpleNamespace(global_rank=args.rank, world_size=args.world)
        return dm

    workers = _ints(args.workers)
    # a row per workers count (its label), and per count > 0 one with torch's pickling if asked
    rows = [(str(w), w, False) for w in workers] + \
        [(f"{w} shm", w, True) for w in workers if w > 0 and args.shm_handoff]
    wall, cpu = time.perf_counter(), time.process_time()
    first = module(workers[0])
    first.setup("fit")
    setup = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    stats = marker.get("stats", {})
    train_rows = len(first.splits["train"])
    print(f"# {prepared}: dataset {dataset}, {stats.get('users', first.histories.n_users):,} users, "
          f"{first.histories.n_events:,} events; {train_rows:,} training rows ({args.protocol or 'loo'}), "
          f"max_seq_len {max_seq_len}, batch {args.batch_size}, rank {args.rank} of {args.world}")
    print(f"# module + setup (read parquet, cut splits): {setup['wall_s']:.2f} s wall, {setup['cpu_s']:.2f} s CPU")

    modules = {label: first if i == 0 else module(w) for i, (label, w, _) in enumerate(rows)}
    for dm in modules.values():
        dm.setup("fit")
    loaders = {label: dm.train_dataloader() for label, dm in modules.items()}
    own_pickling = HistoryBatch.__reduce__
    for (label, _, shm), loader in zip(rows, loaders.values()):  # untimed: worker start, first gathers
        # the persistent workers fork here and keep the class as it is now: torch's tensor
        # pickling (object's own reduction) for the shm rows
        HistoryBatch.__reduce__ = object.__reduce__ if shm else own_pickling
        next(iter(loader))
    HistoryBatch.__reduce__ = own_pickling

    labels = [label for label, _, _ in rows]
    seqs = {w: [] for w in labels}
    batches = {w: [] for w in labels}
    cpu_per_k = {w: [] for w in labels}
    clock = CpuClock()
    for repeat in range(args.repeats):
        for w, loader in loaders.items():
            loader.sampler.set_epoch(repeat + 1)  # what Lightning does before each epoch
            clock.start()
            started = time.perf_counter()
            seen = n = 0
            for batch in loader:
                seen += batch.size
                n += 1
                if args.max_seqs is not None and seen >= args.max_seqs:
                    break
            seconds = time.perf_counter() - started
            spent = clock.stop()
            seqs[w].append(seen / seconds)
            batches[w].append(n / seconds)
            cpu_per_k[w].append(1000 * spent / seen)
            assert args.max_seqs is not None or seen == len(loader.sampler), (seen, len(loader.sampler))

    rates: dict[str, dict] = {}
    for name, value in (item.split("=", 1) for item in args.train_rate):
        rates[name] = {"seq_per_s": {"median": float(value), "min": float(value)}, "measured": "given"}
    for experiment in [e for e in args.train.split(",") if e]:
        print(f"# training {experiment} on the same data ...", flush=True)
        rates[experiment] = train_rate(experiment, prepared, max_seq_len, args)
    load_end = load_average()

    window = "whole epochs" if args.max_seqs is None else f"the first {args.max_seqs:,} sequences of each epoch"
    print(f"\nhistory loader into HistoryBatch ({len(loaders[labels[0]].sampler):,} sequences per epoch "
          f"on this rank, {window}, {args.repeats} windows, threads {args.threads})")
    head = f"{'workers':>7}  {'seq/s min':>10}  {'seq/s median':>12}  {'batches/s median':>16}  " \
           f"{'CPU s/1k seq min':>16}  {'median':>7}"
    print(head)
    for w in labels:
        print(f"{w:>7}  {min(seqs[w]):10,.0f}  {statistics.median(seqs[w]):12,.0f}  "
              f"{statistics.median(batches[w]):16,.1f}  {min(cpu_per_k[w]):16.4f}  "
              f"{statistics.median(cpu_per_k[w]):7.4f}")
    for experiment, rate in rates.items():
        train = rate["seq_per_s"]["median"]
        print(f"\ntraining {experiment} ({rate['measured']}): {train:,.1f} seq/s median "
              f"(min {rate['seq_per_s']['min']:,.1f})")
        for w in labels:
            print(f"  loader workers {w} / training: {min(seqs[w]) / train:,.0f}x (loader min), "
                  f"{statistics.median(seqs[w]) / train:,.0f}x (median); CPU: the loader takes "
                  f"{statistics.median(cpu_per_k[w]) * train / 1000:.2%} of a core at the training rate")
    print(f"# load average: start {load_start}, end {load_end}; CPU {cpu_model()}")
    print(json.dumps({
        "benchmark": "history_loader_throughput", "prepared_dir": str(prepared), "dataset": dataset,
        "fraction": args.fraction if args.generate else None, "users": first.histories.n_users,
        "events": first.histories.n_events, "train_rows": train_rows, "max_seq_len": max_seq_len,
        "batch_size": args.batch_size, "protocol": args.protocol or "loo", "world": args.world, "rank": args.rank,
        "threads": args.threads, "max_seqs": args.max_seqs, "setup": setup,
        "loader": {w: {"seq_per_s": seqs[w], "batches_per_s": batches[w], "cpu_s_per_1k_seq": cpu_per_k[w]}
                   for w in labels},
        "training": rates, "load_average": {"start": load_start, "end": load_end}, "cpu": cpu_model(),
        "numpy": np.__version__, "torch": torch.__version__, "pyarrow": pa.__version__,
    }, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

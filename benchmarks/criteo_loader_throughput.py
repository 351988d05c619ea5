#!/usr/bin/env python
"""Rows/s of the Criteo loader into ready :class:`CTRBatch` es: one training epoch through
``CriteoDataModule.train_dataloader()`` (the DataLoader a Trainer iterates: shuffled chunk order,
shuffle buffer, worker processes started per epoch), timed from ``iter()`` to the last batch.

Data: ``--prepared-dir`` (e.g. a full-size conversion of :mod:`recforge.data.criteo.fullsize`'s
Kaggle file; ``--max-rows`` then times the first rows of each epoch), or a synthetic
Criteo-shaped prepared directory of ``--rows`` rows (default 2M, 70% of them train), generated
once into ``--cache-dir`` (the synthetic data module's cache layout; the generation time is
printed when it happens). Each (batch size, workers) pair runs ``--repeats``
epochs, each a different epoch's order; pairs alternate repeat by repeat so that load from other
jobs hits them alike. Threads are fixed (``--threads``: torch, OpenMP and arrow). Prints min and
median rows/s, then one JSON line. ``--per-row`` adds the map-style design of spec §1 (one
``__getitem__`` per row, default collate) on the first ``--per-row-rows`` training rows, for scale.

    python benchmarks/criteo_loader_throughput.py
    python benchmarks/criteo_loader_throughput.py --batch-sizes 128,2048 --workers 0,1,2 --per-row
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--prepared-dir", help="time this prepared directory (e.g. a full-size conversion) "
                   "instead of generated synthetic rows")
    p.add_argument("--max-rows", type=int, default=None,
                   help="time the first this many rows of each epoch (default: whole epochs)")
    p.add_argument("--cache-dir", default=str(REPO / "data" / "synthetic_criteo"))
    p.add_argument("--batch-sizes", default="128,2048")
    p.add_argument("--workers", default="0,1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shuffle-buffer", type=int, default=None, help="rows (default: the data module's)")
    p.add_argument("--no-shuffle", action="store_true", help="file order (as evaluation reads)")
    p.add_argument("--per-row", action="store_true", help="also time a per-row map-style dataset")
    p.add_argument("--per-row-rows", type=int, default=200_000)
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    args = _args(argv)
    # Before torch and numpy load their thread pools.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import pyarrow as pa
    import torch
    from torch.utils.data import DataLoader, Dataset

    from recforge.data.criteo.datamodule import DEFAULT_SHUFFLE_BUFFER, CriteoDataModule
    from recforge.data.criteo.synthetic import SyntheticCriteoConfig, ensure_synthetic_criteo, synthetic_criteo_key

    torch.set_num_threads(args.threads)
    pa.set_cpu_count(args.threads)

    generation_s = None
    if args.prepared_dir:
        path = Path(args.prepared_dir)
    else:
        config = SyntheticCriteoConfig(n_rows=args.rows)
        target = Path(args.cache_dir) / synthetic_criteo_key(config)
        started = time.perf_counter()
        fresh = not (target / "metadata.json").is_file()
        path = ensure_synthetic_criteo(config, args.cache_dir)
        if fresh:
            generation_s = time.perf_counter() - started
            print(f"generated {args.rows:,} rows in {generation_s:.1f} s -> {path}")

    buffer = DEFAULT_SHUFFLE_BUFFER if args.shuffle_buffer is None else args.shuffle_buffer
    modules = {
        (b, w): CriteoDataModule(prepared_dir=str(path), batch_size=b, num_workers=w,
                                 shuffle=not args.no_shuffle, shuffle_buffer=buffer)
        for b in _ints(args.batch_sizes) for w in _ints(args.workers)
    }
    for dm in modules.values():
        dm.setup("fit")
    rows = next(iter(modules.values())).metadata["splits"]["train"]["rows"]
    loaders = {key: dm.train_dataloader() for key, dm in modules.items()}
    for loader in loaders.values():  # untimed: imports, first file opens
        next(iter(loader))

    rates: dict[str, list[float]] = {f"batch {b}, workers {w}": [] for b, w in loaders}
    for repeat in range(args.repeats):
        for (b, w), loader in loaders.items():
            loader.sampler.set_epoch(repeat)  # the stream: no trainer sets it here
            start = time.perf_counter()
            seen = 0
            for batch in loader:
                seen += batch.size
                if args.max_rows is not None and seen >= args.max_rows:
                    break
            rates[f"batch {b}, workers {w}"].append(seen / (time.perf_counter() - start))
            assert seen == rows or args.max_rows is not None

    if args.per_row:
        dm = next(iter(modules.values()))
        first = list(dm.stream("train"))  # file order is fine: the cost is per row, not per order
        n = min(args.per_row_rows, rows)
        labels = torch.cat([b.labels for b in first])[:n]
        dense = torch.cat([b.dense for b in first])[:n]
        sparse = torch.cat([b.sparse for b in first])[:n]

        class PerRow(Dataset):
            def __len__(self):
                return n

            def __getitem__(self, i):
                return labels[i], dense[i], sparse[i]

        for b in _ints(args.batch_sizes):
            key = f"per-row map-style, batch {b}"
            rates[key] = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                seen = sum(len(batch[0]) for batch in DataLoader(PerRow(), batch_size=b, shuffle=True))
                rates[key].append(seen / (time.perf_counter() - start))

    window = "" if args.max_rows is None else f", the first {args.max_rows:,} rows of each epoch"
    print(f"\ntraining rows/s into CTRBatch ({rows:,} train rows{window}, threads {args.threads}, "
          f"{'file order' if args.no_shuffle else f'shuffle buffer {buffer:,}'}, {args.repeats} epochs each)")
    width = max(len(k) for k in rates)
    print(f"{'':{width}}  {'min':>12}  {'median':>12}")
    for key, values in rates.items():
        print(f"{key:{width}}  {min(values):12,.0f}  {statistics.median(values):12,.0f}")
    print(json.dumps({
        "rows": rows, "threads": args.threads, "shuffle": not args.no_shuffle, "shuffle_buffer": buffer,
        "generation_s": generation_s, "load_average": os.getloadavg(),
        "rows_per_s": {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in rates.items()},
        "numpy": np.__version__, "torch": torch.__version__, "pyarrow": pa.__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

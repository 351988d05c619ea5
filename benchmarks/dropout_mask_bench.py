#!/usr/bin/env python
"""HSTU's counter-hash dropout mask on the CPU: ``dropout_keep`` (int32 chunks, the path training
takes) against ``dropout_keep_reference`` (the int64 formulation), per call, at a layer's shape
(``--rows`` = batch x positions, ``--cols`` = heads x dv), fixed threads, min and median over
``--repeats`` calls with a new seed each, and whether the two masks are equal.

    python benchmarks/dropout_mask_bench.py --rows 25600 --cols 50 --threads 1

A measurement tool: it prints figures and asserts nothing about them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128 * 200, help="T: jagged positions of a batch (hstu_ml-1m: 128 x 200)")
    p.add_argument("--cols", type=int, default=50, help="E: heads x dv (hstu_ml-1m: 1 x 50)")
    p.add_argument("--p", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch

    from recforge.kernels.hstu_output import dropout_keep, dropout_keep_reference

    torch.set_num_threads(args.threads)
    print(f"# mask [{args.rows}, {args.cols}], p={args.p}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()}")
    equal = True
    times: dict[str, list[float]] = {"dropout_keep": [], "dropout_keep_reference": []}
    for repeat in range(args.repeats):
        masks = {}
        for name, fn in (("dropout_keep", dropout_keep), ("dropout_keep_reference", dropout_keep_reference)):
            start = time.perf_counter()
            masks[name] = fn(args.rows, args.cols, args.p, 1000 + repeat)
            times[name].append(time.perf_counter() - start)
        equal &= torch.equal(masks["dropout_keep"], masks["dropout_keep_reference"])
    for name, values in times.items():
        print(f"{name:24s} min {min(values) * 1e3:8.2f} ms   median {statistics.median(values) * 1e3:8.2f} ms")
    ratio = statistics.median(times["dropout_keep_reference"]) / statistics.median(times["dropout_keep"])
    print(f"reference / int32 chunks (medians): {ratio:.1f}x; masks equal in every call: {equal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

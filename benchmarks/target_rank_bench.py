#!/usr/bin/env python
"""Evaluation events/s of ``target_rank_counts``: the PyTorch path against the Triton kernel.

One "event" is one query row ranked against the whole catalogue. Each impl is warmed up (Triton
compiles on its first call), then timed over ``--repeats`` calls; min and median are printed, with
the number of rows whose counts differ from the PyTorch path (expected 0 for integer-valued
inputs; with random floats, only rounding-level near-ties may differ).

    python benchmarks/target_rank_bench.py                         # GPU if there is one
    python benchmarks/target_rank_bench.py -B 1024 -N 1000000 -d 64 --dtype bfloat16
    python benchmarks/target_rank_bench.py --blocks 64,128,64 --splits 8   # tune the kernel
    python benchmarks/target_rank_bench.py -B 32 -N 500 -d 32 --device cpu # CPU: interpreter, tiny

On CPU the Triton impl runs in Triton's interpreter (numpy, one program at a time): use it only to
check the script, never as a timing. A measurement tool: nothing here asserts.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
from timing import device_name, time_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-B", "--batch", type=int, default=512, help="query rows per call")
    parser.add_argument("-N", "--items", type=int, default=37483, help="catalogue size")
    parser.add_argument("-d", "--dim", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-bias", action="store_true")
    parser.add_argument("--chunk-size", type=int, default=8192, help="PyTorch path's items per chunk")
    parser.add_argument("--impls", default="pytorch,triton")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", help="BLOCK_B,BLOCK_N,BLOCK_D for the Triton kernel")
    parser.add_argument("--splits", type=int, help="catalogue splits per row block (Triton)")
    parser.add_argument("--ints", action="store_true", help="integer-valued inputs: exact, heavily tied")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu" and "triton" in args.impls:
        # the interpreter is chosen when the kernel is defined, i.e. before the import below
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from recforge.kernels import target_rank_counts

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    shape_q, shape_w = (args.batch, args.dim), (args.items, args.dim)
    if args.ints:
        q = torch.randint(-2, 3, shape_q, generator=gen).float()
        w = torch.randint(-2, 3, shape_w, generator=gen).float()
        b = torch.randint(0, 3, (args.items,), generator=gen).float()
    else:
        q, w = torch.randn(shape_q, generator=gen), torch.randn(shape_w, generator=gen)
        b = torch.randn(args.items, generator=gen)
    q, w, b = (t.to(device=device, dtype=dtype) for t in (q, w, b))
    b = None if args.no_bias else b
    t = torch.randint(0, args.items, (args.batch,), generator=gen).to(device)

    def run(impl: str):
        if impl == "triton" and (args.blocks or args.splits):
            from recforge.kernels.target_rank_triton import target_rank_counts_triton

            blocks = tuple(int(x) for x in args.blocks.split(",")) if args.blocks else None
            return target_rank_counts_triton(q, w, b, t, n_splits=args.splits, block_sizes=blocks)
        return target_rank_counts(q, w, b, t, chunk_size=args.chunk_size, kernel=impl)

    print(
        f"device={device_name(device)} torch={torch.__version__} B={args.batch} N={args.items} d={args.dim} "
        f"dtype={args.dtype} bias={b is not None} chunk_size={args.chunk_size} "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    print(f"{'impl':<8} {'min ev/s':>12} {'median ev/s':>12} {'median ms':>10} {'rows != pytorch':>16}")
    baseline = None
    for impl in args.impls.split(","):
        seconds, out = time_calls(lambda: run(impl), device, args.warmup, args.repeats)
        if baseline is None:
            baseline = out
        differ = int(((out[0] != baseline[0]) | (out[1] != baseline[1])).sum())
        rates = [args.batch / s for s in seconds]
        print(
            f"{impl:<8} {min(rates):>12,.0f} {statistics.median(rates):>12,.0f} "
            f"{1e3 * statistics.median(seconds):>10.2f} {differ:>16}"
        )


if __name__ == "__main__":
    main()

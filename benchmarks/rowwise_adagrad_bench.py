#!/usr/bin/env python
"""Time of one lazy row-wise Adagrad-momentum step: the PyTorch path against the Triton kernel.

The gradient is what one GRU4Rec mini-batch gives its shared item table: ``--batch`` input rows,
``--batch`` target rows and ``--n-sample`` popularity-sampled rows (P ∝ rank^-1, so duplicates are
common), uncoalesced, on a ``--items`` × ``--dim`` table. Each impl is warmed up (Triton compiles
on its first call), then timed over ``--repeats`` steps on copies of the same state; min and median
are printed, with the largest difference from the PyTorch path after one step.

    python benchmarks/rowwise_adagrad_bench.py                    # GPU if there is one
    python benchmarks/rowwise_adagrad_bench.py --batch 256 --dim 500
    python benchmarks/rowwise_adagrad_bench.py --device cpu --impls pytorch   # the CPU reference

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
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n-sample", type=int, default=2048)
    parser.add_argument("--items", type=int, default=37483)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--momentum", type=float, default=0.2)
    parser.add_argument("--impls", default="pytorch,triton")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu" and "triton" in args.impls:
        # the interpreter is chosen when the kernel is defined, i.e. before the import below
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(args.threads)
    from recforge.kernels import sparse_adagrad_momentum_

    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, args.items + 1, dtype=torch.float64)
    n_rows = 2 * args.batch + args.n_sample
    rows = torch.cat([
        torch.multinomial(weights, 2 * args.batch, replacement=True, generator=gen),
        torch.multinomial(weights, args.n_sample, replacement=True, generator=gen),
    ])
    values = torch.randn(n_rows, args.dim, generator=gen)
    grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (args.items, args.dim)).to(device)
    table0 = torch.randn(args.items, args.dim, generator=gen).to(device)
    sum0 = (torch.rand(args.items, args.dim, generator=gen) * 3).to(device)
    velocity0 = (torch.randn(args.items, args.dim, generator=gen) * 0.1).to(device)

    print(
        f"device={device_name(device)} torch={torch.__version__} items={args.items} dim={args.dim} "
        f"rows={n_rows} (distinct {rows.unique().numel()}) momentum={args.momentum} "
        f"threads={args.threads} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    print(f"{'impl':<8} {'min us':>10} {'median us':>10} {'max |diff| vs pytorch':>22}")
    baseline = None
    for impl in args.impls.split(","):
        state = [t.clone() for t in (table0, sum0, velocity0)]

        def step(table, grad_sum, velocity):
            sparse_adagrad_momentum_(
                table, grad_sum, velocity if args.momentum > 0 else None, grad,
                lr=0.1, momentum=args.momentum, kernel=impl,
            )

        seconds, _ = time_calls(lambda: step(*state), device, args.warmup, args.repeats)
        once = [t.clone() for t in (table0, sum0, velocity0)]
        step(*once)
        if baseline is None:
            baseline = once[0]
        diff = float((once[0] - baseline).abs().max())
        print(
            f"{impl:<8} {1e6 * min(seconds):>10.1f} {1e6 * statistics.median(seconds):>10.1f} {diff:>22.3g}"
        )


if __name__ == "__main__":
    main()

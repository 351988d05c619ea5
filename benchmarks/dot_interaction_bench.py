#!/usr/bin/env python
"""DLRM's dot interaction, forward and forward+backward: the Triton kernels against PyTorch.

Three impls on the same inputs (``dense [B, d]``, ``embeddings [B, 26, d]``, ``--dtype``):

* ``triton``: :func:`recforge.kernels.dot_interaction_triton.dot_interaction_triton` (Gram matrix,
  triangle and concatenation in one kernel; backward ``(G + Gᵀ) T`` in another);
* ``torch``: :func:`recforge.kernels.dot_interaction.dot_interaction_reference` (cat, bmm,
  index_select, cat: the reference's ops, autograd for the backward);
* ``compiled``: ``torch.compile`` of that reference (Inductor's fused kernels; compiled once per
  shape during the warm-up, ``dynamic=False``).

Per (B, d): each impl is warmed up, then timed over ``--repeats`` calls: forward alone, and
forward plus backward with a fixed random upstream gradient; min and median are printed, with the
peak memory allocated during one forward+backward above what the inputs hold (CUDA only), and on
the ``triton`` and ``compiled`` lines the largest difference of the output from ``torch``'s,
relative to the largest ``torch`` output. An impl that runs out of memory prints ``OOM``.

    python benchmarks/dot_interaction_bench.py                   # GPU: B 2048..65536, d 16/64/128
    python benchmarks/dot_interaction_bench.py --batches 65536 --dims 128 --dtype bfloat16
    python benchmarks/dot_interaction_bench.py --device cpu      # CPU: the reference, small sizes
    python benchmarks/dot_interaction_bench.py --device cpu --impls torch,triton --batches 64 --dims 16

Without CUDA (or with ``--device cpu``) it runs on CPU at small sizes and only the ``torch`` impl
unless ``--impls`` says otherwise; the Triton impl then runs in Triton's interpreter (numpy, one
program at a time), only good for checking the script. A measurement tool: nothing here asserts.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
from timing import device_name, peak_mib, time_calls

N_SPARSE = 26


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default=None,
                        help="default: 2048,8192,32768,65536 (GPU), 128,1024 (CPU)")
    parser.add_argument("--dims", default="16,64,128")
    parser.add_argument("--n-sparse", type=int, default=N_SPARSE,
                        help="embedding vectors per row (F = n + 1)")
    parser.add_argument("--itself", action="store_true", help="keep the diagonal (F(F+1)/2 dots)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--impls", default=None,
                        help="default: triton,torch,compiled (GPU), torch (CPU)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(args.threads)
        # the interpreter is chosen when the kernels are defined, i.e. before the import below
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from recforge.kernels.dot_interaction import dot_interaction_reference, n_pairs

    default_batches = "2048,8192,32768,65536" if on_gpu else "128,1024"
    batches = [int(x) for x in (args.batches or default_batches).split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    impls = (args.impls or ("triton,torch,compiled" if on_gpu else "torch")).split(",")
    dtype = getattr(torch, args.dtype)
    triton_op = None
    if "triton" in impls:
        from recforge.kernels.dot_interaction_triton import dot_interaction_triton as triton_op
    compiled_op = None
    if "compiled" in impls:
        compiled_op = torch.compile(dot_interaction_reference, dynamic=False)
    ops = {"triton": triton_op, "torch": dot_interaction_reference, "compiled": compiled_op}

    print(
        f"device={device_name(device)} torch={torch.__version__} dtype={args.dtype} "
        f"F={args.n_sparse + 1} itself={args.itself} repeats={args.repeats} "
        f"threads={torch.get_num_threads() if not on_gpu else '-'} "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    print(
        f"{'B':>6} {'d':>4} {'impl':<9} {'fwd min ms':>11} {'fwd med ms':>11} {'f+b min ms':>11} "
        f"{'f+b med ms':>11} {'peak MiB':>9} {'rel diff':>9}"
    )
    n_out = n_pairs(args.n_sparse + 1, args.itself)
    for dim in dims:
        for batch in batches:
            _bench_size(batch, dim, impls, ops, n_out, dtype, device, args)
            if on_gpu:
                torch.cuda.empty_cache()


def _bench_size(batch, dim, impls, ops, n_out, dtype, device, args) -> None:
    """One table block: every impl at one (B, d)."""
    gen = torch.Generator().manual_seed(args.seed)
    dense = torch.randn(batch, dim, generator=gen).to(device, dtype).requires_grad_()
    emb = torch.randn(batch, args.n_sparse, dim, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(batch, dim + n_out, generator=gen).to(device, dtype)

    def call(impl):
        return ops[impl](dense, emb, args.itself)

    def forward_backward(impl):
        dense.grad = emb.grad = None
        out = call(impl)
        out.backward(grad)
        return out

    expected = None
    if "torch" in impls:
        with torch.no_grad():
            expected = call("torch")
    for impl in impls:
        try:
            with torch.no_grad():
                fwd, out = time_calls(lambda: call(impl), device, args.warmup, args.repeats)
            both, _ = time_calls(lambda: forward_backward(impl), device, args.warmup, args.repeats)
            peak = peak_mib(lambda: forward_backward(impl), device)
        except torch.cuda.OutOfMemoryError:
            print(f"{batch:>6} {dim:>4} {impl:<9} {'OOM':>11}")
            torch.cuda.empty_cache()
            continue
        diff = f"{_rel(out, expected):.1e}" if expected is not None and impl != "torch" else ""
        ms = [1e3 * x for x in (min(fwd), statistics.median(fwd), min(both), statistics.median(both))]
        print(
            f"{batch:>6} {dim:>4} {impl:<9} " + " ".join(f"{x:>11.3f}" for x in ms)
            + f" {peak:>9.1f} {diff:>9}",
            flush=True,
        )


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


if __name__ == "__main__":
    main()

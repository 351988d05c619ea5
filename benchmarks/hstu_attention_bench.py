#!/usr/bin/env python
"""HSTU attention, forward and forward+backward: the Triton kernel against padded-dense PyTorch.

Three impls on the same jagged batch (fp32, ``--heads`` heads of ``--dim`` dims, row lengths drawn
uniformly in ``[frac * L, L]`` with one row of exactly ``L``, chronological timestamps):

* ``triton``: :func:`recforge.kernels.hstu_attention_triton.hstu_attention_triton` (relative
  position and time bias computed in the kernels, no ``[L, L]`` matrix stored);
* ``torch``: the same op written plainly in this script: pad to ``[B, L, H, d]``, dense scores
  plus the bias, SiLU / W, causal and padding masks, ``@ V``, back to jagged (autograd for the
  backward);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on the padded
  input: softmax attention without the bias, i.e. a different op, shown as the speed of a fused
  (FlashAttention-style) kernel at the same shapes.

Rows: per length L, ``batch = max(1, --tokens // L)`` rows. Each impl is warmed up (Triton
compiles on its first call), then timed over ``--repeats`` calls: forward alone, and forward plus
backward with a fixed random upstream gradient; min and median are printed, with the peak memory
allocated during one forward+backward above what the inputs hold, and on the ``triton`` line the
largest difference of its output from ``torch``'s, relative to the largest ``torch`` output. An
impl that runs out of memory prints ``OOM`` for that length.

    python benchmarks/hstu_attention_bench.py                          # GPU: L = 256 .. 8192
    python benchmarks/hstu_attention_bench.py --lengths 1024 --heads 4 --dim 32 --repeats 20
    python benchmarks/hstu_attention_bench.py --device cpu --lengths 32 --tokens 64 --dim 8 --repeats 1

Without CUDA it prints why and exits (0) unless ``--device cpu`` is given: the Triton impl then
runs in Triton's interpreter (numpy, one program at a time), only good for checking the script.
A measurement tool: nothing here asserts.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from timing import device_name, peak_mib, time_calls

NUM_BUCKETS = 128


def make_batch(length: int, n_rows: int, heads: int, dim: int, frac: float, width: int, device, seed: int):
    """Jagged inputs: q, k, v ``[T, H, dim]``, offsets, pos/time weights, timestamps, query times."""
    gen = torch.Generator().manual_seed(seed)
    low = max(1, int(frac * length))
    lens = torch.randint(low, length + 1, (n_rows,), generator=gen)
    lens[0] = length  # the grid is sized for it
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    total = int(offsets[-1])
    # SiLU-activated projections, as the layer passes them
    q, k, v = (F.silu(torch.randn(total, heads, dim, generator=gen)) for _ in range(3))
    pos_w = torch.randn(2 * width - 1, generator=gen) * 0.02
    time_w = torch.randn(NUM_BUCKETS + 1, generator=gen) * 0.02
    # seconds between interactions: many within a session, some days apart
    gaps = torch.where(
        torch.rand(total + n_rows, generator=gen) < 0.9,
        torch.randint(0, 600, (total + n_rows,), generator=gen),
        torch.randint(3600, 30 * 86400, (total + n_rows,), generator=gen),
    )
    stamps, queries = [], []
    for b in range(n_rows):
        lo, n = int(offsets[b]), int(lens[b])
        row = 10**9 + gaps[lo + b : lo + b + n + 1].cumsum(0)
        stamps.append(row[:n])
        queries.append(row[1:])  # the next item's time; the last row entry is the target's
    tensors = (q, k, v, offsets, pos_w, time_w, torch.cat(stamps), torch.cat(queries))
    return tuple(t.to(device) for t in tensors)


def padded_dense_attention(q, k, v, offsets, max_len, pos_w, time_w, timestamps, query_times, width):
    """The op in plain PyTorch: ``[B, H, L, L]`` scores with the bias, explicit masks, jagged out."""
    lens = offsets[1:] - offsets[:-1]
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < lens[:, None]  # [B, L]
    token = (offsets[:-1, None] + pos[None, :]).clamp(max=q.shape[0] - 1)

    def pad(x):
        return torch.where(valid.view(*valid.shape, *[1] * (x.dim() - 1)), x[token], 0)

    qp, kp, vp = pad(q), pad(k), pad(v)  # [B, L, H, d]
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp)
    gap = pad(query_times)[:, :, None] - pad(timestamps)[:, None, :]
    bucket = (torch.log(gap.abs().clamp(min=1).to(torch.float32)) / 0.301).long().clamp(0, time_w.numel() - 1)
    rab = pos_w[width - 1 + pos[None, :] - pos[:, None]][None] + time_w[bucket]  # [B, L, L]
    mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :] & valid[:, :, None]
    attn = F.silu(scores + rab[:, None]) / width * mask[:, None]
    out = torch.einsum("bhij,bjhd->bihd", attn, vp)
    return out[valid]


def sdpa_padded(q, k, v, offsets, max_len):
    """Softmax attention (no bias) on the padded batch with PyTorch's fused kernels."""
    lens = offsets[1:] - offsets[:-1]
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < lens[:, None]
    token = (offsets[:-1, None] + pos[None, :]).clamp(max=q.shape[0] - 1)
    qp, kp, vp = (x[token].transpose(1, 2) for x in (q, k, v))  # [B, H, L, d]
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
    return out.transpose(1, 2)[valid]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192", help="longest row per batch")
    parser.add_argument("--tokens", type=int, default=16384, help="rows per batch = tokens // length (>= 1)")
    parser.add_argument("--frac", type=float, default=0.9, help="row lengths uniform in [frac * L, L]")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64, help="dqk = dv")
    parser.add_argument("--impls", default="triton,torch,sdpa")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda; cpu only to check the script")
    args = parser.parse_args()

    if args.device is None and not torch.cuda.is_available():
        print("hstu_attention_bench: no CUDA device; skipped (pass --device cpu to check the script)")
        return
    device = torch.device(args.device or "cuda")
    if device.type == "cpu":
        # the interpreter is chosen when the kernels are defined, i.e. before the import below
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from recforge.kernels.hstu_attention_triton import hstu_attention_triton

    lengths = [int(x) for x in args.lengths.split(",")]
    impls = args.impls.split(",")
    print(
        f"device={device_name(device)} torch={torch.__version__} heads={args.heads} dim={args.dim} "
        f"tokens/batch~{args.tokens} frac={args.frac} repeats={args.repeats} "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    print(
        f"{'L':>6} {'B':>4} {'impl':<7} {'fwd min ms':>11} {'fwd med ms':>11} {'f+b min ms':>11} "
        f"{'f+b med ms':>11} {'peak MiB':>9} {'rel diff':>9}"
    )
    for length in lengths:
        n_rows = max(1, args.tokens // length)
        width = length  # the padded width: the longest row, as the reference pads to it
        batch = make_batch(length, n_rows, args.heads, args.dim, args.frac, width, device, args.seed)
        q, k, v, offsets, pos_w, time_w, timestamps, query_times = batch
        leaves = [t.clone().requires_grad_() for t in (q, k, v, pos_w, time_w)]
        gen = torch.Generator().manual_seed(args.seed + 1)
        grad = torch.randn(q.shape[0], args.heads, args.dim, generator=gen).to(device)

        def call(impl):
            lq, lk, lv, lp, lt = leaves
            rest = (offsets, length, lp, lt, timestamps, query_times, width)
            if impl == "triton":
                return hstu_attention_triton(lq, lk, lv, *rest)
            if impl == "torch":
                return padded_dense_attention(lq, lk, lv, *rest)
            return sdpa_padded(lq, lk, lv, offsets, length)

        def forward_backward(impl):
            for leaf in leaves:
                leaf.grad = None
            out = call(impl)
            out.backward(grad)
            return out

        diff = "n/a"
        if "triton" in impls and "torch" in impls:
            try:
                with torch.no_grad():
                    diff = f"{_rel(call('triton'), call('torch')):.1e}"
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        for impl in impls:
            try:
                with torch.no_grad():
                    fwd, _ = time_calls(lambda: call(impl), device, args.warmup, args.repeats)
                both, _ = time_calls(lambda: forward_backward(impl), device, 1, args.repeats)
                peak = peak_mib(lambda: forward_backward(impl), device)
            except torch.cuda.OutOfMemoryError:
                print(f"{length:>6} {n_rows:>4} {impl:<7} {'OOM':>11}")
                torch.cuda.empty_cache()
                continue
            ms = [1e3 * x for x in (min(fwd), statistics.median(fwd), min(both), statistics.median(both))]
            print(
                f"{length:>6} {n_rows:>4} {impl:<7} " + " ".join(f"{x:>11.3f}" for x in ms)
                + f" {peak:>9.1f} {diff if impl == 'triton' else '':>9}"
            )
        del batch, leaves, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


if __name__ == "__main__":
    main()

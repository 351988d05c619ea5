#!/usr/bin/env python
"""Peak memory and time of full-catalogue ranking with per-user exclusions (PyTorch path, CPU).

Ranks ``--users`` users against ``--items`` items (``--dim`` wide, with a bias) through
``target_rank_counts(..., exclude_items=, exclude_offsets=)``, ``--batch`` users per call and
``--chunk-size`` items per tile, each user excluding about ``--excluded`` random items (uniform in
[excluded/2, 3*excluded/2], so lists are jagged). Prints the peak memory the ranking added, against
the bound the tiling promises (a few ``batch x chunk`` tiles) and against what one ``batch x items``
score matrix, or the whole ``users x items`` one, would cost.

How memory is measured: tracemalloc does not see torch's allocations, and torch keeps no allocator
statistics for CPU tensors, so the figure is the process's peak resident set from the kernel.
Linux keeps the peak in ``VmHWM`` (``/proc/self/status``) and resets it to the current ``VmRSS`` when
``5`` is written to ``/proc/self/clear_refs``. The inputs are built and touched first, and the code
paths loaded by one tiny call (so that no tile-sized buffer is cached by the allocator before the
baseline is taken); then the peak is reset, every batch is ranked, and ``VmHWM - baseline`` is what
ranking added at its worst moment. It counts pages actually touched, whichever allocator holds them.
By default glibc's mmap threshold is pinned at 128 KiB first (``mallopt``, as
``MALLOC_MMAP_THRESHOLD_=131072`` would): each tile-sized block is then its own mapping, returned
when freed, so the peak is the live tensors. glibc's default raises the threshold after the first
freed tile and keeps later tiles on its heap, where freed ones stay resident: ``--glibc-default``
measures that (what a plain evaluation process shows: 2.5x the live peak at full size). The pinned
threshold maps and faults in every tile afresh, which costs system time: take timings from a
``--glibc-default`` run.

Time: each user batch is one timed call (after the tiny warm-up), with ``torch.set_num_threads``
fixed; min and median per batch are printed, with users/s. ``--max-batches`` caps the run (it then
reports how many users were ranked). Full size (10^6 items x 10^4 users, d=64, 20 batches) took
4.5 minutes on the shared 2-core box with the pinned threshold, ~5 s a batch without it.

    python benchmarks/rank_exclusion_memory.py                       # full size: peak memory
    python benchmarks/rank_exclusion_memory.py --glibc-default --max-batches 4 --compare-plain  # time
    python benchmarks/rank_exclusion_memory.py --items 200000 --users 2048

A measurement tool: nothing here asserts.
"""
from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import time
from pathlib import Path

import torch

MB = 1 << 20


def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def _reset_peak() -> bool:
    """Resets VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _pin_mmap_threshold() -> bool:
    """Every allocation over 128 KiB gets its own mapping (glibc only); False where unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3
    return libc.mallopt(m_mmap_threshold, 128 * 1024) == 1


def _exclusion_lists(n_users: int, n_items: int, mean: int, gen: torch.Generator):
    """``(items [E], offsets [users+1])``: jagged random lists, repeats possible as in real logs."""
    lengths = torch.randint(mean // 2, mean + mean // 2 + 1, (n_users,), generator=gen)
    offsets = torch.zeros(n_users + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    items = torch.randint(0, n_items, (int(offsets[-1]),), generator=gen)
    return items, offsets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("-d", "--dim", type=int, default=64)
    parser.add_argument("--excluded", type=int, default=200, help="mean excluded items per user")
    parser.add_argument("--batch", type=int, default=512, help="users per call")
    parser.add_argument("--chunk-size", type=int, default=8192, help="items per tile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batches", type=int, help="rank only this many user batches")
    parser.add_argument(
        "--compare-plain", action="store_true", help="also time the same batches without exclusions"
    )
    parser.add_argument(
        "--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold (see above)"
    )
    args = parser.parse_args()
    pinned = False if args.glibc_default else _pin_mmap_threshold()

    torch.set_num_threads(args.threads)
    from recforge.kernels import target_rank_counts

    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(args.items, args.dim, generator=gen)
    bias = torch.randn(args.items, generator=gen)
    queries = torch.randn(args.users, args.dim, generator=gen)
    targets = torch.randint(0, args.items, (args.users,), generator=gen)
    ex_items, ex_offsets = _exclusion_lists(args.users, args.items, args.excluded, gen)

    starts = list(range(0, args.users, args.batch))
    if args.max_batches is not None:
        starts = starts[: args.max_batches]

    def batch(start: int) -> dict:
        stop = min(start + args.batch, args.users)
        lo, hi = int(ex_offsets[start]), int(ex_offsets[stop])
        return {
            "queries": queries[start:stop],
            "targets": targets[start:stop],
            "exclude_items": ex_items[lo:hi],
            "exclude_offsets": ex_offsets[start : stop + 1] - lo,
        }

    def rank(b: dict, exclude: bool = True):
        extra = {k: b[k] for k in ("exclude_items", "exclude_offsets")} if exclude else {}
        return target_rank_counts(
            b["queries"], weights, bias, b["targets"], chunk_size=args.chunk_size, **extra
        )

    # code paths and thread pool up, with nothing near tile-sized allocated
    target_rank_counts(
        queries[:2], weights[:64], bias[:64], targets[:2] % 64, chunk_size=16,
        exclude_items=torch.tensor([1, 2, 3]), exclude_offsets=torch.tensor([0, 2, 3]),
    )  # fmt: skip

    baseline_kb = _status_kb("VmRSS")
    resettable = _reset_peak()
    peak_before_kb = _status_kb("VmHWM")
    seconds, n_ranked, n_pairs = [], 0, 0
    for start in starts:
        b = batch(start)
        begin = time.perf_counter()
        rank(b)
        seconds.append(time.perf_counter() - begin)
        n_ranked += b["queries"].shape[0]
        n_pairs += b["exclude_items"].shape[0]
    peak_kb = _status_kb("VmHWM")
    after_kb = _status_kb("VmRSS")
    plain = []
    if args.compare_plain:
        for start in starts:
            b = batch(start)
            begin = time.perf_counter()
            rank(b, exclude=False)
            plain.append(time.perf_counter() - begin)

    B, C, N = args.batch, min(args.chunk_size, args.items), args.items
    score_tile = B * C * 4  # one fp32 [batch, chunk] score tile
    # at its worst moment the chunk loop holds the fp32 score tile, about four bool [batch, chunk]
    # tiles (target column, keep mask, a comparison and its masked copy) and the int64 copy that
    # summing a bool tile along a row makes (torch casts before reducing): 4 + 4 + 8 bytes a pair
    tile_bound = B * C * (4 + 4 + 8)
    # per batch: the (row, item) pairs as int64 rows, ids, sort keys and their reordering
    pairs_bytes = int(1.5 * args.excluded) * B * 8 * 6
    grown = (peak_kb - baseline_kb) * 1024
    tensors = (weights, bias, queries, targets, ex_items, ex_offsets)
    inputs = sum(t.numel() * t.element_size() for t in tensors)

    print(
        f"torch={torch.__version__} threads={torch.get_num_threads()} items={N:,} users={args.users:,} "
        f"ranked={n_ranked:,} ({len(starts)} batches of {B}) d={args.dim} chunk={C} "
        f"excluded/user~{args.excluded} (pairs ranked: {n_pairs:,})"
    )
    print(f"inputs (weights, bias, queries, targets, exclusion lists): {inputs / MB:,.1f} MB")
    print(
        "allocator: glibc mmap threshold pinned at 128 KiB (live tensors)" if pinned
        else "allocator: as is (glibc's default keeps freed tiles resident: --glibc-default, or "
        "mallopt unavailable)"
    )  # fmt: skip
    if not resettable:
        print(
            f"warning: /proc/self/clear_refs not writable, VmHWM not reset: peak includes the setup "
            f"(VmHWM before ranking {peak_before_kb / 1024:,.1f} MB)"
        )
    print(
        f"RSS before ranking {baseline_kb / 1024:,.1f} MB, peak {peak_kb / 1024:,.1f} MB, "
        f"after {after_kb / 1024:,.1f} MB"
    )
    print(f"{'memory':<46} {'MB':>12} {'x score tile':>13}")
    rows = [
        ("measured peak growth while ranking", grown),
        ("one fp32 score tile  B x chunk x 4", score_tile),
        ("tile bound  B x chunk x (4 + 4 bool + 8 sum)", tile_bound),
        ("exclusion pairs per batch (~6 int64 arrays)", pairs_bytes),
        ("one batch's score matrix  B x N x 4", B * N * 4),
        ("all users' score matrix  users x N x 4", args.users * N * 4),
    ]
    for name, value in rows:
        print(f"{name:<46} {value / MB:>12,.1f} {value / score_tile:>13,.1f}")
    print(f"{'time per batch':<22} {'min s':>8} {'median s':>9} {'users/s (median)':>17} {'total s':>8}")
    for name, times in (("with exclusions", seconds), ("without (--compare-plain)", plain)):
        if times:
            median = statistics.median(times)
            rate = B / median
            print(f"{name:<22} {min(times):>8.2f} {median:>9.2f} {rate:>17,.1f} {sum(times):>8.1f}")


if __name__ == "__main__":
    main()

"""Shared by the kernel benchmarks: device names, synchronising clocks, timed repeats."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a clock read after it covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> tuple[list[float], object]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds, out


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """MiB allocated at the peak of one call of ``fn``, above what was allocated before it (CUDA
    only; NaN elsewhere)."""
    if device.type != "cuda":
        return float("nan")
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20

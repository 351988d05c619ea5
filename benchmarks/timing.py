"""Shared by the benchmarks: device names, synchronising clocks, timed repeats, summaries of
per-window rates and the machine's state to report with them."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

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


def summary(values: list[float]) -> dict:
    """Min, median and max of per-window rates, their count and every value (4 significant digits:
    a rate may be 0.05 updates/s or 50,000 events/s)."""
    def r(v: float) -> float:
        return float(f"{v:.4g}")

    return {"min": r(min(values)), "median": r(statistics.median(values)), "max": r(max(values)),
            "n": len(values), "all": [r(v) for v in values]}


def load_average() -> str:
    """The 1/5/15-minute load average, to record with a timing taken on a shared machine."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def last_json_line(text: str) -> dict:
    """The last line of a benchmark's output that is a JSON object (its machine-readable report)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output:\n" + text[-2000:])

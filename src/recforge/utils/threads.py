"""How many CPU threads a run computes with, chosen once at start (``extras.threads``, issue 21).

PyTorch starts one OpenMP thread per core and lets idle ones spin while they wait for the next
parallel region. Beside another CPU-bound job the threads then wait on cores that job holds, and a
small-step run collapses: GRU4Rec's default run on a 2-core box with one busy process beside it
fell from ~7,000 to ~1,700 events/s at 2 threads, while at 1 thread it kept ~7,900
(benchmarks/README.md, `busy_machine.py`). So ``auto`` (the default) counts the CPUs that are
free when the run starts: the CPUs this process may use, less those the rest of the machine kept
busy over a quarter of a second (``/proc/stat``), shared among the run's processes on this
machine, at least one. An integer sets the count; the environment's ``OMP_NUM_THREADS`` wins over
both, as PyTorch already read it.

The count is logged at start. A run's floating-point sums can depend on it, so a run that must
repeat bit for bit on a busy machine sets it (``extras.threads=2``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from recforge.errors import UserInputError

SAMPLE_SECONDS = 0.25
_OURS = "_RECFORGE_THREADS_SET"  # "<count>:<pid>": the OMP_NUM_THREADS a recforge process exported


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a SLURM or taskset share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_times(stat: Path) -> tuple[int, int]:
    """(busy, total) jiffies of every CPU together, from /proc/stat's first line."""
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def busy_cpus(seconds: float = SAMPLE_SECONDS, stat: Path = Path("/proc/stat")) -> float | None:
    """How many CPUs the machine kept busy over ``seconds`` while this process slept; None where
    /proc/stat is not there to read."""
    try:
        busy0, total0 = _cpu_times(stat)
        time.sleep(seconds)
        busy1, total1 = _cpu_times(stat)
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1)


def choose_threads(setting: int | str, processes: int = 1, environ: dict[str, str] | None = None,
                   busy: float | None = None, cpus: int | None = None) -> tuple[int | None, str]:
    """The thread count for ``setting`` and the line that says why; None: leave PyTorch's.

    ``busy``: CPUs busy with other work (measured when None); ``cpus``: the CPUs this process may
    use (its affinity when None).
    """
    environ = os.environ if environ is None else environ
    given = environ.get("OMP_NUM_THREADS")
    ours, _, setter = environ.get(_OURS, "").partition(":")
    if given is not None and given != ours:
        return None, f"threads: {given} (OMP_NUM_THREADS, from the environment; extras.threads not applied)"
    if given is not None and setter != str(os.getpid()):
        # a DDP rank or a launched job: its launching recforge process chose for all of them
        return None, f"threads: {given} (chosen by the launching process)"
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int)) or (
            isinstance(setting, int) and setting < 1):
        raise UserInputError(f"extras.threads: expected auto or a whole number >= 1; got {setting!r}")
    if isinstance(setting, int):
        return setting, f"threads: {setting} (extras.threads)"
    cpus = available_cpus() if cpus is None else cpus
    busy = busy_cpus() if busy is None else busy
    processes = max(1, int(processes))
    if busy is None:
        free, why = cpus, f"{cpus} CPUs, load not readable"
    else:
        free = max(1, cpus - round(busy))
        why = f"{cpus} CPUs, {busy:.1f} busy with other work"
    count = max(1, free // processes)
    share = f" / {processes} processes" if processes > 1 else ""
    return count, f"threads: {count} (auto: {why}{share}; extras.threads=N to choose)"


def apply_threads(setting: int | str, processes: int = 1) -> str:
    """Choose (:func:`choose_threads`) and set the count for this process and the ones it starts
    (DDP ranks, DataLoader workers read ``OMP_NUM_THREADS``); return the line to log."""
    count, line = choose_threads(setting, processes)
    if count is not None:
        import torch

        torch.set_num_threads(count)
        # Lightning's DDP would otherwise set its own count (cores / processes) in each rank
        os.environ["OMP_NUM_THREADS"] = str(count)
        os.environ[_OURS] = f"{count}:{os.getpid()}"
    return line

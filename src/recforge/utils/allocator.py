"""glibc's malloc told, once at start, to keep the memory a run frees (``extras.malloc``, issue 22).

PyTorch's CPU allocator takes every tensor from ``malloc``. glibc serves a request above its mmap
threshold (128 KiB at first, raised on the fly up to 32 MiB) with a fresh ``mmap`` and gives it back
with ``munmap`` when the tensor dies, and it trims the top of the heap whenever 128 KiB are free
there. A training or evaluation step makes the same large temporaries every time (attention scores,
catalogue-wide score tiles, gradients), so under the defaults every step asks the kernel for new
pages and pays a zero-filled page fault for each 4 KiB of them: measured on HSTU ml-1m, 9 s of a
30 s benchmark in the kernel, and evaluation at half speed; the reference research code spends more
than half its time there.

``keep`` (the default) sets ``M_MMAP_THRESHOLD`` to 1 GiB and ``M_TRIM_THRESHOLD`` to 2 GiB with
``mallopt`` (what the environment variables ``MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=2147483647`` do at start; mallopt takes a C int, so 2 GiB - 1 is its
largest trim threshold): freed blocks stay in the process and the next step reuses them. The process's peak memory is what was live at once, as before; what changes is that memory
freed after the peak is not handed back to the system before exit. ``default`` leaves glibc as it is.

A user's own ``MALLOC_*_`` variables or ``GLIBC_TUNABLES`` win: then nothing is changed and the
log says so. On a C library other than glibc (macOS, musl) there is nothing to set.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from typing import Literal

from recforge.errors import UserInputError

MallocPolicy = Literal["keep", "default"]
POLICIES: tuple[str, ...] = ("keep", "default")

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

KEEP_SETTINGS = {"M_MMAP_THRESHOLD": 1 << 30, "M_TRIM_THRESHOLD": (1 << 31) - 1}
_PARAMETER = {"M_MMAP_THRESHOLD": M_MMAP_THRESHOLD, "M_TRIM_THRESHOLD": M_TRIM_THRESHOLD}
# the environment through which glibc reads the same settings at process start
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_environment() -> dict[str, str]:
    """The environment variables through which glibc applies ``keep``'s settings to a process at
    its start: for a benchmark to give code that does not run through recforge (a reference
    implementation) the same allocator as recforge."""
    return {"MALLOC_MMAP_THRESHOLD_": str(KEEP_SETTINGS["M_MMAP_THRESHOLD"]),
            "MALLOC_TRIM_THRESHOLD_": str(KEEP_SETTINGS["M_TRIM_THRESHOLD"])}


def _libc() -> ctypes.CDLL | None:
    name, _ = platform.libc_ver()
    if name != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "mallopt") else None


def apply_malloc_policy(policy: str, environ: dict[str, str] | None = None) -> str:
    """Apply ``policy`` to this process's malloc; return the one line that says what was done.

    Processes forked afterwards (DataLoader workers) inherit the setting; DDP ranks and multirun
    jobs are started through the pipeline and apply it themselves.
    """
    if policy not in POLICIES:
        raise UserInputError(f"extras.malloc: expected one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "default":
        return "malloc: glibc's defaults (extras.malloc=default)"
    environ = os.environ if environ is None else environ
    users = [name for name in USER_VARIABLES if name in environ]
    if users:
        return f"malloc: left to the environment ({', '.join(users)} set); extras.malloc=keep not applied"
    libc = _libc()
    if libc is None:
        return f"malloc: not glibc ({platform.libc_ver()[0] or platform.system()}); extras.malloc=keep has nothing to set"
    refused = [name for name, value in KEEP_SETTINGS.items()
               if libc.mallopt(ctypes.c_int(_PARAMETER[name]), ctypes.c_int(value)) != 1]
    if refused:
        # an old glibc caps M_MMAP_THRESHOLD at 32 MiB; whatever it accepted still holds
        return f"malloc: glibc refused {', '.join(refused)}; extras.malloc=keep applied in part"
    return ("malloc: freed memory kept for reuse (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB; "
            "extras.malloc=default turns this off)")

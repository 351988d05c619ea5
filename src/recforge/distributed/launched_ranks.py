"""DDP ranks that Lightning starts as child processes end with the process that started them.

``hardware=ddp_cpu`` (and ``ddp`` on GPUs) runs rank 0 as the command a user typed; Lightning's
subprocess launcher starts ranks 1.. as its children (``LOCAL_RANK`` > 0 in their environment).
When rank 0 ends normally or on an error, Lightning stops them. When rank 0 is SIGKILLed (the
out-of-memory killer, ``kill -9``, a test's timeout) nothing runs in it, and the other ranks would
wait in their next collective for gloo's or NCCL's timeout (30 minutes), holding memory and
cores. :func:`end_with_rank_zero` asks the kernel to send them SIGTERM when their parent dies.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launched_by_rank_zero() -> bool:
    """Whether this process is a rank > 0 that Lightning's subprocess launcher started."""
    return os.environ.get("LOCAL_RANK", "0") not in ("", "0") and "WORLD_SIZE" in os.environ


def end_with_rank_zero() -> bool:
    """In a launched rank on Linux: SIGTERM when the parent (rank 0) dies; exit at once if it died
    already. Returns whether the request was made (False elsewhere: a no-op)."""
    if not launched_by_rank_zero() or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("could not ask to end with rank 0 (prctl errno %d)", ctypes.get_errno())
        return False
    if os.getppid() == 1:  # rank 0 died before the request: this rank was handed to init
        log.error("rank 0, which started this rank, has exited: stopping")
        raise SystemExit(1)
    return True

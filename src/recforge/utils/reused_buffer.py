"""One scratch tensor kept by its owner and handed out again at every call made without autograd.

An evaluation batch makes the same large temporaries every time (HSTU's time-bucket grid and
its layers' projections: 70-80 MB each for 512 ml-1m histories). Under glibc's default settings each
of them is a fresh ``mmap`` and a page fault per 4 KiB, at every batch (issue 22;
:mod:`recforge.utils.allocator` is the process-wide answer, this one needs no setting).

The tensor :meth:`ReusedBuffer.take` returns is overwritten by the next ``take``: the owner uses
it within one call and returns nothing that views it. Under autograd, where a saved tensor may
outlive the call, ``take`` gives a fresh tensor instead, so a graph never holds the scratch; so it
does off the CPU, where PyTorch's caching allocator already reuses blocks.
"""
from __future__ import annotations

import math

import torch


class ReusedBuffer:
    """A flat storage that grows to the largest request and is viewed to each request's shape."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous ``shape`` tensor: the kept storage where autograd is off,
        a new tensor where it is on (see the module docstring)."""
        if torch.is_grad_enabled() or torch.device(device).type != "cpu":
            # (on a GPU the caching allocator already hands the same blocks out again)
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        kept = self._storage
        # an inference-mode tensor cannot be written outside inference mode (and the reverse is
        # kept apart too, so the storage is always of the kind the call is in)
        if kept is None or kept.dtype != dtype or kept.device != torch.device(device) or kept.numel() < numel \
                or kept.is_inference() != torch.is_inference_mode_enabled():
            # the old storage is released first, so the peak holds one of them
            self._storage = kept = None
            self._storage = kept = torch.empty(numel, dtype=dtype, device=device)
        return kept[:numel].view(shape)

    @property
    def held(self) -> int:
        """Elements of the kept storage (0: none)."""
        return 0 if self._storage is None else self._storage.numel()

    def release(self) -> None:
        """Let the storage go (the owner's evaluation is over)."""
        self._storage = None

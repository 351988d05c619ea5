"""Whether a Triton kernel runs in Triton's interpreter (for the ``*_triton`` modules: imports Triton)."""
from __future__ import annotations

import triton


def interpreted(kernel) -> bool:
    """Whether ``kernel`` was defined under ``TRITON_INTERPRET=1`` (so it takes CPU tensors).

    Triton reads the variable when ``@triton.jit`` runs, not at launch, so the kernel object is
    what to ask: the environment may have changed since the module was imported.
    """
    return not isinstance(kernel, triton.runtime.JITFunction)

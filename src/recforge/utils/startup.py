"""A command's imports run with Python's cycle collector held off.

Importing torch, Lightning (with torch._dynamo), Hydra and torchmetrics (with scipy.signal) makes
some 700,000 objects the collector tracks, nearly all of them alive to the end, and on the way it
runs seven full collections over them: ``import recforge.pipeline`` takes 3.6 s with the collector
on and 2.8-2.9 s with it off on a 2-core machine, measured, and the collections free about 12,000
objects. A GRU4Rec sample run takes about a minute, so that is more than 1 % of one.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the block (a command's imports) with the cycle collector off.

    What exists at the end is then frozen (``gc.freeze``): the collector no longer walks those
    objects, which modules and classes keep alive to the end anyway, so later collections are
    cheaper too. They are unfrozen at exit, so that the interpreter's shutdown frees them as it
    would have (Triton's bindings report them as leaked otherwise).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        atexit.register(gc.unfreeze)
        if enabled:
            gc.enable()

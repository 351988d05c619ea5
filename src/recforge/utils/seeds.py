"""Seeds derived from the run seed for one purpose each, so that no two random streams of a run
replay each other's draws, nor the run seed's own (which draws the initial weights)."""
from __future__ import annotations

import numpy as np

_STEP_STREAM = 0x737465  # "ste": the per-step seeds of torch's global generator


def derived_seed(seed: int, *key: int) -> int:
    """A 63-bit seed for ``(seed, key...)``; distinct keys give unrelated seeds."""
    words = np.random.SeedSequence(int(seed), spawn_key=tuple(int(k) for k in key))
    high, low = (int(w) for w in words.generate_state(2, dtype=np.uint32))
    return (high << 32 | low) & 0x7FFF_FFFF_FFFF_FFFF


def step_seed(seed: int, rank: int, step: int) -> int:
    """The seed of torch's global generator for one training step: a function of the run seed,
    the DDP rank and the step alone, so a run resumed from any checkpoint draws in step t what an
    uninterrupted run drew in step t (dropout masks, HSTU's mask-hash seeds), whatever else drew
    from the generator since the run started (a loader's base seed, a sanity check)."""
    return derived_seed(seed, _STEP_STREAM, rank, step)

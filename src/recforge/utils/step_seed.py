"""The seed of torch's global generator for one training step: a function of the run seed, the DDP
rank and the step alone, so a run resumed from any checkpoint draws in step t what an
uninterrupted run drew in step t (dropout masks, HSTU's mask-hash seeds), whatever else drew from
the generator since the run started (a loader's base seed, a sanity check, an evaluation)."""
from __future__ import annotations

import numpy as np

_STEP_STREAM = 0x737465  # "ste": apart from the negatives' streams and from the run seed itself


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for (run seed, rank, step); distinct inputs give unrelated seeds."""
    words = np.random.SeedSequence(int(seed), spawn_key=(_STEP_STREAM, int(rank), int(step)))
    high, low = (int(w) for w in words.generate_state(2, dtype=np.uint32))
    return (high << 32 | low) & 0x7FFF_FFFF_FFFF_FFFF

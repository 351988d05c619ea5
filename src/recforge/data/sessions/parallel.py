"""Session-parallel mini-batching (GRU4Rec, spec §1.2), over flat arrays plus session offsets.

B slots run side by side. Every step feeds the next event of each active session and asks for the one
after it, so a session of length L yields exactly L-1 (input, target) pairs. A slot whose session has
no event left takes the next unused session (its hidden rows are zeroed); once the sessions run out,
finished slots are dropped and the batch shrinks instead of dropping events.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass
class StepPositions:
    """Positions (into the flat event arrays) of one step, plus how to carry the hidden state.

    ``keep`` (indices into the previous step's rows, or None for all) is applied before ``reset``.
    """

    inputs: np.ndarray
    targets: np.ndarray
    reset: np.ndarray
    keep: np.ndarray | None


def session_order_by_start(offsets: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Sessions in ascending order of their first event's time; ties keep the sessions' order.

    The reference sorts with numpy's default argsort, whose order among equal keys depends on
    the CPU (numpy dispatches to different SIMD sorts on AVX2 and AVX-512 machines). A stable sort
    gives one order everywhere: sessions that start at the same instant follow session id, which
    is also what the reference's AVX-512 sort gave on its recorded trajectories.
    """
    return np.argsort(times[offsets[:-1]], kind="stable")


def session_parallel_positions(
    offsets: np.ndarray,
    order: np.ndarray,
    batch_size: int,
    min_rows: int = 1,
) -> Iterator[StepPositions]:
    """Yield the steps of one epoch.

    Args:
        offsets: ``[S+1]`` session boundaries in the flat event arrays.
        order: ``[S']`` the sessions to visit, in visiting order (a subset for one DDP rank).
        batch_size: number of slots B.
        min_rows: stop the epoch once fewer active slots remain (2 when the mini-batch's own targets
            are the only negatives: a single row has nothing to be ranked against).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n_sessions = len(order)
    if n_sessions == 0:
        return
    n_slots = min(batch_size, n_sessions)
    slot_session = np.arange(n_slots)  # index into `order` held by each slot
    next_session = n_slots
    start = offsets[order[slot_session]].astype(np.int64)
    end = offsets[order[slot_session] + 1].astype(np.int64)
    # Pending hidden-state transform, composed over rounds that yield no step (sessions of length 1).
    reset = np.ones(n_slots, dtype=bool)
    keep: np.ndarray | None = None
    if n_slots < min_rows:
        return
    while True:
        minlen = int((end - start).min())
        for i in range(minlen - 1):
            yield StepPositions(start + i, start + i + 1, reset, keep)
            reset = np.zeros(len(start), dtype=bool)
            keep = None
        start = start + max(minlen - 1, 0)
        finished = (end - start) <= 1
        n_finished = int(finished.sum())
        slot_session = slot_session.copy()
        slot_session[finished] = next_session + np.arange(n_finished)
        next_session += n_finished
        valid = slot_session < n_sessions
        n_valid = int(valid.sum())
        if n_valid == 0 or n_valid < min_rows:
            return
        refill = finished & valid
        if refill.any():
            sessions = order[slot_session[refill]]
            start[refill] = offsets[sessions]
            end[refill] = offsets[sessions + 1]
        new_reset = reset | finished
        if n_valid < len(valid):
            kept = np.flatnonzero(valid)
            keep = kept if keep is None else keep[kept]
            new_reset = new_reset[kept]
            slot_session, start, end = slot_session[kept], start[kept], end[kept]
        reset = new_reset


def count_steps(offsets: np.ndarray, order: np.ndarray, batch_size: int, min_rows: int = 1) -> int:
    """Number of steps :func:`session_parallel_positions` yields (used to even out DDP ranks)."""
    return sum(1 for _ in session_parallel_positions(offsets, order, batch_size, min_rows))

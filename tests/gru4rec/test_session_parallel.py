"""Session-parallel mini-batching (spec §1.2) replayed against naive oracles.

Two independent oracles:
  * a per-row replay: a fake hidden state (one session label per row, ``FRESH`` after a reset) is
    carried through each step's keep/reset, and every row must continue the session it holds, or
    start a session exactly when its hidden row was reset;
  * a plain transcription of the reference's loop (GRU4Rec PyTorch port ``SessionDataIterator``)
    that applies each round's reset/drop eagerly to a labelled hidden array.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pandas as pd
import pytest
import torch

from recforge.data.batches import SessionStep
from recforge.data.sessions.datasets import SessionParallelSteps
from recforge.data.sessions.parallel import (
    count_steps,
    session_order_by_start,
    session_parallel_positions,
)
from recforge.data.sessions.store import ItemCatalog, SessionArrays

FRESH = -1


# ----------------------------------------------------------------------------- helpers
def make_offsets(lengths) -> np.ndarray:
    return np.r_[0, np.cumsum(lengths)].astype(np.int64)


def random_lengths(rng: np.random.Generator, n_sessions: int) -> np.ndarray:
    lengths = rng.integers(1, 8, size=n_sessions)
    # Make sure the short cases (length 1 and 2) are there, wherever the random draw put them.
    if n_sessions >= 4:
        pos = rng.choice(n_sessions, size=4, replace=False)
        lengths[pos[:2]] = 1
        lengths[pos[2:]] = 2
    return lengths


def session_of(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return np.searchsorted(offsets, positions, side="right") - 1


def replay(offsets: np.ndarray, steps) -> dict:
    """Naive per-row replay of the yielded steps; asserts the per-step invariants.

    Returns the pairs of each session (in the order they were yielded), the step at which each
    session started, and the batch size of every step.
    """
    state: np.ndarray | None = None  # per-row label: the session the row's hidden state belongs to
    pairs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    started_at: dict[int, int] = {}
    sizes = []
    for t, st in enumerate(steps):
        n = len(st.inputs)
        assert len(st.targets) == n and len(st.reset) == n
        assert st.reset.dtype == bool
        if state is None:
            # First step of the epoch: the hidden state is None -> zeros for every row.
            state = np.full(n, FRESH)
        else:
            if st.keep is not None:
                keep = np.asarray(st.keep)
                assert len(keep) == n
                assert len(np.unique(keep)) == n, "a previous row kept twice"
                assert keep.min() >= 0 and keep.max() < len(state)
                state = state[keep]
            else:
                assert len(state) == n, "row count changed without keep"
            state = np.where(st.reset, FRESH, state)
        sess = session_of(offsets, st.inputs)
        np.testing.assert_array_equal(st.targets, st.inputs + 1)
        assert (st.targets < offsets[sess + 1]).all(), "target crosses a session boundary"
        for r in range(n):
            s = int(sess[r])
            is_first = st.inputs[r] == offsets[s]
            if state[r] == FRESH:
                assert is_first, f"step {t} row {r}: hidden reset in the middle of session {s}"
                assert s not in started_at, f"session {s} started twice"
                started_at[s] = t
            else:
                assert not is_first, f"step {t} row {r}: session {s} starts without a reset"
                assert state[r] == s, f"step {t} row {r}: carries session {state[r]}, feeds {s}"
                assert pairs[s][-1][1] == st.inputs[r], "session events skipped or reordered"
            pairs[s].append((int(st.inputs[r]), int(st.targets[r])))
            state[r] = s  # the step writes this session's state into the row
        sizes.append(n)
    return {"pairs": pairs, "started_at": started_at, "sizes": sizes}


def reference_steps(offsets: np.ndarray, order: np.ndarray, batch_size: int, min_rows: int = 1):
    """Plain transcription of the reference iterator, with an eagerly updated labelled hidden array.

    Returns ``[(inputs, targets, hidden_seen_by_step)]`` where the hidden label is session+1 and 0
    means a zeroed row.
    """
    n_sessions = len(order)
    n = min(batch_size, n_sessions)
    if n == 0 or n < min_rows:
        return []
    iters = np.arange(n)
    maxiter = n - 1
    start = offsets[order[iters]].copy()
    end = offsets[order[iters] + 1].copy()
    hidden = np.zeros(n, dtype=np.int64)
    out = []
    while True:
        minlen = int((end - start).min())
        for i in range(minlen - 1):
            out.append((start + i, start + i + 1, hidden.copy()))
            hidden = order[iters] + 1  # the state this step leaves in each row
        start = start + minlen - 1
        finished = (end - start) <= 1
        n_finished = int(finished.sum())
        iters[finished] = maxiter + np.arange(1, n_finished + 1)
        maxiter += n_finished
        valid = iters < n_sessions
        n_valid = int(valid.sum())
        if n_valid == 0 or n_valid < min_rows:
            break
        refill = finished & valid
        start[refill] = offsets[order[iters[refill]]]
        end[refill] = offsets[order[iters[refill]] + 1]
        hidden[finished] = 0
        hidden, iters, start, end = hidden[valid], iters[valid], start[valid], end[valid]
    return out


def expected_pairs(offsets: np.ndarray, sessions) -> dict[int, list[tuple[int, int]]]:
    out = {}
    for s in sessions:
        a, b = int(offsets[s]), int(offsets[s + 1])
        if b - a >= 2:
            out[int(s)] = [(p, p + 1) for p in range(a, b - 1)]
    return out


CASES = [
    # (n_sessions, batch_size, seed)
    (30, 5, 0),  # more sessions than slots
    (30, 3, 1),
    (50, 8, 2),
    (7, 12, 3),  # fewer sessions than slots
    (1, 4, 4),
    (2, 1, 5),
    (12, 1, 6),  # a single slot
    (25, 25, 7),  # exactly as many
]


def test_sessions_starting_together_keep_their_order():
    # Many sessions share a start time: numpy's default argsort may order them differently from
    # one CPU to the next; the training order must not.
    rng = np.random.default_rng(3)
    n_sessions = 500
    lengths = random_lengths(rng, n_sessions)
    offsets = make_offsets(lengths)
    first_times = rng.integers(0, 4, n_sessions).astype(np.float64)
    times = np.repeat(first_times, lengths) + np.concatenate([np.arange(k) for k in lengths])
    want = sorted(range(n_sessions), key=lambda s: (first_times[s], s))
    np.testing.assert_array_equal(session_order_by_start(offsets, times), want)


# ----------------------------------------------------------------------------- the iterator
@pytest.mark.parametrize("n_sessions,batch_size,seed", CASES)
@pytest.mark.parametrize("order_kind", ["by_start", "random"])
def test_replay_every_pair_once_in_order(n_sessions, batch_size, seed, order_kind):
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, n_sessions)
    offsets = make_offsets(lengths)
    if order_kind == "by_start":
        first_times = rng.permutation(n_sessions).astype(np.float64)
        times = np.repeat(first_times, lengths) + np.concatenate([np.arange(k) for k in lengths]) * 1e-3
        order = session_order_by_start(offsets, times)
        np.testing.assert_array_equal(order, np.argsort(first_times))
    else:
        order = rng.permutation(n_sessions)

    steps = list(session_parallel_positions(offsets, order, batch_size))
    got = replay(offsets, steps)

    # Every (input, target) pair of every session exactly once, in order; the first event is never
    # a target; sessions of length 1 contribute nothing.
    assert dict(got["pairs"]) == expected_pairs(offsets, order)
    all_targets = np.concatenate([st.targets for st in steps]) if steps else np.zeros(0, int)
    assert len(all_targets) == int((lengths - 1).sum())
    assert not np.isin(all_targets, offsets[:-1]).any()

    # Sessions start in the order given by `order` (several may start in the same step).
    long_in_order = [int(s) for s in order if lengths[s] >= 2]
    start_steps = [got["started_at"][s] for s in long_in_order]
    assert start_steps == sorted(start_steps)

    # The batch never grows, never exceeds B, is full while sessions remain, and shrinks only once
    # every session has been started.
    sizes = got["sizes"]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert max(sizes, default=0) <= batch_size
    if len(long_in_order) >= batch_size:
        assert sizes[0] == batch_size
    shrink = next((t for t in range(1, len(sizes)) if sizes[t] < sizes[t - 1]), None)
    if shrink is not None:
        assert max(start_steps) <= shrink

    assert count_steps(offsets, order, batch_size) == len(steps)


@pytest.mark.parametrize("n_sessions,batch_size,seed", CASES)
@pytest.mark.parametrize("min_rows", [1, 2])
def test_matches_reference_loop_exactly(n_sessions, batch_size, seed, min_rows):
    rng = np.random.default_rng(100 + seed)
    lengths = random_lengths(rng, n_sessions)
    offsets = make_offsets(lengths)
    order = rng.permutation(n_sessions)
    steps = list(session_parallel_positions(offsets, order, batch_size, min_rows))
    ref = reference_steps(offsets, order, batch_size, min_rows)
    # Under min_rows=2 the implementation does not start an epoch it could not fill with 2 rows.
    if min_rows == 2 and min(batch_size, n_sessions) < 2:
        assert steps == []
        return
    assert len(steps) == len(ref)
    hidden = None
    for t, (st, (inp, tgt, h_ref)) in enumerate(zip(steps, ref)):
        np.testing.assert_array_equal(st.inputs, inp)
        np.testing.assert_array_equal(st.targets, tgt)
        if hidden is None:
            h = np.zeros(len(st.inputs), dtype=np.int64)
        else:
            h = hidden if st.keep is None else hidden[st.keep]
            h = np.where(st.reset, 0, h)
        np.testing.assert_array_equal(h, h_ref, err_msg=f"hidden rows at step {t}")
        hidden = session_of(offsets, st.inputs) + 1


def test_min_rows_two_stops_when_fewer_than_two_rows_remain():
    rng = np.random.default_rng(11)
    # One long session at the end keeps a single slot alive after all others finished.
    lengths = np.r_[random_lengths(rng, 20), 15]
    offsets = make_offsets(lengths)
    order = np.arange(len(lengths))
    full = list(session_parallel_positions(offsets, order, 4, min_rows=1))
    sizes = [len(st.inputs) for st in full]
    assert sizes[-1] == 1, "the test data should end with single-row steps"
    cut = sizes.index(1)
    two = list(session_parallel_positions(offsets, order, 4, min_rows=2))
    assert len(two) == cut
    assert all(len(st.inputs) >= 2 for st in two)
    for a, b in zip(full[:cut], two):
        np.testing.assert_array_equal(a.inputs, b.inputs)
        np.testing.assert_array_equal(a.targets, b.targets)
    assert count_steps(offsets, order, 4, min_rows=2) == cut
    # A single session or a single slot cannot give 2 rows at all.
    assert list(session_parallel_positions(make_offsets([5]), np.arange(1), 4, min_rows=2)) == []
    assert list(session_parallel_positions(offsets, order, 1, min_rows=2)) == []


def test_hand_example():
    # Sessions (by position): s0=[0,1,2] s1=[3] s2=[4,5] s3=[6,7,8,9]; B=2, order s0..s3.
    offsets = make_offsets([3, 1, 2, 4])
    steps = list(session_parallel_positions(offsets, np.arange(4), 2))
    # Round 1: slots (s0, s1): s1 has length 1 -> no step; slot 1 takes s2 (reset stays pending).
    # Round 2: slots (s0, s2): minlen 2 -> one step (0->1, 4->5); slot 1 takes s3 (reset).
    # Round 3: slots (s0, s3): minlen 2 -> one step (1->2, 6->7); slot 0 runs out -> dropped.
    # Round 4: slot (s3): two steps (7->8, 8->9).
    assert [st.inputs.tolist() for st in steps] == [[0, 4], [1, 6], [7], [8]]
    assert [st.targets.tolist() for st in steps] == [[1, 5], [2, 7], [8], [9]]
    assert steps[0].reset.tolist() == [True, True]
    assert steps[1].reset.tolist() == [False, True] and steps[1].keep is None
    assert steps[2].keep.tolist() == [1] and steps[2].reset.tolist() == [False]
    assert steps[3].keep is None and steps[3].reset.tolist() == [False]


def test_empty_order_and_bad_batch_size():
    offsets = make_offsets([2, 3])
    assert list(session_parallel_positions(offsets, np.zeros(0, dtype=np.int64), 3)) == []
    assert count_steps(offsets, np.zeros(0, dtype=np.int64), 3) == 0
    with pytest.raises(ValueError):
        list(session_parallel_positions(offsets, np.arange(2), 0))


# ----------------------------------------------------------------------------- DDP split + padding
def _arrays(lengths, rng) -> SessionArrays:
    offsets = make_offsets(lengths)
    items = rng.integers(0, 40, size=int(offsets[-1])).astype(np.int64)
    first = rng.permutation(len(lengths)).astype(np.float64)
    times = np.repeat(first, lengths)
    return SessionArrays(items, times, offsets, session_order_by_start(offsets, times))


@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_ddp_partition_covers_single_process_and_pads(batch_size):
    rng = np.random.default_rng(21 + batch_size)
    arrays = _arrays(random_lengths(rng, 23), rng)
    world = 2
    single = replay(arrays.offsets, list(session_parallel_positions(arrays.offsets, arrays.order, batch_size)))
    single_pairs = sorted(p for ps in single["pairs"].values() for p in ps)

    orders = [arrays.partition(rank, world) for rank in range(world)]
    assert sorted(np.concatenate(orders).tolist()) == list(range(arrays.n_sessions))
    assert abs(len(orders[0]) - len(orders[1])) <= 1
    rank_pairs = []
    counts = []
    for order in orders:
        got = replay(arrays.offsets, list(session_parallel_positions(arrays.offsets, order, batch_size)))
        assert dict(got["pairs"]) == expected_pairs(arrays.offsets, order)
        rank_pairs += [p for ps in got["pairs"].values() for p in ps]
        counts.append(count_steps(arrays.offsets, order, batch_size))
    assert sorted(rank_pairs) == single_pairs
    assert len(single_pairs) == arrays.n_targets

    pad_to = max(counts)
    lens = []
    for order, n_real in zip(orders, counts):
        ds = SessionParallelSteps(arrays, order, batch_size, pad_to=pad_to)
        assert len(ds) == pad_to
        batches = list(ds)
        lens.append(len(batches))
        assert all(b.size > 0 for b in batches[:n_real])
        for b in batches[n_real:]:
            assert b.size == 0 and b.targets.numel() == 0 and b.reset.numel() == 0
            # An empty step carries an empty hidden state.
            assert [h.shape for h in b.carry_hidden([torch.ones(3, 2)], [2])] == [(0, 2)]
        # The real steps carry the items of the positions.
        for b, pos in zip(batches, session_parallel_positions(arrays.offsets, order, batch_size)):
            assert b.inputs.tolist() == arrays.items[pos.inputs].tolist()
            assert b.targets.tolist() == arrays.items[pos.targets].tolist()
    assert lens == [pad_to, pad_to]
    # Without pad_to the length is the real step count.
    assert len(SessionParallelSteps(arrays, orders[0], batch_size)) == counts[0]


def test_dataset_with_carry_hidden_matches_reference():
    rng = np.random.default_rng(5)
    lengths = random_lengths(rng, 40)
    arrays = _arrays(lengths, rng)
    # Label each event's position as its item, so a batch tells which session each row is.
    arrays = SessionArrays(
        np.arange(arrays.n_events, dtype=np.int64), arrays.times, arrays.offsets, arrays.order
    )
    ref = reference_steps(arrays.offsets, arrays.order, 6, min_rows=2)
    hidden = None
    n = 0
    for batch, (inp, _, h_ref) in zip(SessionParallelSteps(arrays, arrays.order, 6, min_rows=2), ref):
        state = batch.carry_hidden(hidden, [1, 3])
        assert [tuple(h.shape) for h in state] == [(batch.size, 1), (batch.size, 3)]
        assert batch.inputs.tolist() == inp.tolist()
        for h in state:
            assert (h == torch.from_numpy(h_ref).float().unsqueeze(1)).all()
        label = torch.from_numpy(session_of(arrays.offsets, batch.inputs.numpy()) + 1).float()
        hidden = [label.unsqueeze(1), label.unsqueeze(1).repeat(1, 3)]
        n += 1
    assert n == len(ref) > 0


# ----------------------------------------------------------------------------- SessionStep.carry_hidden
def test_carry_hidden_keep_then_reset():
    prev = [torch.arange(4.0).unsqueeze(1) + 1, (torch.arange(4.0).unsqueeze(1) + 1) * torch.ones(4, 3)]
    snapshot = [h.clone() for h in prev]
    step = SessionStep(
        inputs=torch.tensor([7, 8, 9]),
        targets=torch.tensor([1, 2, 3]),
        reset=torch.tensor([True, False, False]),
        keep=torch.tensor([3, 0, 2]),
    )
    out = step.carry_hidden(prev, [1, 3])
    # keep first: rows (old 3, old 0, old 2) -> labels (4, 1, 3); then reset row 0 of the new rows.
    assert out[0].squeeze(1).tolist() == [0.0, 1.0, 3.0]
    assert out[1].tolist() == [[0.0] * 3, [1.0] * 3, [3.0] * 3]
    # The previous state is not modified in place.
    for a, b in zip(prev, snapshot):
        assert torch.equal(a, b)


def test_carry_hidden_reset_only_and_none():
    prev = [torch.tensor([[1.0, 2.0], [3.0, 4.0]])]
    step = SessionStep(torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([False, True]))
    assert step.carry_hidden(prev, [2])[0].tolist() == [[1.0, 2.0], [0.0, 0.0]]
    zeros = step.carry_hidden(None, [2, 5])
    assert [tuple(h.shape) for h in zeros] == [(2, 2), (2, 5)]
    assert all(h.dtype == torch.float32 and not h.any() for h in zeros)
    assert step.size == 2


# ----------------------------------------------------------------------------- store
def test_item_catalog_first_appearance_and_popularity():
    cat = ItemCatalog.from_events(pd.Series(["b", "a", "b", "c", "a", "b"]))
    assert list(cat.item_ids) == ["b", "a", "c"]
    assert cat.popularity.tolist() == [3, 2, 1]
    assert cat.n_items == 3
    assert cat.index_of(pd.Series(["c", "zz", "b"])).tolist() == [2, -1, 0]


def test_from_frame_deletes_unknown_items_and_splices_sessions():
    catalog = ItemCatalog.from_events(pd.Series(["a", "b", "c", "d"]))
    frame = pd.DataFrame(
        {
            "SessionId": [1, 1, 1, 1, 2, 2, 3, 3, 3, 4, 5, 5],
            "ItemId": ["a", "x", "b", "c", "y", "z", "d", "y", "d", "b", "x", "c"],
            "Time": [50.0, 51, 52, 53, 10, 11, 30, 31, 32, 5, 1, 2],
        }
    )
    arrays = SessionArrays.from_frame(frame, catalog)
    # Session 1 loses "x" (a,b,c spliced); session 2 is all unknown and disappears; session 3 keeps
    # d,d; session 4 keeps its single event; session 5 keeps only c.
    assert arrays.items.tolist() == [0, 1, 2, 3, 3, 1, 2]
    assert arrays.times.tolist() == [50, 52, 53, 30, 32, 5, 2]
    assert arrays.offsets.tolist() == [0, 3, 5, 6, 7]
    assert arrays.n_sessions == 4 and arrays.n_events == 7 and arrays.n_targets == 3
    # Visiting order by first event time: s5 (t=2), s4 (5), s3 (30), s1 (50).
    assert arrays.order.tolist() == [3, 2, 1, 0]
    # Only the spliced pairs are trained on: (a->b), (b->c), (d->d).
    steps = list(session_parallel_positions(arrays.offsets, arrays.order, 2))
    pairs = sorted(
        (int(arrays.items[i]), int(arrays.items[t]))
        for st in steps
        for i, t in zip(st.inputs, st.targets)
    )
    assert pairs == [(0, 1), (1, 2), (3, 3)]


def test_from_frame_all_unknown_and_partition():
    catalog = ItemCatalog.from_events(pd.Series(["a"]))
    frame = pd.DataFrame({"SessionId": [1, 2], "ItemId": ["q", "r"], "Time": [1.0, 2.0]})
    arrays = SessionArrays.from_frame(frame, catalog)
    assert arrays.n_sessions == 0 and arrays.n_events == 0
    assert arrays.offsets.tolist() == [0]
    assert list(session_parallel_positions(arrays.offsets, arrays.order, 3)) == []

    arrays = SessionArrays(
        np.arange(5), np.arange(5.0), make_offsets([1, 1, 1, 1, 1]), np.array([4, 2, 0, 1, 3])
    )
    assert arrays.partition(0, 2).tolist() == [4, 0, 3]
    assert arrays.partition(1, 2).tolist() == [2, 1]

"""target_rank_counts with per-row exclusion lists, both twins against a brute-force oracle.

The oracle scores the full ``[B, N]`` matrix in float64 and drops each row's excluded items (never
its target) before counting. Embeddings are integer-valued, so every score is exact in float32,
bf16/fp16 products and any summation order: the twins must match the oracle exactly, heavy ties
included. Triton runs under the interpreter on CPU-only machines (tests/conftest.py sets
TRITON_INTERPRET=1), where it uses 16 x 32 x 16 tiles unless a test passes the GPU's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recforge.kernels import target_rank as tr
from recforge.kernels import target_rank_counts
from recforge.kernels.target_rank import sorted_exclusions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- problems and the oracle
def _embeddings(n_rows: int, n_items: int, dim: int, with_bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # values in {-1, 0, 1}: exact scores, and many items tie with each target
    queries = torch.randint(-1, 2, (n_rows, dim), generator=gen).float()
    items = torch.randint(-1, 2, (n_items, dim), generator=gen).float()
    bias = torch.randint(0, 2, (n_items,), generator=gen).float() if with_bias else None
    targets = torch.randint(0, n_items, (n_rows,), generator=gen)
    return queries, items, bias, targets


def _exclusions(targets: torch.Tensor, n_items: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged lists covering the awkward cases: empty, own target, duplicates, everything."""
    rng = np.random.default_rng(seed)
    lists = []
    for row, target in enumerate(targets.tolist()):
        case = row % 6
        if case == 0:
            ids = []
        elif case == 1:  # the whole catalogue, the target included: only the target is left
            ids = rng.permutation(n_items).tolist()
        elif case == 2:  # everything but the target, shuffled, some twice
            ids = [i for i in range(n_items) if i != target]
            ids = rng.permutation(ids + ids[: len(ids) // 3]).tolist()
        else:  # a random handful with repeats, sometimes holding the target
            ids = rng.integers(0, n_items, size=int(rng.integers(1, max(2, n_items // 2)))).tolist()
            ids += ids[:2]
            if case == 3:
                ids.append(target)
            ids = rng.permutation(ids).tolist()
        lists.append(ids)
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(ids) for ids in lists])
    flat = np.array([i for ids in lists for i in ids], dtype=np.int64)
    return torch.from_numpy(flat), torch.from_numpy(offsets)


def _oracle(queries, items, bias, targets, exclude_items, exclude_offsets) -> tuple[list, list]:
    scores = queries.double().cpu().numpy() @ items.double().cpu().numpy().T  # [B, N]
    if bias is not None:
        scores = scores + bias.double().cpu().numpy()
    ex, off = exclude_items.cpu().numpy(), exclude_offsets.cpu().numpy()
    n_greater, n_equal = [], []
    for row, target in enumerate(targets.tolist()):
        counted = np.ones(scores.shape[1], dtype=bool)
        counted[ex[off[row]:off[row + 1]]] = False
        counted[target] = True
        mine, theirs = scores[row, target], scores[row, counted]
        n_greater.append(int((theirs > mine).sum()))
        n_equal.append(int((theirs == mine).sum()))
    return n_greater, n_equal


def _problem(n_rows: int, n_items: int, dim: int, with_bias: bool, seed: int):
    q, w, b, t = _embeddings(n_rows, n_items, dim, with_bias, seed)
    ex, off = _exclusions(t, n_items, seed)
    return q, w, b, t, ex, off


def _on(device, *tensors):
    return [None if x is None else x.to(device) for x in tensors]


def _assert_counts(got, want) -> None:
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int64
    assert got[0].tolist() == want[0], "n_greater"
    assert got[1].tolist() == want[1], "n_equal"


SHAPES = [(1, 5, 3), (7, 23, 17), (20, 150, 40), (33, 97, 16)]


# ---------------------------------------------------------------- PyTorch twin
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_pytorch_matches_oracle(shape, with_bias) -> None:
    q, w, b, t, ex, off = _problem(*shape, with_bias, seed=sum(shape))
    want = _oracle(q, w, b, t, ex, off)
    n_items = shape[1]
    # one item per chunk, chunks not dividing N, one chunk exactly N, one larger than N
    for chunk_size in sorted({1, 7, 16, n_items, n_items + 5}):
        got = target_rank_counts(q, w, b, t, chunk_size=chunk_size, exclude_items=ex, exclude_offsets=off)
        _assert_counts(got, want)
    assert (torch.tensor(want[1]) > 1).any() or n_items <= 5  # the ties were there to be broken


def test_pytorch_random_problems() -> None:
    rng = np.random.default_rng(0)
    for seed in range(12):
        n_rows, n_items, dim = (int(rng.integers(1, high)) for high in (40, 120, 20))
        q, w, b, t, ex, off = _problem(n_rows, n_items, dim, bool(seed % 2), seed=100 + seed)
        chunk_size = int(rng.integers(1, n_items + 3))
        got = target_rank_counts(q, w, b, t, chunk_size=chunk_size, exclude_items=ex, exclude_offsets=off)
        _assert_counts(got, _oracle(q, w, b, t, ex, off))


def test_target_is_always_ranked() -> None:
    q, w, b, t = _embeddings(4, 30, 5, True, seed=3)
    everything = torch.arange(30).repeat(4)  # each row excludes the whole catalogue
    offsets = torch.arange(0, 121, 30)
    n_greater, n_equal = target_rank_counts(
        q, w, b, t, chunk_size=8, exclude_items=everything, exclude_offsets=offsets
    )
    assert n_greater.tolist() == [0] * 4 and n_equal.tolist() == [1] * 4


def test_without_or_empty_exclusions_is_the_plain_ranking() -> None:
    q, w, b, t = _embeddings(9, 40, 6, True, seed=4)
    plain = target_rank_counts(q, w, b, t, chunk_size=16)
    empty = target_rank_counts(
        q, w, b, t, chunk_size=16,
        exclude_items=torch.zeros(0, dtype=torch.long), exclude_offsets=torch.zeros(10, dtype=torch.long),
    )  # fmt: skip
    own_targets = target_rank_counts(
        q, w, b, t, chunk_size=16, exclude_items=t, exclude_offsets=torch.arange(10)
    )
    for got in (empty, own_targets):
        assert got[0].tolist() == plain[0].tolist() and got[1].tolist() == plain[1].tolist()


def test_lists_belong_to_their_rows() -> None:
    # row 0 excludes every item; row 1, with the same query and target, excludes nothing
    q = torch.ones(2, 3)
    w = torch.ones(10, 3)
    t = torch.tensor([4, 4])
    got = target_rank_counts(
        q, w, None, t, chunk_size=3,
        exclude_items=torch.arange(10), exclude_offsets=torch.tensor([0, 10, 10]),
    )  # fmt: skip
    assert got[0].tolist() == [0, 0] and got[1].tolist() == [1, 10]


def test_sorted_exclusions_canonical_form() -> None:
    items = torch.tensor([7, 2, 7, 5, 3, 3, 0, 9, 1])
    offsets = torch.tensor([0, 4, 4, 7, 9])
    targets = torch.tensor([5, 1, 3, 9])
    rows, ids, new_offsets = sorted_exclusions(items, offsets, targets, n_items=10)
    # row 0: {7, 2, 7, 5} minus target 5; row 1: empty; row 2: {3, 3, 0} minus 3; row 3: {9, 1} minus 9
    assert rows.tolist() == [0, 0, 2, 3]
    assert ids.tolist() == [2, 7, 0, 1]
    assert new_offsets.tolist() == [0, 2, 2, 3, 4]


# ---------------------------------------------------------------- input validation
def _valid():
    q, w, b, t = _embeddings(3, 10, 4, True, seed=0)
    return q, w, b, t, torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3, 4])


@pytest.mark.parametrize(
    "items,offsets,match",
    [
        (None, torch.tensor([0, 1, 3, 4]), "exclude_offsets was given without exclude_items"),
        (torch.tensor([1, 2, 3, 4]), None, "exclude_items was given without exclude_offsets"),
        (torch.tensor([1.0, 2, 3, 4]), torch.tensor([0, 1, 3, 4]), "exclude_items must be an integer"),
        (torch.tensor([1, 2, 3, 4]), torch.tensor([0.0, 1, 3, 4]), "exclude_offsets must be an integer"),
        (torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 1, 3, 4]), r"exclude_items must be 1-D \[E\]"),
        (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 4]), r"exclude_offsets must be 1-D \[B\+1\]"),
        (torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 3, 4]), r"exclude_offsets\[0\] must be 0"),
        (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3, 3]), r"exclude_offsets\[-1\] must equal len"),
        (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 1, 4]), "exclude_offsets must be non-decreasing"),
        (torch.tensor([1, 2, 10, 4]), torch.tensor([0, 1, 3, 4]), r"exclude_items must lie in \[0, 10\)"),
        (torch.tensor([1, -1, 3, 4]), torch.tensor([0, 1, 3, 4]), r"exclude_items must lie in \[0, 10\)"),
    ],
)
@pytest.mark.parametrize("impl", ["pytorch", "triton"])
def test_bad_exclusions_are_refused(items, offsets, match, impl) -> None:
    q, w, b, t, _, _ = _valid()
    with pytest.raises(ValueError, match=match):
        target_rank_counts(q, w, b, t, kernel=impl, exclude_items=items, exclude_offsets=offsets)


# ---------------------------------------------------------------- Triton twin
@pytest.fixture
def trt():
    module = pytest.importorskip("recforge.kernels.target_rank_triton")
    if DEVICE == "cpu" and not module.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET=1 was not set before import")
    return module


@pytest.fixture
def launches(trt, monkeypatch):
    """Records the exclusion lists each Triton launch got, so a silent fallback cannot pass."""
    calls = []
    real = trt.target_rank_counts_triton

    def spy(*args, **kwargs):
        calls.append(kwargs.get("exclude_items") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(trt, "target_rank_counts_triton", spy)
    return calls


@pytest.mark.triton
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_oracle(shape, with_bias, launches) -> None:
    q, w, b, t, ex, off = _on(DEVICE, *_problem(*shape, with_bias, seed=sum(shape)))
    got = target_rank_counts(q, w, b, t, kernel="triton", exclude_items=ex, exclude_offsets=off)
    assert launches == [True]
    _assert_counts(got, _oracle(q, w, b, t, ex, off))


@pytest.mark.triton
def test_triton_catalogue_splits(trt) -> None:
    # each split starts its rows' walk part-way through their lists (5 tiles of 32 items here)
    q, w, b, t, ex, off = _on(DEVICE, *_problem(20, 150, 24, True, seed=9))
    want = _oracle(q, w, b, t, ex, off)
    for n_splits in (2, 3, 5):
        got = trt.target_rank_counts_triton(
            q, w, b, t, exclude_items=ex, exclude_offsets=off, n_splits=n_splits
        )
        _assert_counts(got, want)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype, launches) -> None:
    q, w, b, t, ex, off = _problem(19, 70, 37, True, seed=5)
    want = _oracle(q, w, b, t, ex, off)
    q, w, b = (x.to(DEVICE, dtype) for x in (q, w, b))
    t, ex, off = _on(DEVICE, t, ex, off)
    got = target_rank_counts(q, w, b, t, kernel="triton", exclude_items=ex, exclude_offsets=off)
    assert launches == [True]
    _assert_counts(got, want)


@pytest.mark.triton
def test_triton_without_exclusions_unchanged(trt, launches) -> None:
    # lists holding only targets (or nothing) launch the plain kernel: same counts as no lists
    q, w, b, t = _on(DEVICE, *_embeddings(18, 60, 8, True, seed=6))
    plain = target_rank_counts(q, w, b, t, kernel="triton")
    only_targets = target_rank_counts(
        q, w, b, t, kernel="triton", exclude_items=t, exclude_offsets=torch.arange(19, device=DEVICE)
    )
    assert launches == [False, True]
    assert plain[0].tolist() == only_targets[0].tolist() and plain[1].tolist() == only_targets[1].tolist()


@pytest.mark.triton
@pytest.mark.parametrize("upcast", [True, False], ids=["fp32-tiles", "half-tiles"])
@pytest.mark.parametrize("n_rows", [70, 20])
def test_triton_gpu_tile_shapes(trt, n_rows, upcast) -> None:
    # The tiles a GPU launch picks (interpreted here on CPU): several row blocks or one partial
    # one, 128-item tiles with a partial last one, a d-loop with a partial last step (d=100).
    blocks = trt._block_sizes(n_rows, 100, on_gpu=True, upcast=upcast)
    q, w, b, t, ex, off = _on(DEVICE, *_problem(n_rows, 300, 100, True, seed=n_rows))
    got = trt.target_rank_counts_triton(
        q, w, b, t, exclude_items=ex, exclude_offsets=off, n_splits=2, block_sizes=blocks
    )
    _assert_counts(got, _oracle(q, w, b, t, ex, off))


@pytest.mark.triton
def test_triton_falls_back_with_exclusions(monkeypatch, launches) -> None:
    monkeypatch.setattr(tr.TRITON, "available", lambda: False)
    monkeypatch.setattr(tr.TRITON, "warned", False)
    q, w, b, t, ex, off = _problem(9, 23, 4, True, seed=2)
    with pytest.warns(RuntimeWarning, match="could not be imported"):
        got = target_rank_counts(q, w, b, t, kernel="triton", exclude_items=ex, exclude_offsets=off)
    assert not launches
    _assert_counts(got, _oracle(q, w, b, t, ex, off))

"""Chunked target-rank counts, tie policies and RankingMetrics."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torchmetrics.retrieval import RetrievalMRR, RetrievalRecall

from recforge.kernels import target_rank_counts
from recforge.kernels.target_rank import target_rank_counts_reference
from recforge.metrics import TIE_POLICIES, RankingMetrics, ranks_from_counts

# Written out by hand: per row, the target column and its counts.
#   row 0: target 0.5, above it 0.9, 0.9           -> n_greater=2, n_equal=1
#   row 1: target 0.7, tied with two other 0.7s     -> n_greater=0, n_equal=3
#   row 2: target 0.4, above it 0.8, 0.6; one tie   -> n_greater=2, n_equal=2
HAND_SCORES = torch.tensor(
    [
        [0.1, 0.9, 0.5, 0.9, 0.3],
        [0.2, 0.7, 0.7, 0.7, 0.1],
        [0.4, 0.4, 0.8, 0.1, 0.6],
    ],
    dtype=torch.float64,
)
HAND_TARGETS = torch.tensor([2, 1, 0])
HAND_RANKS = {
    "conservative": [3.0, 3.0, 4.0],
    "standard": [3.0, 1.0, 3.0],
    "median": [3.0, 2.0, 3.5],
}


def _counts_via_kernel(scores: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> tuple:
    # queries = scores and an identity catalogue reproduce the score matrix exactly.
    n_items = scores.shape[1]
    eye = torch.eye(n_items, dtype=scores.dtype)
    return target_rank_counts(scores, eye, None, targets, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 64])
def test_hand_counts(chunk_size: int) -> None:
    n_greater, n_equal = _counts_via_kernel(HAND_SCORES, HAND_TARGETS, chunk_size)
    assert n_greater.tolist() == [2, 0, 2]
    assert n_equal.tolist() == [1, 3, 2]
    assert n_greater.dtype == torch.int64 and n_equal.dtype == torch.int64
    ref = target_rank_counts_reference(HAND_SCORES, HAND_TARGETS)
    assert ref[0].tolist() == [2, 0, 2] and ref[1].tolist() == [1, 3, 2]


@pytest.mark.parametrize("ties", ["conservative", "standard", "median"])
def test_hand_ranks(ties: str) -> None:
    ranks = ranks_from_counts(torch.tensor([2, 0, 2]), torch.tensor([1, 3, 2]), ties)
    assert ranks.dtype == torch.float64
    assert ranks.tolist() == HAND_RANKS[ties]


def test_aliases() -> None:
    ng, ne = torch.tensor([2, 0, 2]), torch.tensor([1, 3, 2])
    assert torch.equal(ranks_from_counts(ng, ne, "pessimistic"), ranks_from_counts(ng, ne, "conservative"))
    assert torch.equal(ranks_from_counts(ng, ne, "optimistic"), ranks_from_counts(ng, ne, "standard"))
    assert set(TIE_POLICIES) >= {"conservative", "pessimistic", "standard", "optimistic", "median"}
    assert RankingMetrics(ties="pessimistic").ties == "conservative"


def _expected(ranks: list[float], ks: tuple[int, ...]) -> dict[str, float]:
    n = len(ranks)
    out = {}
    for k in ks:
        out[f"recall@{k}"] = sum(r <= k for r in ranks) / n
        out[f"hr@{k}"] = out[f"recall@{k}"]
        out[f"mrr@{k}"] = sum(1 / r for r in ranks if r <= k) / n
        out[f"ndcg@{k}"] = sum(1 / math.log2(r + 1) for r in ranks if r <= k) / n
    return out


def test_hand_metrics() -> None:
    ks = (1, 3, 5)
    metric = RankingMetrics(ks=ks, metrics=("recall", "hr", "mrr", "ndcg"), ties="conservative")
    metric.update_from_counts(*_counts_via_kernel(HAND_SCORES, HAND_TARGETS, 2))
    got = {k: v.item() for k, v in metric.compute().items()}
    # Conservative ranks 3, 3, 4, worked out by hand.
    want = {
        "recall@1": 0.0, "recall@3": 2 / 3, "recall@5": 1.0,
        "hr@1": 0.0, "hr@3": 2 / 3, "hr@5": 1.0,
        "mrr@1": 0.0, "mrr@3": (1 / 3 + 1 / 3) / 3, "mrr@5": (1 / 3 + 1 / 3 + 1 / 4) / 3,
        "ndcg@1": 0.0, "ndcg@3": (0.5 + 0.5) / 3, "ndcg@5": (0.5 + 0.5 + 1 / math.log2(5)) / 3,
    }  # fmt: skip
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert metric.ties == "conservative"


@pytest.mark.parametrize("ties", ["standard", "median"])
def test_hand_metrics_other_policies(ties: str) -> None:
    ks = (1, 3, 5)
    metric = RankingMetrics(ks=ks, metrics=("recall", "mrr", "ndcg"), ties=ties, full_mrr=True)
    metric.update_from_counts(*_counts_via_kernel(HAND_SCORES, HAND_TARGETS, 3))
    got = metric.compute()
    want = _expected(HAND_RANKS[ties], ks)
    if ties == "standard":  # ranks 3, 1, 3
        assert got["recall@1"].item() == pytest.approx(1 / 3)
        assert got["mrr@3"].item() == pytest.approx((1 / 3 + 1 + 1 / 3) / 3)
    else:  # ranks 3, 2, 3.5
        assert got["mrr@3"].item() == pytest.approx((1 / 3 + 1 / 2) / 3)
        assert got["ndcg@5"].item() == pytest.approx((0.5 + 1 / math.log2(3) + 1 / math.log2(4.5)) / 3)
    for key in ("recall", "mrr", "ndcg"):
        for k in ks:
            assert got[f"{key}@{k}"].item() == pytest.approx(want[f"{key}@{k}"], abs=1e-12)
    assert got["mrr"].item() == pytest.approx(sum(1 / r for r in HAND_RANKS[ties]) / 3)


@pytest.mark.parametrize("chunk_size", [32_767, 32_768, 70_000], ids=["int16-full", "int32", "int32-whole"])
def test_counts_at_the_width_of_their_per_chunk_sums(chunk_size: int) -> None:
    """A chunk's counts are summed in 16 bits up to 32,767 columns, in 32 above: rows whose every
    column beats or ties the target, over 70,000 items, count exactly (hand-computed)."""
    n_items = 70_000
    queries = torch.tensor([[1.0], [1.0], [-1.0]])
    items = torch.ones(n_items, 1)
    items[5] = 0.0   # row 0's target: every other item scores above it
    items[-1] = 2.0  # one item above the rest
    targets = torch.tensor([5, 7, 3])
    n_greater, n_equal = target_rank_counts(queries, items, None, targets, chunk_size=chunk_size)
    # row 0: 69,999 above; row 1: only the 2.0 item above, 69,998 ties (itself included);
    # row 2 (scores negated): the 0.0 item above, the 2.0 one below, 69,998 ties
    assert n_greater.tolist() == [n_items - 1, 1, 1]
    assert n_equal.tolist() == [1, n_items - 2, n_items - 2]


def test_constant_scores() -> None:
    n_rows, n_items, dim = 4, 10, 3
    queries = torch.ones(n_rows, dim)
    items = torch.full((n_items, dim), 0.25)
    targets = torch.tensor([0, 3, 9, 5])
    n_greater, n_equal = target_rank_counts(queries, items, None, targets, chunk_size=4)
    assert n_greater.tolist() == [0] * n_rows
    assert n_equal.tolist() == [n_items] * n_rows
    assert ranks_from_counts(n_greater, n_equal).tolist() == [float(n_items)] * n_rows
    assert ranks_from_counts(n_greater, n_equal, "standard").tolist() == [1.0] * n_rows
    assert ranks_from_counts(n_greater, n_equal, "median").tolist() == [(n_items + 1) / 2] * n_rows

    metric = RankingMetrics(ks=(1, 5, n_items - 1, n_items), metrics=("recall", "mrr"))
    metric.update_from_counts(n_greater, n_equal)
    out = metric.compute()
    for k in (1, 5, n_items - 1):
        assert out[f"recall@{k}"].item() == 0.0
        assert out[f"mrr@{k}"].item() == 0.0
    assert out[f"recall@{n_items}"].item() == 1.0
    assert out[f"mrr@{n_items}"].item() == pytest.approx(1 / n_items)


def _random_problem(kind: str, with_bias: bool, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    n_rows, n_items, dim = 9, 23, 4
    if kind == "float":
        queries = torch.randn(n_rows, dim, generator=gen, dtype=torch.float64)
        items = torch.randn(n_items, dim, generator=gen, dtype=torch.float64)
        bias = torch.randn(n_items, generator=gen, dtype=torch.float64) if with_bias else None
    else:
        # Tiny integer values: scores are exact in float32 and heavily tied.
        queries = torch.randint(-1, 2, (n_rows, dim), generator=gen).float()
        items = torch.randint(-1, 2, (n_items, dim), generator=gen).float()
        bias = torch.randint(0, 2, (n_items,), generator=gen).float() if with_bias else None
    targets = torch.randint(0, n_items, (n_rows,), generator=gen)
    scores = queries @ items.T + (bias if bias is not None else 0.0)
    return queries, items, bias, targets, scores


@pytest.mark.parametrize("kind", ["float", "int"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 23, 100])
def test_chunked_matches_reference(kind: str, with_bias: bool, chunk_size: int) -> None:
    queries, items, bias, targets, scores = _random_problem(kind, with_bias, seed=chunk_size)
    got = target_rank_counts(queries, items, bias, targets, chunk_size=chunk_size)
    ref = target_rank_counts_reference(scores, targets)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])
    if kind == "int":  # the test only means something if there are ties
        assert (ref[1] > 1).any()


def test_target_never_beats_itself_low_precision() -> None:
    # Long float32 / bf16 dot products round differently from the matmul; the
    # target must still count exactly once as a tie and never against itself.
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(16, 512, generator=gen)
    items = torch.randn(50, 512, generator=gen)
    targets = torch.arange(16)
    for dtype in (torch.float32, torch.bfloat16):
        n_greater, n_equal = target_rank_counts(queries.to(dtype), items.to(dtype), None, targets, chunk_size=13)
        assert (n_equal >= 1).all()
        assert (n_greater + n_equal <= 50).all()


def test_bf16_matches_float32() -> None:
    queries, items, bias, targets, scores = _random_problem("int", True, seed=3)
    got = target_rank_counts(queries.bfloat16(), items.bfloat16(), bias.bfloat16(), targets, chunk_size=5)
    ref = target_rank_counts_reference(scores, targets)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("kind", ["float", "int"])
def test_conservative_equals_stable_argsort_worst_position(kind: str) -> None:
    _, _, _, targets, scores = _random_problem(kind, True, seed=11)
    n_rows, n_items = scores.shape
    counts = target_rank_counts_reference(scores, targets)
    conservative = ranks_from_counts(*counts, "conservative")
    standard = ranks_from_counts(*counts, "standard")
    for i in range(n_rows):
        t = int(targets[i])
        others = [j for j in range(n_items) if j != t]
        # A stable descending sort keeps column order among ties: putting the target
        # last gives its worst position, first gives its best.
        for order, want in (([*others, t], conservative[i]), ([t, *others], standard[i])):
            perm = torch.tensor(order)
            sorted_cols = perm[torch.argsort(scores[i, perm], descending=True, stable=True)]
            position = int((sorted_cols == t).nonzero()) + 1
            assert position == want.item()


@pytest.mark.parametrize("k", [1, 3, 10])
def test_matches_torchmetrics_retrieval(k: int) -> None:
    queries, items, bias, targets, scores = _random_problem("float", True, seed=5)
    n_rows, n_items = scores.shape
    # The peer oracle is only defined without ties.
    assert all(len(set(row.tolist())) == n_items for row in scores)
    # Make a few rows hits at rank 1 so every cutoff sees both hits and misses.
    targets = targets.clone()
    targets[:3] = scores[:3].argmax(dim=1)

    metric = RankingMetrics(ks=(k,), metrics=("recall", "mrr"))
    metric.update_from_counts(*target_rank_counts(queries, items, bias, targets, chunk_size=6))
    out = metric.compute()

    relevant = torch.zeros(n_rows, n_items, dtype=torch.bool)
    relevant[torch.arange(n_rows), targets] = True
    indexes = torch.arange(n_rows).repeat_interleave(n_items)
    peer_recall = RetrievalRecall(top_k=k)(scores.flatten(), relevant.flatten(), indexes=indexes)
    peer_mrr = RetrievalMRR(top_k=k)(scores.flatten(), relevant.flatten(), indexes=indexes)
    assert out[f"recall@{k}"].item() == pytest.approx(peer_recall.item(), abs=1e-6)
    assert out[f"mrr@{k}"].item() == pytest.approx(peer_mrr.item(), abs=1e-6)
    assert 0.0 < out[f"recall@{k}"].item() < 1.0


def test_ddp_style_reduction() -> None:
    queries, items, bias, targets, _ = _random_problem("int", True, seed=2)
    ng, ne = target_rank_counts(queries, items, bias, targets)
    kwargs = dict(ks=(1, 3, 7), metrics=("recall", "hr", "mrr", "ndcg"), ties="median", full_mrr=True)
    whole = RankingMetrics(**kwargs)
    whole.update_from_counts(ng, ne)
    want = whole.compute()

    half = 4  # unequal halves: a per-shard mean of means would differ from the micro-average
    a, b = RankingMetrics(**kwargs), RankingMetrics(**kwargs)
    a.update_from_counts(ng[:half], ne[:half])
    b.update_from_counts(ng[half:], ne[half:])

    manual = RankingMetrics(**kwargs)
    for name in manual._defaults:
        setattr(manual, name, getattr(a, name) + getattr(b, name))
    manual._update_count = 1

    a.merge_state(b)
    for merged in (a, manual):
        got = merged.compute()
        assert got.keys() == want.keys()
        for key in want:
            assert torch.allclose(got[key], want[key], rtol=0, atol=1e-12), key
    assert int(a.n_events) == len(targets)


def test_zero_events_gives_zeros() -> None:
    metric = RankingMetrics(ks=(1, 5), metrics=("recall", "mrr", "ndcg"), full_mrr=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = metric.compute()
    assert len(out) == 7
    for value in out.values():
        assert value.item() == 0.0 and not torch.isnan(value)


def test_bad_tie_policy() -> None:
    with pytest.raises(ValueError, match="bogus") as err:
        ranks_from_counts(torch.tensor([0]), torch.tensor([1]), "bogus")
    for name in ("conservative", "standard", "median", "optimistic", "pessimistic"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="conservative"):
        RankingMetrics(ties="worst")


def test_bad_metric_name() -> None:
    with pytest.raises(ValueError) as err:
        RankingMetrics(metrics=("recall", "precision"))
    msg = str(err.value)
    assert "precision" in msg
    for name in ("recall", "hr", "mrr", "ndcg"):
        assert name in msg


def test_input_validation() -> None:
    q, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="kernel"):
        target_rank_counts(q, w, None, t, kernel="bogus")
    with pytest.raises(ValueError, match="embedding size"):
        target_rank_counts(q, torch.randn(5, 3), None, t)
    with pytest.raises(ValueError, match="item_bias"):
        target_rank_counts(q, w, torch.randn(4), t)
    with pytest.raises(ValueError, match="targets"):
        target_rank_counts(q, w, None, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        target_rank_counts(q, w, None, torch.tensor([0, 1, 5]))
    with pytest.raises(ValueError, match="chunk_size"):
        target_rank_counts(q, w, None, t, chunk_size=0)

"""Sampled next-item losses (spec §1.4) against naive per-row loops and hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from recforge.losses.sampled import BPR, TOP1, BPRMax, CrossEntropy, TOP1Max


# ----------------------------------------------------------------------------- naive references
def naive_cross_entropy(scores, batch_size, logq=0.0, log_q=None):
    """Row by row: R_ij - logq*log q_j, max-subtracted softmax, -log(p_ii + 1e-24), sum / B."""
    n_rows, n_cols = scores.shape
    total = scores.new_zeros(())
    for i in range(n_rows):
        row = [scores[i, j] - (logq * log_q[j] if logq > 0 else 0.0) for j in range(n_cols)]
        m = max(x.item() for x in row)
        denom = sum(torch.exp(x - m) for x in row)
        p = torch.exp(row[i] - m) / denom
        total = total - torch.log(p + 1e-24)
    return total / batch_size


def naive_elu(x, alpha):
    return x if x.item() > 0 else alpha * (torch.exp(x) - 1.0)


def naive_bpr_max(scores, batch_size, bpreg, elu_param, detach_weights=False):
    """Row by row: softmax over the negatives j != i only, then
    loss_i = -log(sum_j s_ij sigmoid(r_ii - r_ij) + 1e-24) + bpreg sum_j s_ij r_ij^2."""
    n_rows, n_cols = scores.shape
    total = scores.new_zeros(())
    for i in range(n_rows):
        r = [naive_elu(scores[i, j], elu_param) if elu_param > 0 else scores[i, j] for j in range(n_cols)]
        negatives = [j for j in range(n_cols) if j != i]
        m = max(r[j].item() for j in negatives)
        e = {j: torch.exp(r[j] - m) for j in negatives}
        z = sum(e.values())
        s = {j: e[j] / z for j in negatives}
        if detach_weights:
            s = {j: w.detach() for j, w in s.items()}
        pairwise = sum(s[j] * torch.sigmoid(r[i] - r[j]) for j in negatives)
        reg = sum(s[j] * r[j] * r[j] for j in negatives)
        total = total + (-torch.log(pairwise + 1e-24) + bpreg * reg)
    return total / batch_size


def naive_top1_max(scores, batch_size, elu_param, detach_weights=False):
    """Row by row: the same negatives-only softmax as BPR-max, then
    loss_i = sum_j s_ij (sigmoid(r_ij - r_ii) + sigmoid(r_ij^2))."""
    n_rows, n_cols = scores.shape
    total = scores.new_zeros(())
    for i in range(n_rows):
        r = [naive_elu(scores[i, j], elu_param) if elu_param > 0 else scores[i, j] for j in range(n_cols)]
        negatives = [j for j in range(n_cols) if j != i]
        m = max(r[j].item() for j in negatives)
        e = {j: torch.exp(r[j] - m) for j in negatives}
        z = sum(e.values())
        s = {j: e[j] / z for j in negatives}
        if detach_weights:
            s = {j: w.detach() for j, w in s.items()}
        total = total + sum(
            s[j] * (torch.sigmoid(r[j] - r[i]) + torch.sigmoid(r[j] * r[j])) for j in negatives
        )
    return total / batch_size


def naive_top1(scores, batch_size):
    """Row by row: mean over all C columns (target included) of
    sigmoid(r_ij - r_ii) + sigmoid(r_ij^2), minus sigmoid(r_ii^2) / C."""
    n_rows, n_cols = scores.shape
    total = scores.new_zeros(())
    for i in range(n_rows):
        terms = [
            torch.sigmoid(scores[i, j] - scores[i, i]) + torch.sigmoid(scores[i, j] ** 2)
            for j in range(n_cols)
        ]
        total = total + sum(terms) / n_cols - torch.sigmoid(scores[i, i] ** 2) / n_cols
    return total / batch_size


def naive_bpr(scores, batch_size):
    """Row by row: -sum over all columns (target included) of log sigmoid(r_ii - r_ij)."""
    n_rows, n_cols = scores.shape
    total = scores.new_zeros(())
    for i in range(n_rows):
        for j in range(n_cols):
            total = total - torch.log(torch.sigmoid(scores[i, i] - scores[i, j]))
    return total / batch_size


def random_scores(n_rows, n_cols, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64) * scale).requires_grad_(True)


def random_log_q(n_cols, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    pop = torch.randint(1, 500, (n_cols,), generator=g).double()
    return torch.log(pop)


def grad_of(fn, scores):
    x = scores.detach().clone().requires_grad_(True)
    loss = fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


def assert_matches_oracle(loss, oracle, scores):
    """The loss and its naive per-row oracle agree on the value and on the gradient."""
    got, g_got = grad_of(loss, scores)
    want, g_want = grad_of(oracle, scores)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-12)


SHAPES = [
    # (rows, columns, configured batch size)
    (5, 5, 5),  # square: only the mini-batch's own targets
    (4, 11, 4),  # extra sampled columns (C > B')
    (3, 9, 8),  # a shrunk batch: normalised by the configured size
    (2, 2, 2),
]


# ----------------------------------------------------------------------------- cross-entropy
@pytest.mark.parametrize("n_rows,n_cols,batch_size", SHAPES)
@pytest.mark.parametrize("logq", [0.0, 1.0, 0.5])
def test_cross_entropy_matches_naive_loop_values_and_gradients(n_rows, n_cols, batch_size, logq):
    scores = random_scores(n_rows, n_cols, seed=n_rows * 31 + n_cols)
    log_q = random_log_q(n_cols, seed=n_cols)
    loss_fn = CrossEntropy(logq=logq)
    assert_matches_oracle(
        lambda x: loss_fn(x, batch_size, log_q=log_q),
        lambda x: naive_cross_entropy(x, batch_size, logq, log_q),
        scores,
    )


def test_cross_entropy_logq_changes_the_loss_and_needs_log_q():
    scores = random_scores(4, 7, seed=3).detach()
    log_q = random_log_q(7, seed=3)
    plain = CrossEntropy(logq=0.0)(scores, 4)
    # logq = 0 ignores any given log_q.
    torch.testing.assert_close(CrossEntropy(logq=0.0)(scores, 4, log_q=log_q), plain)
    corrected = CrossEntropy(logq=1.0)(scores, 4, log_q=log_q)
    assert not torch.allclose(corrected, plain)
    # A constant log q (e.g. raw counts vs probabilities) cancels in the softmax.
    shifted = CrossEntropy(logq=1.0)(scores, 4, log_q=log_q + 3.7)
    torch.testing.assert_close(shifted, corrected)
    with pytest.raises(ValueError):
        CrossEntropy(logq=1.0)(scores, 4)


def test_cross_entropy_hand_computed():
    scores = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]], dtype=torch.float64)
    # row 0: -log(e^1 / (e^1 + e^0 + e^2)); row 1: -log(e^1 / (e^0 + e^1 + e^-1)); / 4.
    row0 = -math.log(math.e / (math.e + 1 + math.e**2))
    row1 = -math.log(math.e / (1 + math.e + math.exp(-1)))
    got = CrossEntropy()(scores, 4)
    assert got.item() == pytest.approx((row0 + row1) / 4, rel=1e-12)
    # logq: subtract log q_j (q = [1, e, 1]) -> row 0 = [1, -1, 2], row 1 = [0, 0, -1].
    log_q = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    row0 = -math.log(math.e / (math.e + math.exp(-1) + math.e**2))
    row1 = -math.log(1 / (1 + 1 + math.exp(-1)))
    got = CrossEntropy(logq=1.0)(scores, 2, log_q=log_q)
    assert got.item() == pytest.approx((row0 + row1) / 2, rel=1e-12)


def test_cross_entropy_accidental_hits_stay_in_the_denominator():
    # Column 2 is a sampled negative equal to row 0's target (same score): it is not masked.
    scores = torch.tensor([[2.0, 0.0, 2.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    got = CrossEntropy()(scores, 2)
    row0 = -math.log(math.exp(2) / (2 * math.exp(2) + 1))
    row1 = -math.log(math.e / (2 + math.e))
    assert got.item() == pytest.approx((row0 + row1) / 2, rel=1e-12)


# ----------------------------------------------------------------------------- BPR-max
@pytest.mark.parametrize("n_rows,n_cols,batch_size", SHAPES)
@pytest.mark.parametrize("elu_param", [0.0, 0.5])
@pytest.mark.parametrize("bpreg", [0.0, 1.0])
def test_bpr_max_matches_naive_loop_values_and_gradients(n_rows, n_cols, batch_size, elu_param, bpreg):
    scores = random_scores(n_rows, n_cols, seed=7 * n_rows + n_cols)
    loss_fn = BPRMax(bpreg=bpreg, elu_param=elu_param)
    assert_matches_oracle(
        lambda x: loss_fn(x, batch_size),
        lambda x: naive_bpr_max(x, batch_size, bpreg, elu_param),
        scores,
    )


@pytest.mark.parametrize("bpreg", [0.0, 1.0])
def test_bpr_max_weights_are_not_detached(bpreg):
    scores = random_scores(4, 9, seed=42)
    _, g_got = grad_of(lambda x: BPRMax(bpreg=bpreg, elu_param=0.5)(x, 4), scores)
    _, g_detached = grad_of(
        lambda x: naive_bpr_max(x, 4, bpreg, 0.5, detach_weights=True), scores
    )
    assert (g_got - g_detached).abs().max() > 1e-3


def test_bpr_max_hand_computed_single_negative():
    # Two rows, two columns: each row has one negative, so s = 1 and
    # loss_i = -log sigmoid(r_ii - r_ij) + bpreg * r_ij^2.
    scores = torch.tensor([[1.5, -0.5], [2.0, 0.25]], dtype=torch.float64)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    row0 = -math.log(sig(1.5 + 0.5)) + 0.7 * 0.25
    row1 = -math.log(sig(0.25 - 2.0)) + 0.7 * 4.0
    got = BPRMax(bpreg=0.7, elu_param=0.0)(scores, 3)
    assert got.item() == pytest.approx((row0 + row1) / 3, rel=1e-12)
    # With ELU(0.5) first: -0.5 -> 0.5 * (e^-0.5 - 1).
    neg = 0.5 * (math.exp(-0.5) - 1.0)
    row0 = -math.log(sig(1.5 - neg)) + 0.7 * neg**2
    got = BPRMax(bpreg=0.7, elu_param=0.5)(scores, 3)
    assert got.item() == pytest.approx((row0 + row1) / 3, rel=1e-12)


def test_bpr_max_softmax_is_over_negatives_only():
    # A huge target score must not take part in the negatives' softmax (it would swamp the
    # weights and make the loss ~0 instead of ~ -log sigmoid(10 - 3) weighted over negatives).
    scores = torch.tensor([[10.0, 3.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    s = torch.softmax(torch.tensor([3.0, 1.0], dtype=torch.float64), dim=0)
    pair = s[0] * torch.sigmoid(torch.tensor(7.0, dtype=torch.float64)) + s[1] * torch.sigmoid(
        torch.tensor(9.0, dtype=torch.float64)
    )
    row0 = -torch.log(pair) + 0.5 * (s[0] * 9.0 + s[1] * 1.0)
    row1 = -math.log(0.5) + 0.0
    got = BPRMax(bpreg=0.5, elu_param=0.0)(scores, 2)
    assert got.item() == pytest.approx((row0.item() + row1) / 2, rel=1e-12)


# ----------------------------------------------------------------------------- TOP1-max
@pytest.mark.parametrize("n_rows,n_cols,batch_size", SHAPES)
@pytest.mark.parametrize("elu_param", [0.0, 0.5, 1.0])
def test_top1_max_matches_naive_loop_values_and_gradients(n_rows, n_cols, batch_size, elu_param):
    scores = random_scores(n_rows, n_cols, seed=13 * n_rows + n_cols)
    loss_fn = TOP1Max(elu_param=elu_param)
    assert_matches_oracle(
        lambda x: loss_fn(x, batch_size),
        lambda x: naive_top1_max(x, batch_size, elu_param),
        scores,
    )


def test_top1_max_defaults_to_linear_and_weights_are_not_detached():
    scores = random_scores(4, 9, seed=17)
    torch.testing.assert_close(TOP1Max()(scores.detach(), 4), naive_top1_max(scores.detach(), 4, 0.0))
    _, g_got = grad_of(lambda x: TOP1Max()(x, 4), scores)
    _, g_detached = grad_of(lambda x: naive_top1_max(x, 4, 0.0, detach_weights=True), scores)
    assert (g_got - g_detached).abs().max() > 1e-3


def test_top1_max_hand_computed():
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    # Row 0's target (10) is huge: it takes no part in the negatives' softmax over [3, 1].
    scores = torch.tensor([[10.0, 3.0, 1.0], [0.5, -1.0, 2.0]], dtype=torch.float64)
    w = [math.exp(3) / (math.exp(3) + math.e), math.e / (math.exp(3) + math.e)]
    row0 = w[0] * (sig(3 - 10) + sig(9)) + w[1] * (sig(1 - 10) + sig(1))
    w = [math.exp(0.5) / (math.exp(0.5) + math.exp(2)), math.exp(2) / (math.exp(0.5) + math.exp(2))]
    row1 = w[0] * (sig(0.5 + 1) + sig(0.25)) + w[1] * (sig(2 + 1) + sig(4))
    got = TOP1Max()(scores, 4)
    assert got.item() == pytest.approx((row0 + row1) / 4, rel=1e-12)


# ----------------------------------------------------------------------------- legacy TOP1 and BPR
@pytest.mark.parametrize("n_rows,n_cols,batch_size", SHAPES)
def test_top1_matches_naive_loop_values_and_gradients(n_rows, n_cols, batch_size):
    scores = random_scores(n_rows, n_cols, seed=19 * n_rows + n_cols)
    assert_matches_oracle(
        lambda x: TOP1()(x, batch_size),
        lambda x: naive_top1(x, batch_size),
        scores,
    )


def test_top1_hand_computed():
    # One row, three columns (target first): the target's regulariser is removed from the mean,
    # its pairwise term sigmoid(0) = 1/2 is not.
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    scores = torch.tensor([[1.0, 2.0, -0.5]], dtype=torch.float64)
    mean = ((0.5 + sig(1.0)) + (sig(1.0) + sig(4.0)) + (sig(-1.5) + sig(0.25))) / 3
    got = TOP1()(scores, 2)
    assert got.item() == pytest.approx((mean - sig(1.0) / 3) / 2, rel=1e-12)


@pytest.mark.parametrize("n_rows,n_cols,batch_size", SHAPES)
def test_bpr_matches_naive_loop_values_and_gradients(n_rows, n_cols, batch_size):
    scores = random_scores(n_rows, n_cols, seed=23 * n_rows + n_cols)
    assert_matches_oracle(
        lambda x: BPR()(x, batch_size),
        lambda x: naive_bpr(x, batch_size),
        scores,
    )


def test_bpr_is_a_sum_over_columns_including_the_target():
    # Two rows, three columns: per row the sum (not the mean) of -log sigmoid(r_ii - r_ij) over
    # all three columns, the target's own log 2 included.
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    scores = torch.tensor([[1.0, 0.0, 3.0], [2.0, -1.0, 0.5]], dtype=torch.float64)
    row0 = math.log(2) - math.log(sig(1.0)) - math.log(sig(-2.0))
    row1 = -math.log(sig(-3.0)) + math.log(2) - math.log(sig(-1.5))
    assert BPR()(scores, 5).item() == pytest.approx((row0 + row1) / 5, rel=1e-12)


def test_bpr_stays_finite_for_a_badly_ranked_target():
    # log(sigmoid(-800)) underflows to -inf in float64; the loss must not.
    scores = torch.tensor([[-400.0, 400.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss = BPR()(scores, 2)
    loss.backward()
    assert loss.item() == pytest.approx((800.0 + 2 * math.log(2) + math.log(2)) / 2, rel=1e-12)
    assert torch.isfinite(scores.grad).all()


def test_activation_and_min_batch_rows():
    x = torch.linspace(-3, 3, 13, dtype=torch.float64)
    torch.testing.assert_close(CrossEntropy().activation(x), x)
    torch.testing.assert_close(BPRMax(elu_param=0.0).activation(x), x)
    torch.testing.assert_close(BPRMax(elu_param=0.5).activation(x), F.elu(x, alpha=0.5))
    torch.testing.assert_close(TOP1Max().activation(x), x)
    torch.testing.assert_close(TOP1Max(elu_param=1.0).activation(x), F.elu(x, alpha=1.0))
    torch.testing.assert_close(TOP1().activation(x), x)
    torch.testing.assert_close(BPR().activation(x), x)
    for loss in (
        CrossEntropy(), CrossEntropy(logq=1.0), BPRMax(), BPRMax(bpreg=0.0, elu_param=0.0),
        TOP1Max(), TOP1(), BPR(),
    ):
        # No extra samples: the other rows' targets are the only negatives -> need 2 rows.
        assert loss.min_batch_rows(0) == 2
        assert loss.min_batch_rows(1) == 1
        assert loss.min_batch_rows(2048) == 1


def test_single_row_with_samples_is_finite():
    # One row left (allowed when there are extra samples): every loss stays finite.
    scores = random_scores(1, 6, seed=9)
    log_q = random_log_q(6, seed=9)
    for fn in (
        lambda x: CrossEntropy(logq=1.0)(x, 32, log_q=log_q),
        lambda x: BPRMax()(x, 32),
        lambda x: TOP1Max(elu_param=0.5)(x, 32),
        lambda x: TOP1()(x, 32),
        lambda x: BPR()(x, 32),
    ):
        loss, g = grad_of(fn, scores)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
    want = naive_bpr_max(scores.detach(), 32, 1.0, 0.5)
    torch.testing.assert_close(BPRMax()(scores.detach(), 32), want)
    torch.testing.assert_close(TOP1Max()(scores.detach(), 32), naive_top1_max(scores.detach(), 32, 0.0))


def test_only_a_logq_corrected_loss_asks_for_the_log_sampling_weights():
    # the task computes log q per mini-batch only when the loss reads it
    assert CrossEntropy(logq=1.0).uses_log_q
    assert not CrossEntropy(logq=0.0).uses_log_q
    assert not BPRMax().uses_log_q and not TOP1Max().uses_log_q
    assert not TOP1().uses_log_q and not BPR().uses_log_q

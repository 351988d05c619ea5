"""Sampled / full softmax (spec §1.5) against a naive float64 loop."""
from __future__ import annotations

import io

import pytest
import torch

import recforge.losses.sampled_softmax as ss
from recforge.kernels.jagged import next_item_positives
from recforge.losses.sampled_softmax import FullSoftmax, SampledSoftmax

TAU = 0.05


def naive_loss(queries, positives, table, negatives, weights=None, eps=1e-6):
    """Position by position: cosine / tau, hits excluded, -log softmax of the positive."""
    total = torch.zeros((), dtype=torch.float64)
    weight_sum = torch.zeros((), dtype=torch.float64)
    for p in range(len(positives)):
        def score(j):
            e = table[j]
            return (queries[p] * e).sum() / torch.clamp(torch.sqrt((e * e).sum()), min=eps) / TAU
        negs = negatives if negatives.dim() == 1 else negatives[p]
        terms = [score(int(positives[p]))]
        terms += [score(int(j)) for j in negs if int(j) != int(positives[p])]
        logits = torch.stack(terms)
        w = 1.0 if weights is None else weights[p].double()
        total = total + w * (torch.logsumexp(logits, 0) - logits[0])
        weight_sum = weight_sum + w
    return total / weight_sum


def _inputs(n_pos=7, n_items=11, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_pos, d, generator=g, dtype=torch.float64)
    q = (q / q.norm(dim=1, keepdim=True)).requires_grad_()
    table = torch.randn(n_items, d, generator=g, dtype=torch.float64).requires_grad_()
    positives = torch.randint(0, n_items, (n_pos,), generator=g)
    return q, positives, table, g


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("n_items", [6, 400])  # whole-table and distinct-rows normalisation
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
# the per-position scores gathered, all scored, or scored on a sparse pattern
@pytest.mark.parametrize("form", ["gathered", "dense", "sparse"])
def test_value_and_gradients_match_the_naive_loop(n_items, shared, weighted, form, monkeypatch) -> None:
    monkeypatch.setattr(ss, "_CHUNK_ELEMENTS", 40)  # several chunks
    monkeypatch.setattr(ss, "_FORCE_FORM", form)
    q, positives, table, g = _inputs(n_items=n_items)
    r = 9
    shape = (r,) if shared else (len(positives), r)
    negatives = torch.randint(0, n_items, shape, generator=g)
    if not shared:
        negatives[0, :3] = positives[0]  # some accidental hits
    weights = torch.rand(len(positives), generator=g, dtype=torch.float64) if weighted else None
    loss_fn = SampledSoftmax(n_negatives=r, temperature=TAU, shared_negatives=shared)
    got = loss_fn(q, positives, table, weights=weights, negatives=negatives)
    want = naive_loss(q, positives, table, negatives, weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(got, q, table), _grads(want, q, table)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", ["gathered", "dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_pos,n_cols,n_items", [(50, 9, 7), (40, 5, 6), (37, 33, 500), (0, 5, 10), (4, 0, 10)])
def test_gathered_dots_forms_match_their_autograd_twin(form, dtype, n_pos, n_cols, n_items, monkeypatch) -> None:
    """Every form of _GatheredDots against gather-multiply-sum under autograd, forward and
    backward, with repeated ids in a row (few items) and items no row draws (many)."""
    monkeypatch.setattr(ss, "_CHUNK_ELEMENTS", 300)  # several chunks for the chunked forms
    monkeypatch.setattr(ss, "_FORCE_FORM", form)
    g = torch.Generator().manual_seed(n_pos + n_cols + n_items)
    q = torch.randn(n_pos, 16, generator=g, dtype=dtype, requires_grad=True)
    table = torch.randn(n_items, 16, generator=g, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, n_items, (n_pos, n_cols), generator=g)
    if n_pos and n_cols > 2:
        ids[0, :3] = ids[0, 0].clone()  # a row drawing one item three times
    grad_out = torch.randn(n_pos, n_cols, generator=g, dtype=dtype)
    got = ss._GatheredDots.apply(q, table, ids)
    want = ss._gathered_dots_reference(q, table, ids)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    assert got.shape == want.shape == (n_pos, n_cols)
    torch.testing.assert_close(got, want, **tol)
    got_grads = torch.autograd.grad(got, (q, table), grad_out)
    want_grads = torch.autograd.grad(want, (q, table), grad_out, allow_unused=True)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, **tol)


def test_the_sparse_form_serves_cpu_float_tables_only(monkeypatch) -> None:
    monkeypatch.setattr(ss, "_FORCE_FORM", None)
    assert ss._form(torch.zeros(27278, 4), 129) == "sparse"
    assert ss._form(torch.zeros(300, 4, dtype=torch.float64), 129) == "sparse"
    assert ss._form(torch.zeros(129, 4), 129) == "dense"  # no more rows than ids per row
    monkeypatch.setattr(ss, "_FORCE_FORM", "sparse")
    assert ss._form(torch.zeros(6, 4), 10) == "dense"
    monkeypatch.setattr(ss, "_FORCE_FORM", None)
    assert ss._form(torch.zeros(30, 4, dtype=torch.bfloat16), 5) == "dense"
    assert ss._form(torch.zeros(30_000, 4, dtype=torch.bfloat16), 5) == "gathered"
    monkeypatch.setattr(ss, "_SPARSE_DEVICES", ())  # what a GPU table gets
    assert ss._form(torch.zeros(27278, 4), 129) == "dense"
    assert ss._form(torch.zeros(715_000, 4), 513) == "gathered"


def test_accidental_hits_get_the_reference_logit_and_no_gradient() -> None:
    q, positives, table, _ = _inputs(n_pos=3)
    negatives = positives.unsqueeze(1).repeat(1, 4)  # every negative is its positive
    loss_fn = SampledSoftmax(n_negatives=4)
    loss = loss_fn(q, positives, table, negatives=negatives)
    assert loss.item() == 0.0  # softmax over the positive alone
    gq, gt = _grads(loss, q, table)
    assert not gq.any() and not gt.any()
    # One hit among real negatives: the same loss and gradients as without that column.
    positives = torch.tensor([3])
    with_hit = loss_fn(q[:1], positives, table, negatives=torch.tensor([[1, 3, 2]]))
    without = loss_fn(q[:1], positives, table, negatives=torch.tensor([[1, 2]]))
    torch.testing.assert_close(with_hit, without)
    for a, b in zip(_grads(with_hit, q, table), _grads(without, q, table)):
        torch.testing.assert_close(a, b)
    assert ss.HIT_LOGIT == -5e4


def test_full_softmax_equals_sampled_softmax_over_all_other_items() -> None:
    q, positives, table, _ = _inputs(n_pos=6, n_items=9)
    others = torch.stack([torch.tensor([j for j in range(9) if j != int(p)]) for p in positives])
    sampled = SampledSoftmax(n_negatives=8, temperature=TAU)(q, positives, table, negatives=others)
    full = FullSoftmax(temperature=TAU)(q, positives, table)
    torch.testing.assert_close(full, sampled, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(full, q, table), _grads(sampled, q, table)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    weights = torch.rand(6, dtype=torch.float64)
    torch.testing.assert_close(FullSoftmax(TAU)(q, positives, table, weights=weights),
                               naive_loss(q, positives, table, others, weights))


def test_negatives_are_uniform_and_reproducible() -> None:
    n_items, n_pos, r = 50, 2000, 16
    loss_fn = SampledSoftmax(n_negatives=r, seed=123)
    draws = loss_fn.sample_negatives(n_pos, n_items, "cpu")
    assert draws.shape == (n_pos, r) and draws.dtype == torch.int64
    counts = torch.bincount(draws.reshape(-1), minlength=n_items).double()
    assert counts.numel() == n_items  # nothing outside [0, n_items)
    expected = n_pos * r / n_items
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 85.35  # chi-square 0.999 quantile, 49 degrees of freedom
    again = SampledSoftmax(n_negatives=r, seed=123).sample_negatives(n_pos, n_items, "cpu")
    assert torch.equal(draws, again)
    other = SampledSoftmax(n_negatives=r, seed=124).sample_negatives(n_pos, n_items, "cpu")
    assert not torch.equal(draws, other)
    loss_fn.manual_seed(123)
    assert torch.equal(loss_fn.sample_negatives(n_pos, n_items, "cpu"), draws)
    shared = SampledSoftmax(n_negatives=r, shared_negatives=True)
    assert shared.sample_negatives(n_pos, n_items, "cpu").shape == (r,)


def test_state_dict_restores_the_negatives_stream() -> None:
    loss_fn = SampledSoftmax(n_negatives=4, seed=7)
    assert SampledSoftmax(n_negatives=4, seed=7).state_dict()["_extra_state"]["rng_state"] is None
    loss_fn.sample_negatives(10, 100, "cpu")
    buffer = io.BytesIO()
    torch.save(loss_fn.state_dict(), buffer)
    following = loss_fn.sample_negatives(10, 100, "cpu")
    resumed = SampledSoftmax(n_negatives=4, seed=0)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert resumed.seed == 7
    # Saved again before its first draw, the restored state is kept.
    twice = SampledSoftmax(n_negatives=4)
    twice.load_state_dict(resumed.state_dict())
    assert torch.equal(resumed.sample_negatives(10, 100, "cpu"), following)
    assert torch.equal(twice.sample_negatives(10, 100, "cpu"), following)


def test_drawn_negatives_feed_the_loss() -> None:
    q, positives, table, _ = _inputs(n_pos=5, n_items=30)
    a = SampledSoftmax(n_negatives=6, seed=5)
    b = SampledSoftmax(n_negatives=6, seed=5)
    negatives = b.sample_negatives(5, 30, "cpu")
    torch.testing.assert_close(a(q, positives, table), naive_loss(q, positives, table, negatives))
    empty = a(q[:0], positives[:0], table)
    assert empty.item() == 0.0
    with pytest.raises(ValueError, match="expected queries"):
        a(q, positives[:2], table)


def test_next_item_positives_shift_each_row_and_end_with_its_target() -> None:
    items = torch.tensor([10, 11, 12, 20, 30, 31])
    offsets = torch.tensor([0, 3, 3, 4, 6])  # rows of 3, 0, 1, 2 items
    targets = torch.tensor([13, 99, 21, 32])
    assert next_item_positives(items, offsets, targets).tolist() == [11, 12, 13, 21, 31, 32]
    assert items.tolist() == [10, 11, 12, 20, 30, 31]  # input untouched


def test_mixed_precision_queries_against_an_fp32_table() -> None:
    q, positives, table, g = _inputs(n_items=30)
    negatives = torch.randint(0, 30, (len(positives), 5), generator=g)
    loss_fn = SampledSoftmax(n_negatives=5)
    want = loss_fn(q.float(), positives, table.float(), negatives=negatives)
    got = loss_fn(q.bfloat16(), positives, table.float(), negatives=negatives)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

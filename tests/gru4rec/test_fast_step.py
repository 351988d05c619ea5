"""task.fast_step against the exact step it replaces: same scores, same gradients, same updates.

The fast step scores each distinct item row once and hands the item tables gradients that are
already coalesced; the exact step (the official code's arithmetic) is its slow twin here. In
float64 the two agree to round-off; only the order of the duplicate-row sums differs.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from recforge.kernels.sampled_loss import (
    sampled_bprmax_fused,
    sampled_bprmax_reference,
    sampled_softmax_xe_reference,
)
from recforge.losses.sampled import BPRMax, CrossEntropy, TOP1Max
from recforge.models.gru4rec import GRU4Rec
from recforge.models.row_lookup import unique_row_lookup
from recforge.optim.adagrad_momentum import IndexedAdagradM

N_ITEMS = 41
ITEMS = torch.tensor([0, 5, 5, 40, 12, 3])
# targets first, then sampled negatives with repeats, some of them also inputs or targets
COLUMNS = torch.tensor([7, 5, 12, 12, 0, 3, 9, 9, 9, 40, 7, 1, 5, 33, 33, 2])

MODES = {
    "constrained": dict(constrained_embedding=True),
    "embedding": dict(constrained_embedding=False, embedding=4),
    "onehot": dict(constrained_embedding=False, embedding=0),
}


def _model(mode: str, seed: int = 0, **kwargs) -> GRU4Rec:
    torch.manual_seed(seed)
    model = GRU4Rec(n_items=N_ITEMS, hidden_size=6, **MODES[mode], **kwargs).double()
    with torch.no_grad():  # biases start at zero; random ones test their wiring too
        model.By.weight.normal_(0.0, 0.5)
    return model


def _hidden(model: GRU4Rec, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(ITEMS), w, generator=g, dtype=torch.float64) * 0.5 for w in model.state_widths]


def _dense_grads(model: GRU4Rec) -> dict[str, torch.Tensor]:
    return {n: (p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad)
            for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("sparse", [True, False])
def test_distinct_rows_step_equals_exact_step_forward_and_backward(mode, sparse):
    exact = _model(mode, sparse_embeddings=sparse)
    fast = _model(mode, sparse_embeddings=sparse)
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(len(ITEMS), len(COLUMNS), generator=g, dtype=torch.float64)
    outputs = {}
    for name, model in (("exact", exact), ("fast", fast)):
        hidden = _hidden(model)
        scores, new_hidden = model.train_step(ITEMS, hidden, COLUMNS, distinct_rows=name == "fast")
        (scores * upstream).sum().backward()
        outputs[name] = scores.detach(), [h.detach() for h in new_hidden], _dense_grads(model)
    (s_exact, h_exact, g_exact), (s_fast, h_fast, g_fast) = outputs["exact"], outputs["fast"]
    torch.testing.assert_close(s_fast, s_exact, rtol=1e-12, atol=1e-12)
    for a, b in zip(h_fast, h_exact):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert g_fast.keys() == g_exact.keys()
    for name in g_exact:
        torch.testing.assert_close(g_fast[name], g_exact[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_distinct_rows_gradient_arrives_coalesced_over_the_rows_read():
    model = _model("constrained")
    scores, _ = model.train_step(ITEMS, _hidden(model), COLUMNS, distinct_rows=True)
    scores.sum().backward()
    grad = model.Wy.weight.grad
    assert grad.is_sparse and grad.is_coalesced()
    want = torch.unique(torch.cat([ITEMS, COLUMNS]))
    assert torch.equal(grad._indices()[0], want)
    # the bias rows of inputs that are not scored are left out, as the exact step never reads them
    bias_grad = model.By.weight.grad
    assert bias_grad.is_coalesced() and torch.equal(bias_grad._indices()[0], torch.unique(COLUMNS))


def test_unique_row_lookup_flags_only_a_gradient_that_is_its_own():
    weight = torch.nn.Parameter(torch.randn(10, 3, dtype=torch.float64))
    rows = torch.tensor([1, 4, 7])
    (unique_row_lookup(weight, rows) * 2).sum().backward()
    assert weight.grad.is_coalesced()
    want = torch.zeros(10, 3, dtype=torch.float64)
    want[rows] = 2.0
    assert torch.equal(weight.grad.to_dense(), want)
    # accumulated onto the existing gradient: rows 1 (twice) and 2, no longer distinct
    unique_row_lookup(weight, torch.tensor([1, 2])).sum().backward()
    assert not weight.grad.is_coalesced()
    want[[1, 2]] += 1.0
    assert torch.equal(weight.grad.coalesce().to_dense(), want)
    # two lookups summed by autograd before accumulation: row 4 twice
    weight.grad = None
    (unique_row_lookup(weight, rows).sum() + unique_row_lookup(weight, torch.tensor([4, 5])).sum()).backward()
    assert not weight.grad.is_coalesced()
    assert weight.grad.coalesce().to_dense()[4].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("logq", [0.0, 1.0, 0.5])
def test_fast_cross_entropy_equals_the_reference(logq):
    g = torch.Generator().manual_seed(3)
    scores = (torch.randn(6, 20, generator=g, dtype=torch.float64) * 3).requires_grad_()
    log_q = torch.log(torch.rand(20, generator=g, dtype=torch.float64) * 50 + 1)
    loss = CrossEntropy(logq=logq)
    got = loss.fast(scores, 32, log_q=log_q)
    (grad_got,) = torch.autograd.grad(got, scores)
    want = sampled_softmax_xe_reference(scores, log_q, logq, 32)
    (grad_want,) = torch.autograd.grad(want, scores)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-10, atol=1e-12)
    # by hand: softmax minus the one-hot target, over the configured batch size
    x = scores.detach() - logq * log_q
    hand = (F.softmax(x, dim=1) - torch.eye(6, 20, dtype=torch.float64)) / 32
    torch.testing.assert_close(grad_got, hand, rtol=1e-10, atol=1e-12)


def test_a_loss_without_a_fast_form_is_itself():
    scores = torch.randn(4, 9, dtype=torch.float64)
    loss = TOP1Max(elu_param=0.5)
    assert torch.equal(loss.fast(scores, 8), loss(scores, 8))


@pytest.mark.parametrize("elu_param", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("bpreg", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("shape", [(6, 20), (3, 3), (1, 2)])
def test_fused_bprmax_equals_the_reference_forward_and_backward(elu_param, bpreg, shape):
    g = torch.Generator().manual_seed(5)
    scores = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2).requires_grad_()
    upstream = torch.tensor(1.7, dtype=torch.float64)
    got = sampled_bprmax_fused(scores, bpreg, elu_param, 32)
    (grad_got,) = torch.autograd.grad(got * upstream, scores)
    want = sampled_bprmax_reference(scores, bpreg, elu_param, 32)
    (grad_want,) = torch.autograd.grad(want * upstream, scores)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-9, atol=1e-12)
    assert BPRMax(bpreg=bpreg, elu_param=elu_param).fast(scores, 32).item() == pytest.approx(want.item(), rel=1e-12)


def test_fused_bprmax_without_autograd_gives_the_reference_value():
    scores = torch.randn(5, 30, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with torch.no_grad():
        got = sampled_bprmax_fused(scores, 0.5, 0.5, 8)
    assert got.item() == pytest.approx(sampled_bprmax_reference(scores, 0.5, 0.5, 8).item(), rel=1e-12)


@pytest.mark.parametrize("elu_param", [0.0, 0.5])
def test_fused_bprmax_in_float32_stays_near_the_float64_reference(elu_param):
    """The written-out gradient folds σ − P − σ(1 − σ) into σ² − P: in float32, with sigmoids
    saturated both ways (scores spread over ±40) and the preset's shape, it still lands within
    float32 round-off of the float64 reference, relative to the gradient's own size."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(32, 2080, generator=g, dtype=torch.float64) * 12
    scores[:, :32] += torch.eye(32, dtype=torch.float64) * 20  # some targets far ahead
    want_scores = scores.clone().requires_grad_()
    want = sampled_bprmax_reference(want_scores, 0.5, elu_param, 32)
    (grad_want,) = torch.autograd.grad(want, want_scores)
    got_scores = scores.float().requires_grad_()
    got = sampled_bprmax_fused(got_scores, 0.5, elu_param, 32)
    (grad_got,) = torch.autograd.grad(got, got_scores)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert (grad_got.double() - grad_want).abs().max() <= 1e-5 * grad_want.abs().max()


@pytest.mark.parametrize("loss", [CrossEntropy(logq=1.0), BPRMax(bpreg=0.5, elu_param=0.5)])
def test_updates_of_the_fast_step_follow_the_exact_ones(loss):
    """Five optimizer steps (sparse Adagrad with momentum, as trained) from one init: the weights
    stay within round-off of the exact step's, dropout off so both see the same function."""
    models = {name: _model("constrained") for name in ("exact", "fast")}
    optims = {name: IndexedAdagradM(m.parameters(), lr=0.2, momentum=0.2) for name, m in models.items()}
    log_pop = torch.log(torch.arange(1, N_ITEMS + 1, dtype=torch.float64))
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, N_ITEMS, (6,), generator=g), torch.randint(0, N_ITEMS, (6,), generator=g),
                torch.randint(0, N_ITEMS, (10,), generator=g)) for _ in range(5)]
    for name, model in models.items():
        hidden = _hidden(model)
        for items, targets, negatives in batches:
            columns = torch.cat([targets, negatives])
            scores, hidden = model.train_step(items, hidden, columns, distinct_rows=name == "fast")
            hidden = [h.detach() for h in hidden]
            value = (loss.fast if name == "fast" else loss)(scores, 8, log_q=log_pop[columns])
            optims[name].zero_grad(set_to_none=True)
            value.backward()
            optims[name].step()
    exact, fast = (dict(models[n].named_parameters()) for n in ("exact", "fast"))
    for name in exact:
        torch.testing.assert_close(fast[name], exact[name], rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(exact["Wy.weight"], _model("constrained").Wy.weight)  # it did train


# ---------------------------------------------------------------- the fused step (one autograd node)
FUSED_LOSSES = {
    "xe_logq": CrossEntropy(logq=1.0),
    "xe": CrossEntropy(logq=0.0),
    "bprmax_elu": BPRMax(bpreg=0.5, elu_param=0.5),
    "bprmax": BPRMax(bpreg=1.0, elu_param=0.0),
}


@pytest.mark.parametrize("loss_name", sorted(FUSED_LOSSES))
@pytest.mark.parametrize("dropout", [(0.0, 0.0), (0.3, 0.4)], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("columns", [COLUMNS, COLUMNS[: len(ITEMS)]], ids=["negatives", "in-batch"])
def test_fused_step_equals_its_autograd_twin_forward_and_backward(loss_name, dropout, columns):
    """The written-out backward against autograd through the distinct-rows step and the loss's
    ``fast`` form: loss, carried state, every gradient, and the tables' gradients over the same
    distinct rows, flagged coalesced. Dropout draws the same masks from the same seed."""
    loss = FUSED_LOSSES[loss_name]
    p_embed, p_hidden = dropout
    log_q = torch.log(torch.arange(1, len(columns) + 1, dtype=torch.float64))
    results = {}
    for twin in ("autograd", "fused"):
        model = _model("constrained", dropout_p_embed=p_embed, dropout_p_hidden=p_hidden)
        assert model.fused_step_supported
        (hidden,) = _hidden(model)
        torch.manual_seed(11)
        if twin == "autograd":
            scores, (state,) = model.train_step(ITEMS, [hidden], columns, distinct_rows=True)
            value = loss.fast(scores, 8, log_q=log_q)
        else:
            value, state = model.fused_train_step(
                ITEMS, hidden, columns, lambda s: loss.fast_value_and_grad(s, 8, log_q=log_q))
            assert not state.requires_grad
        (value * 1.7).backward()  # an upstream gradient other than 1
        results[twin] = value.detach(), state.detach(), dict(model.named_parameters())
    (want_value, want_state, want), (got_value, got_state, got) = results["autograd"], results["fused"]
    torch.testing.assert_close(got_value, want_value, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_state, want_state, rtol=1e-12, atol=1e-13)
    for name, param in want.items():
        if param.grad.is_sparse:
            assert got[name].grad.is_coalesced() and param.grad.is_coalesced(), name
            assert torch.equal(got[name].grad._indices(), param.grad._indices()), name
        torch.testing.assert_close(_dense_grads_of(got[name]), _dense_grads_of(param), rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _dense_grads_of(param: torch.Tensor) -> torch.Tensor:
    return param.grad.to_dense() if param.grad.is_sparse else param.grad


@pytest.mark.parametrize("kwargs", [dict(cell="original"), dict(num_layers=2), dict(sparse_embeddings=False),
                                    dict(constrained_embedding=False, embedding=4)])
def test_the_fused_step_covers_only_the_configuration_it_writes_out(kwargs):
    """Other cells, stacks, dense tables or input tables take the autograd fast step."""
    torch.manual_seed(0)
    assert GRU4Rec(n_items=N_ITEMS, hidden_size=6).fused_step_supported
    assert not GRU4Rec(n_items=N_ITEMS, hidden_size=6, **kwargs).fused_step_supported
    assert not TOP1Max(elu_param=0.5).has_value_and_grad


# ---------------------------------------------------------------- counted columns (distinct negatives)
def _repeat_columns(n_rows: int, counts: torch.Tensor, seed: int) -> torch.Tensor:
    """Column index into the counted matrix for every column of the repeated one: the targets'
    columns first, then each negative as often as counted, the negatives' copies shuffled."""
    negatives = torch.repeat_interleave(torch.arange(n_rows, len(counts)), counts[n_rows:].long())
    negatives = negatives[torch.randperm(len(negatives), generator=torch.Generator().manual_seed(seed))]
    return torch.cat([torch.arange(n_rows), negatives])


@pytest.mark.parametrize("loss_name", sorted(FUSED_LOSSES))
def test_counted_columns_give_the_value_and_summed_gradient_of_their_repeats(loss_name):
    """Oracle: the same loss over the matrix with each negative column written out as often as
    counted (shuffled). The value is the same; a counted column's gradient is the sum of its
    copies' gradients."""
    loss = FUSED_LOSSES[loss_name]
    g = torch.Generator().manual_seed(12)
    n_rows, n_negatives = 6, 9
    scores = torch.randn(n_rows, n_rows + n_negatives, generator=g, dtype=torch.float64) * 2
    scores[:, n_rows + 2] = scores[:, 0]  # a negative with a target's score (as when it is that item)
    counts = torch.cat([torch.ones(n_rows, dtype=torch.float64),
                        torch.randint(1, 4, (n_negatives,), generator=g).double()])
    log_q = torch.log(torch.rand(n_rows + n_negatives, generator=g, dtype=torch.float64) * 50 + 1)
    repeat = _repeat_columns(n_rows, counts, seed=3)
    assert len(repeat) > len(counts)  # some negatives do repeat
    want_value, want_grad_repeated = loss.fast_value_and_grad(scores[:, repeat], 8, log_q=log_q[repeat])
    want_grad = torch.zeros_like(scores).index_add_(1, repeat, want_grad_repeated)
    value, grad = loss.fast_value_and_grad(scores, 8, log_q=log_q, counts=counts)
    torch.testing.assert_close(value, want_value, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-13)
    # every column counted once is the uncounted loss
    ones = torch.ones_like(counts)
    for got, want in zip(loss.fast_value_and_grad(scores, 8, log_q=log_q, counts=ones),
                         loss.fast_value_and_grad(scores, 8, log_q=log_q)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("loss_name", ["xe", "bprmax"])
def test_counts_of_another_length_or_dtype_are_refused(loss_name):
    loss = FUSED_LOSSES[loss_name]
    scores = torch.randn(3, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"counts must be \[C\] = \[7\]"):
        loss.fast_value_and_grad(scores, 8, counts=torch.ones(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="counts must have the scores' dtype"):
        loss.fast_value_and_grad(scores, 8, counts=torch.ones(7, dtype=torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["xe", "bprmax"])
def test_the_task_scores_each_distinct_negative_once_as_the_repeated_columns_would(make_cfg, loss):
    """BPR-max: the task's fused step hands the loss each distinct negative once, with its count;
    cross-entropy, where that does not pay, every draw. Oracle: the model's fused step over the
    targets and every draw as drawn, same weights and draws."""
    import functools

    from recforge.pipeline import build

    cfg = make_cfg("task.fast_step=true", f"loss={loss}", "task.n_sample=64", "model.dropout_p_hidden=0.0",
                   "model.dropout_p_embed=0.0")
    datamodule, task = build(cfg)
    datamodule.setup("fit")
    task.train()
    task.on_train_epoch_start()
    batch = next(iter(datamodule.train_dataloader()))
    step = batch.steps[0] if hasattr(batch, "steps") else batch
    drawn = torch.randint(0, task.model.n_items, (64,), generator=torch.Generator().manual_seed(0))
    drawn[:10] = drawn[10]  # some draws repeat for sure
    task.sampler.sample = lambda: drawn.clone()
    model_step, seen = task.model.fused_train_step, []
    task.model.fused_train_step = lambda items, hidden, columns, vg: seen.append(len(columns)) or model_step(
        items, hidden, columns, vg)
    results = []
    for counted in (True, False):
        task.zero_grad(set_to_none=True)
        if counted:
            value = task.train_loss(step)
        else:
            columns = torch.cat([step.targets, drawn])
            log_q = None
            if task.loss.uses_log_q:
                log_q = torch.cat([task.log_popularity[step.targets],
                                   task.sample_alpha * task.log_popularity[drawn]])
            hidden = torch.zeros(step.size, task.model.state_widths[0])
            value, _ = model_step(step.inputs, hidden, columns, functools.partial(
                task.loss.fast_value_and_grad, batch_size=task.batch_size, log_q=log_q))
        value.backward()
        results.append((value.detach(), {n: _dense_grads_of(p).clone() for n, p in task.model.named_parameters()}))
    (got_value, got), (want_value, want) = results
    n_negatives = len(torch.unique(drawn)) if loss == "bprmax" else len(drawn)
    assert seen == [step.size + n_negatives]
    torch.testing.assert_close(got_value, want_value, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

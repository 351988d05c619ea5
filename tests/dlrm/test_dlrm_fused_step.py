"""DLRM's fused SGD step (``task.fast_step=true``, recforge/models/dlrm_fused_step.py) against its
slow twin: the same model's autograd loss, ``backward`` and ``torch.optim.SGD``. The loss, every
parameter after the update, and the refusals of what the fused step does not write out."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from recforge.errors import UserInputError
from recforge.models.dlrm import DLRM
from recforge.models.dlrm_fused_step import fused_sgd_step_loss, symmetric_pair_gather
from recforge.pipeline import build, train
from recforge.tasks.ctr import _plain_sgd_rates

CARDS = [5, 3, 7]


def _model(itself: bool = False, dtype=torch.float64, **kw) -> DLRM:
    torch.manual_seed(3)
    kw = {"n_dense": 4, "embedding_dim": 3, "dense_arch": [6, 5], "over_arch": [8, 4], **kw}
    return DLRM(cardinalities=CARDS, interaction_itself=itself, **kw).to(dtype)


def _sgd(model: DLRM, lr_dense: float, lr_tables: float) -> torch.optim.SGD:
    tables = {id(p) for p in model.sparse_parameters()}
    return torch.optim.SGD([{"params": [p for p in model.parameters() if id(p) not in tables], "lr": lr_dense},
                            {"params": model.sparse_parameters(), "lr": lr_tables, "sparse": True}], lr=lr_dense)


def _batch(rows: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(rows, 4, generator=gen, dtype=dtype)
    sparse = torch.stack([torch.randint(0, c, (rows,), generator=gen) for c in CARDS], dim=1)
    sparse[1] = sparse[0]  # a repeated row: its table rows are updated twice, in order
    labels = (torch.rand(rows, generator=gen) > 0.5).to(dtype)
    return dense, sparse, labels


@pytest.mark.parametrize("itself", [False, True])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_the_fused_step_is_autograd_then_sgd(itself: bool, scale: float) -> None:
    fused = _model(itself)
    twin = copy.deepcopy(fused)
    rates = _plain_sgd_rates(_sgd(fused, 0.3, 0.7))
    slow = _sgd(twin, 0.3, 0.7)
    for step in range(4):
        dense, sparse, labels = _batch(6, step)
        loss = fused_sgd_step_loss(fused, dense, sparse, labels, rates)
        (loss * scale).backward()
        twin_loss = torch.nn.functional.binary_cross_entropy_with_logits(twin(dense, sparse), labels)
        slow.zero_grad(set_to_none=True)
        (twin_loss * scale).backward()
        slow.step()
        if step == 0:  # from the same weights the forward runs the autograd path's operations: bit for bit
            assert loss.item() == twin_loss.item()
        assert loss.item() == pytest.approx(twin_loss.item(), rel=0, abs=1e-13)
        for (name, a), b in zip(fused.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13, msg=f"step {step}: {name}")
            assert a.grad is None, name
    # and the twin did move: the comparison is not of untouched weights
    assert not torch.equal(fused.over_arch.mlp[0].weight, _model(itself).over_arch.mlp[0].weight)


def test_float32_at_the_kaggle_widths_stays_within_round_off_of_float64() -> None:
    kw = {"n_dense": 13, "embedding_dim": 16, "dense_arch": [64, 32], "over_arch": [64, 32]}
    torch.manual_seed(0)
    cards = [50] * 26
    exact = DLRM(cardinalities=cards, **kw).double()
    fused = copy.deepcopy(exact).float()
    slow = _sgd(exact, 0.1, 0.1)

    def rates() -> tuple[float, float]:
        return 0.1, 0.1

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        dense = torch.rand(128, 13, generator=gen)
        sparse = torch.randint(0, 50, (128, 26), generator=gen)
        labels = (torch.rand(128, generator=gen) > 0.7).float()
        fused_sgd_step_loss(fused, dense, sparse, labels, rates).backward()
        slow.zero_grad(set_to_none=True)
        torch.nn.functional.binary_cross_entropy_with_logits(exact(dense.double(), sparse), labels.double()).backward()
        slow.step()
    for (name, a), b in zip(fused.named_parameters(), exact.parameters(), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_learning_rates_are_read_when_the_backward_runs() -> None:
    fused = _model()
    twin = copy.deepcopy(fused)
    optimizer = _sgd(fused, 0.3, 0.3)
    rates = _plain_sgd_rates(optimizer)
    slow = _sgd(twin, 0.05, 0.9)
    dense, sparse, labels = _batch(5, 0)
    loss = fused_sgd_step_loss(fused, dense, sparse, labels, rates)
    optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"] = 0.05, 0.9  # as a scheduler would
    loss.backward()
    torch.nn.functional.binary_cross_entropy_with_logits(twin(dense, sparse), labels).backward()
    slow.step()
    for a, b in zip(fused.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_no_backward_no_update() -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    dense, sparse, labels = _batch(4, 0)
    with torch.no_grad():
        loss = fused_sgd_step_loss(model, dense, sparse, labels, lambda: (1.0, 1.0))
    assert math.isfinite(loss.item())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_symmetric_gather_by_hand() -> None:
    # F = 3, width 2: the padded gradient's columns are [0 | w0 w1 | p(1,0) p(2,0) p(2,1)] -> 3, 4, 5
    assert symmetric_pair_gather(3, 2, itself=False).view(3, 3).tolist() == [[0, 3, 4], [3, 0, 5], [4, 5, 0]]
    # with itself the pairs are (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) -> 3..8
    assert symmetric_pair_gather(3, 2, itself=True).view(3, 3).tolist() == [[3, 4, 6], [4, 5, 7], [6, 7, 8]]


def test_bad_ids_and_bags_are_refused_naming_them() -> None:
    model = _model()
    dense, sparse, labels = _batch(4, 0)
    sparse[2, 1] = CARDS[1]
    with pytest.raises(ValueError, match=r"sparse\[2, 1\] = 3 is outside feature 1's table \[0, 3\)"):
        fused_sgd_step_loss(model, dense, sparse, labels, lambda: (1.0, 1.0))
    from recforge.data.batches import SparseBags

    bags = SparseBags.from_one_hot(sparse.clamp(max=2))
    with pytest.raises(UserInputError, match=r"^task.fast_step=true takes one id per feature .*SparseBags"):
        fused_sgd_step_loss(model, dense, bags, labels, lambda: (1.0, 1.0))


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.interaction=cat"], r"model.interaction=cat"),
    (["model.over_arch_batch_norm=true"], r"model.over_arch_batch_norm or over_arch_dropout"),
    (["model.dense_arch_dropout=0.1"], r"model.dense_arch_batch_norm or dense_arch_dropout"),
    (["task.gradient_clip_val=1.0"], r"task.gradient_clip_val=1.0"),
    (["task.embedding_l2=0.001", "model.sparse_gradients=false"], r"task.embedding_l2=0.001"),
])
def test_what_the_fused_step_does_not_write_out_is_refused_at_build(make_cfg, overrides, message) -> None:
    with pytest.raises(UserInputError, match=rf"^task.fast_step=true cannot run with {message}.*: set task.fast_step=false$"):
        build(make_cfg(*SMALL, "task.fast_step=true", *overrides))


@pytest.mark.parametrize(("overrides", "message"), [
    (["optimizer=adagrad"], r"needs optimizer=sgd, got torch.optim.adagrad.Adagrad"),
    (["optimizer.momentum=0.9"], r"got optimizer.momentum=0.9"),
])
def test_an_optimizer_other_than_plain_sgd_is_refused(make_cfg, overrides, message) -> None:
    _, task = build(make_cfg(*SMALL, "task.fast_step=true", *overrides))
    with pytest.raises(UserInputError, match=rf"^task.fast_step=true .*{message}"):
        task.configure_optimizers()


SMALL = ["model=dlrm", "data.generator.n_rows=3000", "data.batch_size=128", "data.eval_batch_size=1000",
         "model.dense_arch=[32,16]", "model.over_arch=[32]", "model.embedding_dim=8"]


@pytest.mark.slow
def test_a_fast_run_trains_as_the_default_step(make_cfg) -> None:
    runs = {}
    for fast in (False, True):
        cfg = make_cfg(*SMALL, "data.generator.n_rows=20000", "optimizer.lr=1.0", "trainer.max_epochs=2",
                       f"task.fast_step={str(fast).lower()}", run=f"fast{fast}")
        metrics = train(cfg)
        checkpoint = torch.load(metrics["test_checkpoint"], map_location="cpu", weights_only=False)
        runs[fast] = metrics, checkpoint["state_dict"], checkpoint["global_step"]
    (slow_metrics, slow_state, slow_steps), (fast_metrics, fast_state, fast_steps) = runs[False], runs[True]
    assert fast_steps == slow_steps > 0  # Lightning counts the fast step's updates as the default's
    assert slow_state.keys() == fast_state.keys()
    for key in slow_state:
        if key.startswith("model."):
            torch.testing.assert_close(fast_state[key], slow_state[key], rtol=1e-4, atol=1e-5, msg=key)
    assert fast_metrics["test/auc"] == pytest.approx(slow_metrics["test/auc"], abs=1e-4)
    assert fast_metrics["test/auc"] > 0.55  # it learned


@pytest.mark.parametrize("fast", [False, True])
def test_a_step_limit_ends_the_run_after_that_many_updates(make_cfg, fast: bool) -> None:
    # 5 updates of 128 rows, before the first validation (early stopping on val/auc has seen none)
    metrics = train(make_cfg(*SMALL, "trainer.max_epochs=3", "trainer.max_steps=5",
                             f"task.fast_step={str(fast).lower()}", run=f"steps{fast}"))
    assert Path(metrics["test_checkpoint"]).name == "last.ckpt"
    assert torch.load(metrics["test_checkpoint"], map_location="cpu", weights_only=False)["global_step"] == 5
    assert metrics["train/events"] == 5 * 128
    assert 0 < metrics["test/auc"] < 1


@pytest.mark.slow
def test_a_fast_run_resumes_as_if_uninterrupted(make_cfg) -> None:
    fast = [*SMALL, "task.fast_step=true"]
    straight = train(make_cfg(*fast, "trainer.max_epochs=2", run="straight"))
    first = train(make_cfg(*fast, "trainer.max_epochs=1", run="first"))
    last = Path(first["test_checkpoint"]).parent / "last.ckpt"
    resumed = train(make_cfg(*fast, "trainer.max_epochs=2", f"ckpt_path={last}", run="resumed"))
    a, b = (torch.load(Path(run["test_checkpoint"]).parent / "last.ckpt", map_location="cpu",
                       weights_only=False)["state_dict"] for run in (straight, resumed))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_more_than_one_process_is_refused_at_setup(make_cfg) -> None:
    from types import SimpleNamespace

    _, task = build(make_cfg(*SMALL, "task.fast_step=true"))
    task._trainer = SimpleNamespace(world_size=2)  # what setup reads of a DDP trainer
    with pytest.raises(UserInputError, match=r"^task.fast_step=true updates in the backward, .* \(this run has 2\)"):
        task.setup("fit")


def test_the_compiled_step_is_the_eager_step() -> None:
    from recforge.models import dlrm_fused_step

    eager = _model(dtype=torch.float32)
    compiled = copy.deepcopy(eager)
    compiled.compile_dense = True  # model.compile=true
    for step, rows in enumerate((6, 6, 5)):  # the last batch is shorter: compiled once more
        dense, sparse, labels = _batch(rows, step, dtype=torch.float32)
        losses = []
        for model in (eager, compiled):
            loss = fused_sgd_step_loss(model, dense, sparse, labels, lambda: (0.3, 0.7))
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    assert "step" in dlrm_fused_step._COMPILED  # the compiled body ran, not the eager one

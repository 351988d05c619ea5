"""DLRM's BARS options (batch norm and dropout in the bottom and top MLPs, as FuxiCTR 1.2.1's
``MLP_Layer``): the layer order against hand-built Sequentials holding the same weights, in train
mode (dropout masks, batch statistics, running-stat updates) and in eval mode (running stats, no
dropout); dropout really active in training; the defaults building exactly the reference's modules;
BARS's Criteo_x1 shape; bad values refused in one line."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from recforge.config_values import ConfigValueError, check_config_values
from recforge.errors import UserInputError
from recforge.models.dlrm import DLRM, DenseArch, OverArch, load_reference_state_dict

CARDS = [4 + 3 * f for f in range(26)]


def _batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, 13, generator=gen) * 3
    sparse = torch.stack([torch.randint(0, c, (batch,), generator=gen) for c in CARDS], dim=1)
    return dense, sparse


def _model(**kwargs) -> DLRM:
    torch.manual_seed(0)
    options = {"embedding_dim": 4, "dense_arch": (8, 6), "over_arch": (7, 5),
               "sparse_gradients": False, **kwargs}
    return DLRM(CARDS, **options)


def _by_kind(modules, kind) -> list[nn.Module]:
    return [m for m in modules if isinstance(m, kind)]


def _copy_into(hand: nn.Sequential, mlp: nn.Sequential) -> None:
    """The i-th Linear / BatchNorm1d of ``mlp`` into the i-th of ``hand`` (parameters and running
    stats), whatever order either puts them in."""
    for kind in (nn.Linear, nn.BatchNorm1d):
        mine, theirs = _by_kind(hand, kind), _by_kind(mlp, kind)
        assert len(mine) == len(theirs)
        for target, source in zip(mine, theirs):
            target.load_state_dict(source.state_dict())


def _hand_built(model: DLRM, p_bottom: float, p_top: float) -> tuple[nn.Sequential, nn.Sequential]:
    """FuxiCTR's order written out: hidden = Linear, BatchNorm1d, ReLU, Dropout; the bottom's last
    layer Linear(·, d), ReLU; the top's last a bare Linear(·, 1)."""
    bottom = nn.Sequential(
        nn.Linear(13, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(p_bottom),
        nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(p_bottom),
        nn.Linear(6, 4), nn.ReLU(),
    )
    top = nn.Sequential(
        nn.Linear(4 + 351, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Dropout(p_top),
        nn.Linear(7, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Dropout(p_top),
        nn.Linear(5, 1),
    )
    _copy_into(bottom, model.dense_arch.mlp)
    _copy_into(top, model.over_arch.mlp)
    return bottom, top


def _scramble_batch_norms(model: nn.Module) -> None:
    """Affine weights and running stats away from their identity init, so that a misplaced batch
    norm changes the numbers in both modes."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for bn in _by_kind(model.modules(), nn.BatchNorm1d):
            n = bn.num_features
            bn.weight.copy_(0.5 + torch.rand(n, generator=gen))
            bn.bias.copy_(torch.randn(n, generator=gen))
            bn.running_mean.copy_(torch.randn(n, generator=gen))
            bn.running_var.copy_(0.5 + torch.rand(n, generator=gen))


# ---------------------------------------------------------------- order against a hand-built MLP
def test_layer_order_matches_hand_built_sequentials_in_train_and_eval() -> None:
    model = _model(dense_arch_batch_norm=True, over_arch_batch_norm=True,
                   dense_arch_dropout=0.3, over_arch_dropout=0.2)
    _scramble_batch_norms(model)
    bottom, top = _hand_built(model, 0.3, 0.2)
    dense, sparse = _batch(16)
    embeddings = model.sparse_arch(sparse).detach()

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        return top(model.interaction(bottom(x), embeddings)).squeeze(1)

    # train: batch statistics and dropout masks drawn in the same order from the same seed
    model.train(), bottom.train(), top.train()
    for step in range(3):  # running stats keep agreeing over several updates
        torch.manual_seed(100 + step)
        ours = model(dense, sparse)
        torch.manual_seed(100 + step)
        theirs = by_hand(dense)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for mine, hand in ((model.dense_arch.mlp, bottom), (model.over_arch.mlp, top)):
        for a, b in zip(_by_kind(mine, nn.BatchNorm1d), _by_kind(hand, nn.BatchNorm1d)):
            torch.testing.assert_close(a.running_mean, b.running_mean, rtol=0, atol=0)
            torch.testing.assert_close(a.running_var, b.running_var, rtol=0, atol=0)
            assert int(a.num_batches_tracked) == 3

    # eval: running stats, no dropout, so no seed needed and repeated calls agree exactly
    model.eval(), bottom.eval(), top.eval()
    with torch.no_grad():
        ours = model(dense, sparse)
        torch.testing.assert_close(ours, by_hand(dense), rtol=1e-6, atol=1e-6)
        assert torch.equal(model(dense, sparse), ours)


def test_batch_norm_sits_before_the_relu_and_dropout_after_it() -> None:
    model = _model(dense_arch_batch_norm=True, over_arch_batch_norm=True,
                   dense_arch_dropout=0.1, over_arch_dropout=0.2)
    hidden = [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Dropout]
    assert [type(m) for m in model.dense_arch.mlp] == hidden * 2 + [nn.Linear, nn.ReLU]
    assert [type(m) for m in model.over_arch.mlp] == hidden * 2 + [nn.Linear]
    assert [m.p for m in _by_kind(model.dense_arch.mlp, nn.Dropout)] == [0.1, 0.1]
    assert [m.p for m in _by_kind(model.over_arch.mlp, nn.Dropout)] == [0.2, 0.2]
    # each option only where asked, and a 0 dropout adds no module (as FuxiCTR)
    model = _model(over_arch_batch_norm=True, dense_arch_dropout=0.5)
    assert [type(m) for m in model.dense_arch.mlp] == [nn.Linear, nn.ReLU, nn.Dropout] * 2 + [
        nn.Linear, nn.ReLU]
    assert [type(m) for m in model.over_arch.mlp] == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [
        nn.Linear]
    # no hidden layer: nothing to normalise or drop (the last layers never get either)
    model = _model(dense_arch=(), over_arch=(), dense_arch_batch_norm=True, over_arch_batch_norm=True,
                   dense_arch_dropout=0.5, over_arch_dropout=0.5)
    assert [type(m) for m in model.dense_arch.mlp] == [nn.Linear, nn.ReLU]
    assert [type(m) for m in model.over_arch.mlp] == [nn.Linear]


def test_the_archs_take_the_options_directly() -> None:
    arch = DenseArch(5, [3, 2], batch_norm=True, dropout=0.25)
    assert [type(m) for m in arch.mlp] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Dropout,
                                           nn.Linear, nn.ReLU]
    arch = OverArch(5, [3], batch_norm=True, dropout=0.25)
    assert [type(m) for m in arch.mlp] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Dropout, nn.Linear]


# ---------------------------------------------------------------- dropout and batch norm in training
@pytest.mark.parametrize("which", ["dense_arch_dropout", "over_arch_dropout"])
def test_dropout_is_active_in_train_mode_only(which) -> None:
    model = _model(**{which: 0.5})
    dense, sparse = _batch(64, seed=2)
    kept = []
    handle = _by_kind(model.modules(), nn.Dropout)[0].register_forward_hook(
        lambda module, args, out: kept.append(((out != 0).sum() / (args[0] != 0).sum()).item())
    )
    model.train()
    first, second = model(dense, sparse), model(dense, sparse)
    assert not torch.equal(first, second)  # a fresh mask each step
    assert all(0.3 < k < 0.7 for k in kept)  # about half the non-zero units survive (p = 0.5)
    model.eval()
    kept.clear()
    with torch.no_grad():
        assert torch.equal(model(dense, sparse), model(dense, sparse))
    assert kept == [1.0, 1.0]  # nothing dropped
    handle.remove()


def test_batch_norm_updates_running_stats_in_train_mode_only() -> None:
    model = _model(dense_arch_batch_norm=True, over_arch_batch_norm=True)
    dense, sparse = _batch(32, seed=3)
    norms = _by_kind(model.modules(), nn.BatchNorm1d)
    assert len(norms) == 4
    model.eval()
    with torch.no_grad():
        model(dense, sparse)
    assert all(torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean)) for bn in norms)
    model.train()
    model(dense, sparse)
    assert all(not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean)) for bn in norms)
    # reset_parameters puts them back (weight 1, bias 0, mean 0, variance 1)
    model.reset_parameters()
    for bn in norms:
        assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert torch.equal(bn.running_var, torch.ones_like(bn.running_var))
        assert torch.equal(bn.weight, torch.ones_like(bn.weight)) and not bn.bias.any()


# ---------------------------------------------------------------- defaults are the reference's
def test_defaults_build_exactly_the_reference_modules() -> None:
    model = _model()
    assert [type(m) for m in model.dense_arch.mlp] == [nn.Linear, nn.ReLU] * 3
    assert [type(m) for m in model.over_arch.mlp] == [nn.Linear, nn.ReLU] * 2 + [nn.Linear]
    assert not _by_kind(model.modules(), nn.BatchNorm1d) and not _by_kind(model.modules(), nn.Dropout)
    assert sorted(model.state_dict()) == sorted(
        ["sparse_arch.embedding.weight"]
        + [f"dense_arch.mlp.{k}.{p}" for k in (0, 2, 4) for p in ("weight", "bias")]
        + [f"over_arch.mlp.{k}.{p}" for k in (0, 2, 4) for p in ("weight", "bias")]
    )
    # the explicit off values are the defaults, drawn the same; the options draw nothing, so the
    # Linear weights of a model with them are those of the plain one
    explicit = _model(dense_arch_batch_norm=False, over_arch_batch_norm=False,
                      dense_arch_dropout=0.0, over_arch_dropout=0)
    assert all(torch.equal(v, explicit.state_dict()[k]) for k, v in model.state_dict().items())
    full = _model(dense_arch_batch_norm=True, over_arch_batch_norm=True, dense_arch_dropout=0.2,
                  over_arch_dropout=0.2)
    for arch in ("dense_arch", "over_arch"):
        plain = _by_kind(getattr(model, arch).mlp, nn.Linear)
        other = _by_kind(getattr(full, arch).mlp, nn.Linear)
        assert all(torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
                   for a, b in zip(plain, other))


def test_reference_loader_takes_dropout_and_refuses_batch_norm() -> None:
    shapes = {"bot_l.0": (8, 13), "bot_l.2": (6, 8), "bot_l.4": (4, 6),
              "top_l.0": (7, 355), "top_l.2": (5, 7), "top_l.4": (1, 5)}
    gen = torch.Generator().manual_seed(4)
    state = {f"emb_l.{t}.weight": torch.randn(c, 4, generator=gen) for t, c in enumerate(CARDS)}
    for name, shape in shapes.items():
        state[f"{name}.weight"] = torch.randn(*shape, generator=gen)
        state[f"{name}.bias"] = torch.randn(shape[0], generator=gen)
    plain, dropped = _model(), _model(dense_arch_dropout=0.3, over_arch_dropout=0.3)
    load_reference_state_dict(plain, state)
    load_reference_state_dict(dropped, state)  # the i-th Linear is the reference's 2i
    plain.eval(), dropped.eval()
    dense, sparse = _batch(8)
    with torch.no_grad():
        assert torch.equal(plain(dense, sparse), dropped(dense, sparse))
    with pytest.raises(ValueError, match="DLRM_Net has no batch norm"):
        load_reference_state_dict(_model(over_arch_batch_norm=True), state)


# ---------------------------------------------------------------- BARS's Criteo_x1 DLRM
def test_bars_criteo_x1_shape_and_parameter_count() -> None:
    model = DLRM(CARDS, embedding_dim=10, dense_arch=[400, 400, 400], over_arch=[400, 400, 400],
                 dense_arch_batch_norm=True, over_arch_batch_norm=True, over_arch_dropout=0.2,
                 sparse_gradients=False)
    widths = [(m.in_features, m.out_features) for m in _by_kind(model.dense_arch.mlp, nn.Linear)]
    assert widths == [(13, 400), (400, 400), (400, 400), (400, 10)]
    widths = [(m.in_features, m.out_features) for m in _by_kind(model.over_arch.mlp, nn.Linear)]
    assert widths == [(361, 400), (400, 400), (400, 400), (400, 1)]  # 10 + 27·26/2 = 361
    mlp_params = sum(p.numel() for arch in (model.dense_arch, model.over_arch)
                     for p in arch.parameters())
    # BARS's DLRM log counts 21,664,241 parameters; its LR log on the same Criteo_x1 encoding
    # (criteo_x1_7b681156) counts 2,086,317 = 2,086,303 categorical ids + 13 numeric + 1 bias, so
    # the MLPs hold 21,664,241 - 10 · 2,086,303: batch norm in all six hidden layers, none on
    # the bottom's output layer (that would add 20)
    assert mlp_params == 21_664_241 - 10 * 2_086_303 == 801_211


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dense_arch_dropout": 1.0}, r"model.dense_arch_dropout must be a number in \[0, 1\), got 1.0"),
        ({"over_arch_dropout": -0.1}, r"model.over_arch_dropout must be a number in \[0, 1\), got -0.1"),
        ({"over_arch_dropout": "0.2"}, r"model.over_arch_dropout must be a number in \[0, 1\), got '0.2'"),
        ({"over_arch_dropout": True}, r"model.over_arch_dropout must be a number in \[0, 1\), got True"),
        ({"dense_arch_dropout": float("nan")}, r"model.dense_arch_dropout must be a number in \[0, 1\)"),
        ({"dense_arch_batch_norm": "yes"}, "model.dense_arch_batch_norm must be true or false, got 'yes'"),
        ({"over_arch_batch_norm": 1}, "model.over_arch_batch_norm must be true or false, got 1"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_values_are_one_line_user_errors(kwargs, match) -> None:
    with pytest.raises(UserInputError, match=match) as caught:
        DLRM(CARDS, **kwargs)
    assert "\n" not in str(caught.value)


def test_config_check_reads_the_new_annotations() -> None:
    node = {"_target_": "recforge.models.dlrm.DLRM", "_partial_": True, "dense_arch_batch_norm": True,
            "over_arch_batch_norm": True, "dense_arch_dropout": 0, "over_arch_dropout": 0.2}
    check_config_values(OmegaConf.create({"model": node}))
    for key, value, match in (
        ("over_arch_dropout", 1.0, r"model.over_arch_dropout=1.0: expected a number >= 0 and < 1"),
        ("dense_arch_dropout", -0.5, r"model.dense_arch_dropout=-0.5: expected a number >= 0 and < 1"),
        ("over_arch_batch_norm", "yes", r"model.over_arch_batch_norm=yes: expected true or false"),
    ):
        with pytest.raises(ConfigValueError, match=match):
            check_config_values(OmegaConf.create({"model": {**node, key: value}}))


# ---------------------------------------------------------------- BARS's training: L2 and LR decay
def _task(embedding_l2: float, sparse_gradients: bool = False):
    from functools import partial

    from recforge.evaluation import CTREvaluation
    from recforge.losses.ctr import BinaryCrossEntropy
    from recforge.tasks.ctr import CTRTask

    torch.manual_seed(0)
    model = partial(DLRM, embedding_dim=4, dense_arch=(8,), over_arch=(7,), sparse_gradients=sparse_gradients)
    return CTRTask(model=model, loss=BinaryCrossEntropy(), optimizer=partial(torch.optim.Adam, lr=1e-3),
                   evaluation=CTREvaluation(), cardinalities=CARDS, embedding_l2=embedding_l2)


def test_embedding_l2_adds_lambda_times_the_table_to_its_gradient() -> None:
    dense, sparse = _batch(32, seed=3)
    labels = (torch.rand(32, generator=torch.Generator().manual_seed(3)) < 0.3).float()
    grads = {}
    for lam in (0.0, 0.25):
        task = _task(lam)
        loss = task.loss(task.model(dense, sparse), labels) + task.regularization()
        loss.backward()
        grads[lam] = {n: p.grad.clone() for n, p in task.model.named_parameters()}
        table = task.model.sparse_arch.embedding.weight.detach()
    for name, g in grads[0.25].items():
        want = grads[0.0][name] + (0.25 * table if name == "sparse_arch.embedding.weight" else 0)
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7, msg=name)
    assert float(_task(0.0).regularization()) == 0.0
    assert float(_task(0.5).regularization().detach()) == pytest.approx(
        0.25 * float(_task(0.0).model.sparse_arch.embedding.weight.detach().pow(2).sum()), rel=1e-6)


def test_embedding_l2_on_sparse_tables_is_refused_in_one_line() -> None:
    with pytest.raises(UserInputError, match=r"task.embedding_l2=1e-05 .* set model.sparse_gradients=false"):
        _task(1e-5, sparse_gradients=True)


def test_lr_decays_at_each_validation_that_does_not_improve_by_min_delta() -> None:
    from types import SimpleNamespace

    from recforge.callbacks.lr_on_plateau import LRDecayOnPlateau

    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=1e-3)
    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={}, optimizers=[optimizer])
    callback = LRDecayOnPlateau("val/auc", factor=0.1, min_lr=1e-6, min_delta=1e-6)
    # FuxiCTR's rule by hand: improve = value >= best + 1e-6, else lr = max(lr * 0.1, 1e-6)
    trace = [(0.70, 1e-3), (0.71, 1e-3), (0.7100005, 1e-4), (0.72, 1e-4), (0.719, 1e-5), (0.719, 1e-6),
             (0.5, 1e-6), (0.73, 1e-6)]
    for value, lr in trace:
        trainer.callback_metrics = {"val/auc": torch.tensor(value)}
        callback.on_validation_end(trainer, None)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-9), value
    assert callback.best == pytest.approx(0.73)
    restored = LRDecayOnPlateau("val/auc")
    restored.load_state_dict(callback.state_dict())
    assert restored.best == callback.best
    loss_watch = LRDecayOnPlateau("val/logloss", mode="min", min_delta=0.01)
    for value, lr in [(0.5, 1e-6), (0.495, 1e-6), (0.48, 1e-6)]:
        trainer.callback_metrics = {"val/logloss": torch.tensor(value)}
        loss_watch.on_validation_end(trainer, None)
    assert loss_watch.best == pytest.approx(0.48)  # 0.495 was not 0.01 better than 0.5
    trainer.sanity_checking = True  # the sanity check's validation counts for nothing
    trainer.callback_metrics = {"val/logloss": torch.tensor(9.0)}
    before = optimizer.param_groups[0]["lr"]
    loss_watch.on_validation_end(trainer, None)
    assert optimizer.param_groups[0]["lr"] == before and loss_watch.best == pytest.approx(0.48)


def test_lr_decay_retraces_the_bars_dlrm_criteo_x1_log() -> None:
    """The validation AUCs of BARS's DLRM_criteo_x1 run (its README's log, FuxiCTR 1.2.1, Adam
    1e-3): the log reduces the learning rate to 1e-4 after epoch 12, 1e-5 after 16 and 1e-6 after
    17, where early stopping (patience 2) ends the run."""
    from types import SimpleNamespace

    from recforge.callbacks.lr_on_plateau import LRDecayOnPlateau

    aucs = [0.804187, 0.806524, 0.807615, 0.807956, 0.808651, 0.808663, 0.809122, 0.809201, 0.809330,
            0.809664, 0.809675, 0.809607, 0.812970, 0.813400, 0.813497, 0.813298, 0.812458]
    logged = {12: 1e-4, 16: 1e-5, 17: 1e-6}
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=1e-3)
    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={}, optimizers=[optimizer])
    callback = LRDecayOnPlateau("val/auc")
    lr = 1e-3
    for epoch, auc in enumerate(aucs, start=1):
        trainer.callback_metrics = {"val/auc": torch.tensor(auc, dtype=torch.float64)}
        callback.on_validation_end(trainer, None)
        lr = logged.get(epoch, lr)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-9), epoch
    assert callback.best == pytest.approx(0.813497)

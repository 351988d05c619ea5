"""DLRM's optimizers: row-wise Adagrad, the dense + sparse optimizer, and the reference's LR policy."""

from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch
from torch import nn

from recforge.errors import UserInputError
from recforge.optim.dense_sparse import DenseSparseOptimizer
from recforge.optim.rowwise_adagrad import RowWiseAdagrad
from recforge.optim.schedules import DLRMLRPolicy, dlrm_lr_scale


# ---------------------------------------------------------------------------- row-wise Adagrad
def _oracle_step(weight, acc, row_grads: dict[int, torch.Tensor], lr, eps, decay, mode) -> None:
    """FBGEMM's row-wise Adagrad one row at a time, one value at a time (float64, in place)."""
    for r, g in row_grads.items():
        w = weight[r].clone()
        width = len(g)
        mean_sq = 0.0
        for d in range(width):
            seen = g[d].item() + (decay * w[d].item() if mode == "l2" else 0.0)
            mean_sq += seen * seen / width
        acc[r] += mean_sq
        multiplier = lr / (math.sqrt(acc[r].item()) + eps)
        correction = {"l2": 1 - multiplier * decay, "decoupled": 1 - lr * decay}[mode]
        for d in range(width):
            weight[r, d] = correction * w[d].item() - multiplier * g[d].item()


def _summed_rows(rows: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for r, v in zip(rows.tolist(), values):
        out[r] = out[r] + v if r in out else v.clone()
    return out


DECAYS = [(0.0, "l2"), (0.05, "l2"), (0.05, "decoupled")]


@pytest.mark.parametrize(("decay", "mode"), DECAYS)
def test_rowwise_sparse_with_duplicates_matches_oracle(decay: float, mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n, width, lr, eps = 12, 5, 0.3, 1e-3
    param = nn.Parameter(torch.randn(n, width, generator=gen, dtype=torch.float64))
    opt = RowWiseAdagrad([param], lr=lr, eps=eps, weight_decay=decay, weight_decay_mode=mode)
    weight, acc = param.detach().clone(), torch.zeros(n, dtype=torch.float64)
    for rows in ([3, 1, 3, 7, 3], [1, 0, 1], [7, 11, 2, 2]):
        rows = torch.tensor(rows)
        values = torch.randn(len(rows), width, generator=gen, dtype=torch.float64)
        param.grad = torch.sparse_coo_tensor(
            rows.unsqueeze(0), values, (n, width), check_invariants=True
        )  # uncoalesced: the duplicates are the optimizer's to sum
        opt.step()
        _oracle_step(weight, acc, _summed_rows(rows, values), lr, eps, decay, mode)
        torch.testing.assert_close(param.detach(), weight, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(opt.state[param]["sum"], acc, rtol=1e-12, atol=1e-14)
    untouched = [r for r in range(n) if r not in (0, 1, 2, 3, 7, 11)]
    assert (opt.state[param]["sum"][untouched] == 0).all()


@pytest.mark.parametrize(("decay", "mode"), DECAYS)
def test_rowwise_dense_updates_every_row(decay: float, mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    n, width, lr, eps = 6, 3, 0.1, 1e-8
    param = nn.Parameter(torch.randn(n, width, generator=gen, dtype=torch.float64))
    opt = RowWiseAdagrad([param], lr=lr, eps=eps, weight_decay=decay, weight_decay_mode=mode)
    weight, acc = param.detach().clone(), torch.zeros(n, dtype=torch.float64)
    for _ in range(3):
        grad = torch.randn(n, width, generator=gen, dtype=torch.float64)
        grad[2] = 0.0  # a row without gradient is still a row of the dense update (decay applies)
        param.grad = grad
        opt.step()
        _oracle_step(weight, acc, dict(enumerate(grad)), lr, eps, decay, mode)
        torch.testing.assert_close(param.detach(), weight, rtol=1e-12, atol=1e-14)
    # L2 decay reaches the accumulator: the zero-gradient row then accumulates too
    assert (opt.state[param]["sum"] > 0).sum() == (n if decay and mode == "l2" else n - 1)


def test_rowwise_on_one_value_rows_is_adagrad() -> None:
    # a vector is rows of one value: the rule is then torch's Adagrad (eps outside the root)
    gen = torch.Generator().manual_seed(2)
    ours = nn.Parameter(torch.randn(9, generator=gen, dtype=torch.float64))
    peer = nn.Parameter(ours.detach().clone())
    opt_ours = RowWiseAdagrad([ours], lr=0.2, eps=1e-6)
    opt_peer = torch.optim.Adagrad([peer], lr=0.2, eps=1e-6)
    for _ in range(4):
        grad = torch.randn(9, generator=gen, dtype=torch.float64)
        ours.grad, peer.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_peer.step()
    torch.testing.assert_close(ours.detach(), peer.detach(), rtol=1e-12, atol=1e-14)


def test_rowwise_embedding_backward_float32() -> None:
    # the real path: nn.Embedding(sparse=True) backward with a repeated id, float32 tables
    gen = torch.Generator().manual_seed(3)
    table = nn.Embedding(8, 4, sparse=True)
    weight = table.weight.detach().double().clone()
    acc = torch.zeros(8, dtype=torch.float64)
    opt = RowWiseAdagrad(table.parameters(), lr=0.05)
    ids = torch.tensor([5, 2, 5])
    target = torch.randn(3, 4, generator=gen)
    (table(ids) - target).pow(2).sum().backward()
    row_grads = {5: 2 * (weight[5] - target[0].double()) + 2 * (weight[5] - target[2].double()),
                 2: 2 * (weight[2] - target[1].double())}
    opt.step()
    _oracle_step(weight, acc, row_grads, 0.05, 1e-8, 0.0, "l2")
    assert opt.state[table.weight]["sum"].dtype == torch.float32
    torch.testing.assert_close(table.weight.detach().double(), weight, rtol=1e-5, atol=1e-6)


def test_rowwise_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="weight_decay_mode"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(2, 2))], weight_decay_mode="adamw")
    with pytest.raises(ValueError, match="lr"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(2, 2))], lr=0.0)
    param = nn.Parameter(torch.zeros(3, 2))
    param.grad = torch.sparse_coo_tensor(
        torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (3, 2), check_invariants=True
    )
    with pytest.raises(ValueError, match="one sparse dimension"):
        RowWiseAdagrad([param]).step()


# ---------------------------------------------------------------------------- dense + sparse
class _Toy(nn.Module):
    """Two sparse tables feeding a small MLP, the shape of DLRM in miniature."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList([nn.Embedding(20, 4, sparse=True), nn.Embedding(10, 4, sparse=True)])
        self.mlp = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], dim=1)
        return self.mlp(x).squeeze(-1)

    def groups(self, sparse_first: bool = False) -> list[dict]:
        dense = {"params": list(self.mlp.parameters())}
        sparse = {"params": list(self.tables.parameters()), "sparse": True}
        return [sparse, dense] if sparse_first else [dense, sparse]


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.stack([torch.randint(0, 20, (16,), generator=gen), torch.randint(0, 10, (16,), generator=gen)], 1)
           for _ in range(n)]
    return [(i, torch.randint(0, 2, (16,), generator=gen).float()) for i in ids]


def _train(model: _Toy, optimizers: list, batches, scheduler=None) -> None:
    for ids, labels in batches:
        for opt in optimizers:
            opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(ids), labels).backward()
        for opt in optimizers:
            opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    ("dense", "sparse"),
    [
        (functools.partial(torch.optim.Adam, lr=1e-2), functools.partial(torch.optim.SGD, lr=0.1)),
        (functools.partial(torch.optim.Adagrad, lr=0.05, eps=1e-8), functools.partial(RowWiseAdagrad, lr=0.05)),
    ],
    ids=["adam+sgd", "adagrad+rowwise"],
)
@pytest.mark.parametrize("sparse_first", [False, True])
def test_joint_equals_the_two_optimizers_by_hand(dense, sparse, sparse_first: bool) -> None:
    joint_model, hand_model = _Toy(), _Toy()
    joint = DenseSparseOptimizer(joint_model.groups(sparse_first), dense=dense, sparse=sparse)
    by_hand = [dense(hand_model.mlp.parameters()), sparse(hand_model.tables.parameters())]
    batches = _batches(6)
    _train(joint_model, [joint], batches)
    _train(hand_model, by_hand, batches)
    _assert_same_params(joint_model, hand_model)
    assert not torch.equal(joint_model.tables[0].weight, _Toy().tables[0].weight)  # it did train
    # param_groups follow the order given and are the children's own dicts
    flags = [g["sparse"] for g in joint.param_groups]
    assert flags == ([True, False] if sparse_first else [False, True])
    for group in joint.param_groups:
        child = joint.optimizers["sparse" if group["sparse"] else "dense"]
        assert any(group is g for g in child.param_groups)


def test_a_scheduler_reaches_both_children() -> None:
    model = _Toy()
    joint = DenseSparseOptimizer(
        model.groups(), dense=functools.partial(torch.optim.Adam, lr=1e-2),
        sparse=functools.partial(RowWiseAdagrad, lr=0.2),
    )
    scheduler = DLRMLRPolicy(joint, warmup_steps=4, decay_start_step=4, decay_steps=10)
    assert joint.optimizers["dense"].param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    assert joint.optimizers["sparse"].param_groups[0]["lr"] == pytest.approx(0.2 / 4)
    _train(model, [joint], _batches(6), scheduler)  # update 6: s = 7, decay ((4 + 10 - 7) / 10)²
    assert joint.optimizers["dense"].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.49)
    assert joint.optimizers["sparse"].param_groups[0]["lr"] == pytest.approx(0.2 * 0.49)


def test_state_dict_round_trip_resumes_the_same_step() -> None:
    def build(model: _Toy) -> DenseSparseOptimizer:
        return DenseSparseOptimizer(
            model.groups(), dense=functools.partial(torch.optim.Adam, lr=1e-2),
            sparse=functools.partial(RowWiseAdagrad, lr=0.1),
        )

    batches = _batches(5)
    model = _Toy()
    opt = build(model)
    _train(model, [opt], batches[:4])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed_model = _Toy()
    resumed_model.load_state_dict(saved["model"])
    resumed = build(resumed_model)
    resumed.load_state_dict(saved["optimizer"])
    assert len(resumed.state) == len(opt.state) == 6  # 2 tables + 4 MLP tensors
    for group in resumed.param_groups:  # still the children's dicts after the load
        child = resumed.optimizers["sparse" if group["sparse"] else "dense"]
        assert any(group is g for g in child.param_groups)

    _train(model, [opt], batches[4:])
    _train(resumed_model, [resumed], batches[4:])
    _assert_same_params(model, resumed_model)
    # without the state the next step differs: the test can tell
    fresh_model = _Toy()
    fresh_model.load_state_dict(saved["model"])
    _train(fresh_model, [build(fresh_model)], batches[4:])
    assert not torch.equal(fresh_model.mlp[0].weight, model.mlp[0].weight)


def test_joint_state_is_the_childrens() -> None:
    model = _Toy()
    opt = DenseSparseOptimizer(
        model.groups(), dense=functools.partial(torch.optim.Adam, lr=1e-2),
        sparse=functools.partial(RowWiseAdagrad, lr=0.1),
    )
    _train(model, [opt], _batches(1))
    # what Lightning does to move an optimizer's state: rewrite the entries found in .state
    for p, entry in opt.state.items():
        for key in entry:
            if key != "step":
                entry[key] = entry[key] + 1.0
    sums = opt.optimizers["sparse"].state[model.tables[1].weight]["sum"]
    assert (sums >= 1.0).all()
    copied = copy.deepcopy(opt)
    assert len(copied.state) == 6 and set(copied.optimizers) == {"dense", "sparse"}


def test_joint_refuses_bad_groups() -> None:
    model = _Toy()
    dense, sparse = functools.partial(torch.optim.SGD, lr=0.1), functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        DenseSparseOptimizer([*model.groups(), {"params": [model.mlp[0].weight]}], dense=dense, sparse=sparse)
    with pytest.raises(ValueError, match="'sparse' flag"):
        DenseSparseOptimizer([{"params": model.parameters(), "sparse": "yes"}], dense=dense, sparse=sparse)
    opt = DenseSparseOptimizer(model.groups(), dense=dense, sparse=sparse)
    state = opt.state_dict()
    state["param_groups"] = state["param_groups"][::-1]
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(state)


# ---------------------------------------------------------------------------- LR policy
def _lrs(base: float, n: int, **kwargs) -> list[float]:
    """The rate each of ``n`` updates runs with."""
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base)
    scheduler = DLRMLRPolicy(opt, **kwargs)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


# Computed by hand from the reference's rule, update k running at its step s = k + 1.
HAND = [
    # W=4, S=6, D=4: warm-up 1/4, 2/4, 3/4; hold at 3/4 (the last warm-up rate, not 1);
    # decay from s=6: (4/4)², (3/4)², (2/4)², (1/4)²; then frozen at (1/4)²
    (dict(warmup_steps=4, decay_start_step=6, decay_steps=4), 1.0,
     [0.25, 0.5, 0.75, 0.75, 0.75, 1.0, 0.5625, 0.25, 0.0625, 0.0625, 0.0625]),
    # the same at base 1e-6: decayed rates below 1e-7 are floored, warm-up rates are not
    (dict(warmup_steps=4, decay_start_step=6, decay_steps=4), 1e-6,
     [2.5e-7, 5e-7, 7.5e-7, 7.5e-7, 7.5e-7, 1e-6, 5.625e-7, 2.5e-7, 1e-7, 1e-7]),
    # decay from the start: the first update already runs at s=1, one step into the decay
    (dict(warmup_steps=0, decay_start_step=0, decay_steps=3), 1.0, [4 / 9, 1 / 9, 1 / 9, 1 / 9]),
    # warm-up without decay: the base rate afterwards
    (dict(warmup_steps=3), 2.0, [2 / 3, 4 / 3, 2.0, 2.0]),
    # no warm-up, a hold before the decay: the reference fails here (no rate to freeze); base rate
    (dict(warmup_steps=1, decay_start_step=3, decay_steps=2), 1.0, [1.0, 1.0, 1.0, 0.25, 0.25]),
    # all zero (the reference's defaults): constant
    (dict(), 0.1, [0.1, 0.1, 0.1]),
]


@pytest.mark.parametrize(("kwargs", "base", "want"), HAND)
def test_lr_policy_by_hand(kwargs: dict, base: float, want: list[float]) -> None:
    got = _lrs(base, len(want), **kwargs)
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_lr_policy_scales_each_group_from_its_base() -> None:
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 1e-6}], lr=1.0)
    scheduler = DLRMLRPolicy(opt, warmup_steps=2, decay_start_step=2, decay_steps=8)
    for _ in range(9):
        opt.step()
        scheduler.step()
    # update 9: s = 10, the decay's last step: (1/8)² of each base, floored at 1e-7 for b
    assert opt.param_groups[0]["lr"] == pytest.approx(1 / 64, rel=1e-12)
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-7, rel=1e-12)
    assert dlrm_lr_scale(9, 2, 2, 8) == 1 / 64


def test_lr_policy_resumes() -> None:
    kwargs = dict(warmup_steps=3, decay_start_step=5, decay_steps=6)
    want = _lrs(0.5, 12, **kwargs)
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.5)
    scheduler = DLRMLRPolicy(opt, **kwargs)
    for _ in range(7):
        opt.step()
        scheduler.step()
    saved_opt, saved_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(scheduler.state_dict())
    # Lightning's order: build both, then load the optimizer's state, then the scheduler's
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler2 = DLRMLRPolicy(opt2, **kwargs)
    opt2.load_state_dict(saved_opt)
    scheduler2.load_state_dict(saved_sched)
    got = []
    for _ in range(5):
        got.append(opt2.param_groups[0]["lr"])
        opt2.step()
        scheduler2.step()
    assert got == pytest.approx(want[7:], rel=1e-12)


def test_lr_policy_refuses_decay_before_warmup_end() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UserInputError, match="decay must start after the warm-up") as info:
        DLRMLRPolicy(opt, warmup_steps=10, decay_start_step=5, decay_steps=3)
    assert "\n" not in str(info.value)
    DLRMLRPolicy(opt, warmup_steps=10, decay_start_step=0, decay_steps=0)  # unused start: accepted
    with pytest.raises(UserInputError, match="warmup_steps"):
        DLRMLRPolicy(opt, warmup_steps=-1)

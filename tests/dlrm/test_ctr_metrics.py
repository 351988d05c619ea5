"""CTR metrics (exact AUC, logloss, accuracy, calibration) and the CTR evaluation component."""

from __future__ import annotations

import math

import pytest
import torch
from gloo_ranks import run_ranks
from sklearn_peer import sklearn_peer

from recforge.errors import UserInputError
from recforge.evaluation import CTREvaluation
from recforge.metrics import CTRMetrics
from recforge.metrics.ctr import CTR_METRIC_NAMES, binary_auc

ALL = CTR_METRIC_NAMES


def _tied_problem(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits on a coarse grid (a few dozen distinct values: heavy ties) and labels that follow them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-12, 13, (n,), generator=gen).float() / 4
    labels = (torch.rand(n, generator=gen) < torch.sigmoid(logits)).float()
    return logits, labels


# ---------------------------------------------------------------------------- AUC
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_equals_sklearn_with_heavy_ties(seed: int) -> None:
    logits, labels = _tied_problem(5000, seed)
    assert logits.unique().numel() <= 25
    metric = CTRMetrics(metrics=("auc",))
    metric.update(logits, labels)
    got = metric.compute()["auc"]
    assert got.dtype == torch.float64
    want = sklearn_peer("roc_auc", labels=labels.numpy(), scores=logits.numpy())
    assert got.item() == pytest.approx(want, abs=1e-9)
    assert 0.6 < want < 0.95  # informative but imperfect scores


def test_auc_hand_case_with_ties() -> None:
    # positives at 0.3 and 1.0 (tied with a negative); negatives at 0.1, 0.3, 1.0, 2.0
    # pairs (pos, neg): 0.3>0.1 1, 0.3=0.3 ½, 0.3<1 0, 0.3<2 0, 1>0.1 1, 1>0.3 1, 1=1 ½, 1<2 0 -> 4/8
    logits = torch.tensor([0.3, 1.0, 0.1, 0.3, 1.0, 2.0])
    labels = torch.tensor([1, 1, 0, 0, 0, 0])
    assert binary_auc(logits, labels).item() == 0.5
    labels_2 = torch.tensor([1, 0, 0, 0, 1, 1])  # positives 0.3, 1.0, 2.0 against 1.0, 0.1, 0.3
    # 0.3: 1 + ½ ; 1.0: 1 + 1 + ½ ; 2.0: 3  -> 7 / 9
    assert binary_auc(logits, labels_2).item() == pytest.approx(7 / 9, abs=1e-15)


def test_auc_separable_reversed_and_one_class() -> None:
    logits = torch.linspace(-3, 3, 20)
    labels = (logits > 0).float()
    metric = CTRMetrics(metrics=("auc",))
    metric.update(logits, labels)
    assert metric.compute()["auc"].item() == 1.0
    metric.reset()
    metric.update(-logits, labels)
    assert metric.compute()["auc"].item() == 0.0
    for one_class in (torch.zeros(20), torch.ones(20)):
        metric.reset()
        metric.update(logits, one_class)
        assert math.isnan(metric.compute()["auc"].item())


def test_auc_sorts_logits_not_saturated_probabilities() -> None:
    # in float32 these logits all have sigmoid == 1.0: ranking by probability would tie them all
    logits = torch.tensor([18.0, 20.0, 25.0, 30.0])
    assert torch.sigmoid(logits).unique().numel() == 1
    metric = CTRMetrics(metrics=("auc",))
    metric.update(logits, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert metric.compute()["auc"].item() == 1.0


def test_accumulated_over_updates_equals_one_update() -> None:
    logits, labels = _tied_problem(3001, seed=5)
    whole, parts = CTRMetrics(metrics=ALL), CTRMetrics(metrics=ALL)
    whole.update(logits, labels)
    for lo, hi in ((0, 1), (1, 1000), (1000, 1000), (1000, 3001)):  # sizes 1, 999, 0, 2001
        parts.update(logits[lo:hi], labels[lo:hi])
    want, got = whole.compute(), parts.compute()
    for name in ALL:
        assert got[name].item() == pytest.approx(want[name].item(), rel=1e-12), name
    want_auc = sklearn_peer("roc_auc", labels=labels.numpy(), scores=logits.numpy())
    assert got["auc"].item() == pytest.approx(want_auc, abs=1e-9)


# ---------------------------------------------------------------------------- the sums
def test_logloss_equals_sklearn() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4000, generator=gen, dtype=torch.float64) * 2  # probabilities well inside (0, 1)
    labels = (torch.rand(4000, generator=gen, dtype=torch.float64) < torch.sigmoid(logits)).double()
    metric = CTRMetrics(metrics=("logloss",))
    metric.update(logits, labels)
    want = sklearn_peer("log_loss", labels=labels.numpy(), probabilities=torch.sigmoid(logits).numpy())
    assert metric.compute()["logloss"].item() == pytest.approx(want, rel=1e-10)


def test_logloss_is_finite_for_extreme_logits() -> None:
    # a confident wrong prediction costs |logit|, it does not overflow or hit log(0)
    metric = CTRMetrics(metrics=("logloss",))
    metric.update(torch.tensor([200.0, -200.0]), torch.tensor([0.0, 1.0]))
    assert metric.compute()["logloss"].item() == pytest.approx(200.0, rel=1e-12)


def test_accuracy_calibration_by_hand() -> None:
    # probabilities sigmoid(logit): 0.5 exactly (predicted click), 0.8808, 0.1192, 0.7311, 0.2689
    logits = torch.tensor([0.0, 2.0, -2.0, 1.0, -1.0])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    metric = CTRMetrics(metrics=ALL)
    metric.update(logits, labels)
    out = metric.compute()
    # predicted 1, 1, 0, 1, 0 against 1, 1, 1, 0, 0 -> rows 0, 1, 4 right
    assert out["accuracy"].item() == pytest.approx(3 / 5, abs=1e-15)
    probs = torch.sigmoid(logits.double())
    assert out["calibration"].item() == pytest.approx((probs.sum() / 3).item(), rel=1e-12)
    assert out["positive_rate"].item() == pytest.approx(3 / 5, abs=1e-15)
    assert out["count"].item() == 5
    # a label of 0 at exactly 0.5 is a miss: the threshold is inclusive
    metric.reset()
    metric.update(torch.tensor([0.0]), torch.tensor([0.0]))
    assert metric.compute()["accuracy"].item() == 0.0


def test_accuracy_is_not_the_positive_rate() -> None:
    # the lecture script applied sigmoid to probabilities, so every row was predicted a click and
    # "accuracy" was the positive rate; here confident negatives count as right
    logits = torch.tensor([-3.0, -2.0, -4.0, 3.0])
    labels = torch.tensor([0.0, 0.0, 0.0, 1.0])
    metric = CTRMetrics(metrics=("accuracy", "positive_rate"))
    metric.update(logits, labels)
    out = metric.compute()
    assert out["accuracy"].item() == 1.0
    assert out["positive_rate"].item() == 0.25


def test_threshold() -> None:
    metric = CTRMetrics(metrics=("accuracy",), threshold=0.9)
    metric.update(torch.tensor([2.0, 3.0]), torch.tensor([1.0, 1.0]))  # p = 0.881, 0.953
    assert metric.compute()["accuracy"].item() == 0.5


def test_empty_split_and_no_positive() -> None:
    metric = CTRMetrics(metrics=ALL)
    with pytest.warns(UserWarning, match="compute"):  # torchmetrics: compute before update
        out = metric.compute()
    for name in ("auc", "logloss", "accuracy", "calibration", "positive_rate"):
        assert math.isnan(out[name].item()), name
    assert out["count"].item() == 0
    metric.update(torch.tensor([0.5, -0.5]), torch.tensor([0.0, 0.0]))
    out = metric.compute()
    assert math.isnan(out["calibration"].item()) and math.isnan(out["auc"].item())
    assert out["accuracy"].item() == 0.5


def test_rows_are_kept_only_for_auc() -> None:
    assert CTRMetrics(metrics=("logloss", "accuracy")).keeps_rows is False
    metric = CTRMetrics(metrics=("auc",))
    metric.update(torch.randn(7, dtype=torch.float64), torch.ones(7))
    assert metric.logits[0].dtype == torch.float32 and metric.labels[0].dtype == torch.uint8


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="allowed values"):
        CTRMetrics(metrics=("auc", "ndcg"))
    with pytest.raises(ValueError, match="threshold"):
        CTRMetrics(threshold=1.0)
    with pytest.raises(ValueError, match=r"1-D \[B\]"):
        CTRMetrics().update(torch.zeros(4, 1), torch.zeros(4))


# ---------------------------------------------------------------------------- DDP
def _merged(a: CTRMetrics, b: CTRMetrics) -> dict[str, torch.Tensor]:
    a.merge_state(b)
    return a.compute()


def test_merging_two_shards_equals_one_metric() -> None:
    logits, labels = _tied_problem(2501, seed=7)
    whole = CTRMetrics(metrics=ALL)
    whole.update(logits, labels)
    want = whole.compute()
    a, b = CTRMetrics(metrics=ALL), CTRMetrics(metrics=ALL)
    a.update(logits[:400], labels[:400])  # unequal shards: a mean of shard AUCs would differ
    b.update(logits[400:1500], labels[400:1500])
    b.update(logits[1500:], labels[1500:])
    got = _merged(a, b)
    for name in ALL:
        assert got[name].item() == pytest.approx(want[name].item(), rel=1e-12), name
    shard_mean = (binary_auc(logits[:400], labels[:400]) + binary_auc(logits[400:], labels[400:])) / 2
    assert abs(shard_mean.item() - want["auc"].item()) > 1e-4  # the test can tell the two apart


def _worker(rank: int) -> dict:
    logits, labels = _tied_problem(2501, seed=7)
    uneven = CTRMetrics(metrics=ALL)
    lo, hi = ((0, 400), (400, 2501))[rank]
    uneven.update(logits[lo:hi], labels[lo:hi])
    one_sided = CTRMetrics(metrics=ALL)  # rank 1 sees no rows at all
    if rank == 0:
        one_sided.update(logits, labels)
    return {
        "uneven": {k: v.item() for k, v in uneven.compute().items()},
        "one_sided": {k: v.item() for k, v in one_sided.compute().items()},
    }


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_metric() -> None:
    results = run_ranks(_worker)
    logits, labels = _tied_problem(2501, seed=7)
    whole = CTRMetrics(metrics=ALL)
    whole.update(logits, labels)
    want = {k: v.item() for k, v in whole.compute().items()}
    for rank in (0, 1):
        for case in ("uneven", "one_sided"):
            for name in ALL:
                assert results[rank][case][name] == pytest.approx(want[name], rel=1e-12), (rank, case, name)


# ---------------------------------------------------------------------------- evaluation component
def test_evaluation_logs_each_split_and_resets() -> None:
    evaluation = CTREvaluation()
    assert evaluation.kind == "ctr"
    assert evaluation.logged_names() == [
        f"{split}/{name}" for split in ("val", "test") for name in ("auc", "logloss", "accuracy", "calibration")
    ]
    logits, labels = _tied_problem(600, seed=11)
    evaluation.update("val", logits, labels)
    evaluation.update("test", -logits, labels)
    val = evaluation.compute_and_reset("val")
    assert set(val) == {"val/auc", "val/logloss", "val/accuracy", "val/calibration"}
    want_auc = sklearn_peer("roc_auc", labels=labels.numpy(), scores=logits.numpy())
    assert val["val/auc"].item() == pytest.approx(want_auc, abs=1e-6)
    test = evaluation.compute_and_reset("test")
    assert test["test/auc"].item() == pytest.approx(1 - val["val/auc"].item(), abs=1e-6)
    evaluation.update("val", logits[:10], labels[:10])  # the val metric restarted from zero
    assert evaluation.splits["val"].n_rows.item() == 10


@pytest.mark.parametrize(("monitor", "mode"), [("val/auc", "max"), ("val/logloss", "min"),
                                               ("test/accuracy", "max")])
def test_checkpoints_follow_each_monitor_the_right_way(monitor: str, mode: str) -> None:
    # checkpointing and early stopping take their mode from the config resolver; it must agree
    # with the metrics' own table for every metric a CTR evaluation accepts as a monitor
    from recforge.metrics.ctr import CTR_METRIC_MODES
    from recforge.utils.resolvers import metric_mode

    assert CTREvaluation(monitor=monitor).monitor == monitor
    assert metric_mode(monitor) == CTR_METRIC_MODES[monitor.split("/")[1]] == mode
    followable = [name for name, direction in CTR_METRIC_MODES.items() if direction is not None]
    assert all(metric_mode(f"val/{name}") == CTR_METRIC_MODES[name] for name in followable)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"monitor": "val/ndcg@10"}, "evaluation.monitor=val/ndcg@10: not a metric this evaluation logs"),
        ({"metrics": ("logloss",)}, "evaluation.monitor=val/auc: not a metric"),  # the default monitor
        ({"monitor": "val/calibration"}, "no better direction"),
        ({"metrics": ("auc", "gauc")}, "evaluation: unknown metric name"),
        ({"threshold": 0.0}, "evaluation: threshold"),
    ],
)
def test_evaluation_errors_are_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(UserInputError, match=match) as info:
        CTREvaluation(**kwargs)
    assert "\n" not in str(info.value)

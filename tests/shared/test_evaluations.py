"""Every evaluation on one base: the contract, the split bookkeeping, the monitor, the config names."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from recforge.config_checks import RENAMED_OPTIONS, warn_renamed_options
from recforge.contracts import Evaluation
from recforge.errors import UserInputError
from recforge.evaluation import CTREvaluation, FullRanking
from recforge.evaluation.base import SPLITS
from recforge.tasks.ctr import CTRTask
from recforge.tasks.sequential_retrieval import SequentialRetrievalTask
from recforge.tasks.session_next_item import SessionNextItemTask

CONF = Path(__file__).resolve().parents[2] / "conf"
EVALUATION_OPTIONS = sorted(
    p.stem for p in (CONF / "evaluation").glob("*.yaml") if "_target_" in (yaml.safe_load(p.read_text()) or {})
)


@pytest.mark.parametrize("option", EVALUATION_OPTIONS)
def test_every_evaluation_config_builds_an_evaluation_some_task_feeds(option: str) -> None:
    node = OmegaConf.load(CONF / "evaluation" / f"{option}.yaml")
    evaluation = instantiate(node)
    assert isinstance(evaluation, Evaluation)
    assert evaluation.kind in {t.evaluation_kind for t in (SessionNextItemTask, SequentialRetrievalTask, CTRTask)}
    names = evaluation.logged_names()
    per_split = [sorted(n.split("/", 1)[1] for n in names if n.startswith(f"{s}/")) for s in SPLITS]
    assert per_split[0] and all(p == per_split[0] for p in per_split), names
    assert evaluation.monitor in names


def test_the_config_names_say_which_task_each_evaluation_serves() -> None:
    # the option is named after the task config it serves, and that task feeds its kind
    for option, task in (("session_next_item", SessionNextItemTask),
                         ("sequential_retrieval", SequentialRetrievalTask), ("ctr", CTRTask)):
        assert option in EVALUATION_OPTIONS
        assert (CONF / "task" / f"{option}.yaml").is_file()
        target = yaml.safe_load((CONF / "evaluation" / f"{option}.yaml").read_text())["_target_"]
        assert get_class(target).kind == task.evaluation_kind


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")
def test_full_ranking_computes_hand_ranked_metrics_then_resets() -> None:
    # Two queries over 4 items (dot scores): query 0 ranks its target 2nd, query 1 ranks it 1st.
    evaluation = FullRanking(ks=(1, 2), metrics=("recall", "mrr"), monitor="val/mrr@2")
    items = torch.eye(4)
    queries = torch.tensor([[0.9, 0.5, 0.0, 0.1], [0.0, 0.0, 0.0, 1.0]])
    evaluation.update("val", queries, items, None, torch.tensor([1, 3]))
    values = {k: float(v) for k, v in evaluation.compute_and_reset("val").items()}
    assert values == pytest.approx({"val/recall@1": 0.5, "val/recall@2": 1.0, "val/mrr@1": 0.5, "val/mrr@2": 0.75})
    # the test split is untouched, and the val state is cleared: nothing ranked gives zeros
    assert all(float(v) == 0 for v in evaluation.compute_and_reset("val").values())
    assert all(float(v) == 0 for v in evaluation.compute_and_reset("test").values())


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")
def test_a_rank_cap_truncates_the_uncut_mrr_only() -> None:
    # Three queries over 6 items ranking their targets 1st, 3rd and 5th. With max_rank=3 the 5th
    # is kept as 4: the cut-offs up to 3 are those of the exact ranks, the uncut MRR takes 1/4
    # where the exact one takes 1/5 (the reference's top-list protocol).
    items = torch.eye(6)
    queries = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                            [0.9, 0.8, 0.7, 0.0, 0.0, 0.0],
                            [0.9, 0.8, 0.7, 0.6, 0.5, 0.0]])
    targets = torch.tensor([5, 2, 4])
    values = {}
    for cap in (None, 3):
        evaluation = FullRanking(ks=(1, 3), metrics=("recall", "mrr"), full_mrr=True, max_rank=cap,
                                 monitor="val/mrr@3")
        evaluation.update("val", queries, items, None, targets)
        values[cap] = {k: float(v) for k, v in evaluation.compute_and_reset("val").items()}
    assert values[None] == pytest.approx({"val/recall@1": 1 / 3, "val/recall@3": 2 / 3, "val/mrr@1": 1 / 3,
                                          "val/mrr@3": (1 + 1 / 3) / 3, "val/mrr": (1 + 1 / 3 + 1 / 5) / 3})
    assert values[3] == pytest.approx({**values[None], "val/mrr": (1 + 1 / 3 + 1 / 4) / 3})


def test_a_cut_off_past_the_rank_cap_is_refused_in_one_line() -> None:
    # a rank past the cap is kept as max_rank + 1, which a larger cut-off would count as a hit
    with pytest.raises(UserInputError) as error:
        FullRanking(ks=(1, 5, 20), max_rank=5, monitor="val/mrr@20")
    assert str(error.value) == ("evaluation.max_rank=5 is below the largest cut-off in evaluation.ks (20): "
                                "ranks past max_rank are not known, so set max_rank >= 20 or null")
    FullRanking(ks=(1, 5, 20), max_rank=20, monitor="val/mrr@20")  # every cut-off within the cap


def test_ctr_evaluation_computes_hand_counted_metrics_then_resets() -> None:
    evaluation = CTREvaluation(metrics=("auc", "accuracy"), monitor="val/auc")
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    evaluation.update("test", logits, labels)
    values = {k: float(v) for k, v in evaluation.compute_and_reset("test").items()}
    # positives score 2.0 and -3.0, negatives -1.0 and 0.5: 2 of the 4 pairs ordered right
    assert values == pytest.approx({"test/auc": 0.5, "test/accuracy": 0.5})
    assert evaluation.logged_names() == ["val/auc", "val/accuracy", "test/auc", "test/accuracy"]


@pytest.mark.parametrize("make", [lambda m: FullRanking(monitor=m), lambda m: CTREvaluation(monitor=m)])
def test_a_monitor_that_is_not_logged_is_refused_in_one_line_by_every_evaluation(make) -> None:
    with pytest.raises(UserInputError, match=r"^evaluation.monitor=val/nope: not a metric this evaluation logs; "
                                               r"it logs val/") as error:
        make("val/nope")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("old", "new"), [(o, n) for (g, o), n in RENAMED_OPTIONS.items() if g == "evaluation"])
def test_old_evaluation_names_compose_the_same_config_and_warn_once(old: str, new: str, make_cfg) -> None:
    cfg_old, cfg_new = make_cfg(f"evaluation={old}"), make_cfg(f"evaluation={new}")
    assert OmegaConf.to_container(cfg_old.evaluation) == OmegaConf.to_container(cfg_new.evaluation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_renamed_options({"evaluation": old, "model": "gru4rec"})
        warn_renamed_options({"evaluation": new})
    assert [str(w.message) for w in caught] == [
        f"evaluation={old} is deprecated and will be removed in the next release: use evaluation={new}"
    ]


def test_target_ranks_under_autocast_are_counted_in_the_inputs_precision() -> None:
    # Lightning's bf16-mixed evaluates under autocast: the scores must still be float32 ones
    # (bf16 scores tie and reorder items the float32 ones do not)
    from recforge.kernels.target_rank import target_rank_counts

    g = torch.Generator().manual_seed(0)
    queries, weights = torch.randn(64, 32, generator=g), torch.randn(5000, 32, generator=g)
    bias, targets = torch.randn(5000, generator=g), torch.randint(0, 5000, (64,), generator=g)
    want = target_rank_counts(queries, weights, bias, targets, chunk_size=1024)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = target_rank_counts(queries, weights, bias, targets, chunk_size=1024)
        in_bf16 = target_rank_counts(queries.bfloat16(), weights, bias, targets, chunk_size=1024)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(in_bf16, target_rank_counts(
        queries.bfloat16(), weights, bias, targets, chunk_size=1024)))

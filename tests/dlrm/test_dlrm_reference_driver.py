"""benchmarks/dlrm_reference.py: recforge's rows in the reference's layout, the reference model built
with the Kaggle run's architecture, and one alternation of both arms end to end (the reference played
by a stand-in tree: the real code is not shipped)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import benchmark_module

# a stand-in for dlrm_s_pytorch.py: records how DLRM_Net was built, and is a working (tiny) model
STAND_IN = '''
import json
import os
import torch
import torch.nn as nn


class DLRM_Net(nn.Module):
    def __init__(self, m_spa, ln_emb, ln_bot, ln_top, arch_interaction_op, arch_interaction_itself,
                 sigmoid_bot, sigmoid_top, loss_threshold, ndevices, loss_function):
        super().__init__()
        json.dump({"m_spa": int(m_spa), "ln_emb": [int(n) for n in ln_emb], "ln_bot": [int(n) for n in ln_bot],
                   "ln_top": [int(n) for n in ln_top], "op": arch_interaction_op, "itself": arch_interaction_itself,
                   "sigmoid_top": sigmoid_top, "loss": loss_function}, open(os.environ["STAND_IN_RECORD"], "w"))
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(int(n), int(m_spa), mode="sum", sparse=True) for n in ln_emb)
        self.top = nn.Linear(int(ln_bot[0]) + len(ln_emb) * int(m_spa), 1)
        self.loss_fn = nn.BCELoss(reduction="mean")

    def forward(self, dense_x, lS_o, lS_i):
        pooled = [bag(i, o) for bag, i, o in zip(self.emb_l, lS_i, lS_o)]
        return torch.sigmoid(self.top(torch.cat([dense_x, *pooled], dim=1)))
'''


@pytest.fixture(scope="module")
def driver():
    with benchmark_module("dlrm_reference") as module:
        yield module


def test_the_reference_layout_looks_up_the_same_rows_as_recforge_batches(driver):
    gen = torch.Generator().manual_seed(0)
    sparse = torch.randint(0, 50, (7, 26), generator=gen)
    dense, labels = torch.rand(7, 13, generator=gen), (torch.rand(7, generator=gen) > 0.5).float()
    X, offsets, indices, T = driver.reference_layout(dense, sparse, labels)
    assert torch.equal(X, dense) and T.shape == (7, 1) and torch.equal(T[:, 0], labels)
    assert offsets.shape == (26, 7) and len(indices) == 26
    table = torch.randn(50, 4, generator=gen)
    for f in range(26):  # each bag is one id: the sum-pooled bag is that id's row
        pooled = torch.nn.functional.embedding_bag(indices[f], table, offsets[f], mode="sum")
        assert torch.equal(pooled, table[sparse[:, f]])


def test_a_tree_without_the_reference_script_is_refused_naming_it(driver, tmp_path, capsys):
    with pytest.raises(SystemExit):
        driver.parse_args(["--reference-dir", str(tmp_path)])
    assert f"{tmp_path} holds no dlrm_s_pytorch.py" in capsys.readouterr().err


def test_keep_malloc_reaches_both_arms_and_default_clears_it(driver, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    assert not set(driver.KEEP_MALLOC) & set(driver._env(1, "default"))
    keep = driver._env(2, "keep")
    # recforge's own policy in environment form: the same settings the recforge arm would set itself
    assert keep["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30) and keep["MALLOC_TRIM_THRESHOLD_"] == str(2**31 - 1)
    assert keep["OMP_NUM_THREADS"] == "2"


def _run_tiny(driver, tmp_path, monkeypatch, cards: list[int], *extra: str):
    """``driver.main`` against the stand-in tree on a tiny synthetic Kaggle shape (26 tables of
    ``cards`` rows, batch 32, windows of 3 steps, 1 thread); the path of its runs JSON."""
    tree = tmp_path / "dlrm"
    tree.mkdir()
    (tree / "dlrm_s_pytorch.py").write_text(STAND_IN)
    monkeypatch.setenv("STAND_IN_RECORD", str(tmp_path / "built.json"))  # the child inherits it
    overrides = ["data=synthetic_criteo", "data.generator.n_rows=3000",
                 f"++data.generator.cardinalities=[{','.join(map(str, cards))}]"]
    out = tmp_path / "runs.json"
    argv = ["--reference-dir", str(tree), "--threads", "1", "--rounds", "1", "--steps", "3", "--lead", "1",
            "--warmup", "1", "--batches", "4", "--batch-size", "32", "--data-dir", str(tmp_path / "d"),
            "--json", str(out), *extra]
    assert driver.main(argv + [a for o in overrides for a in ("--override", o)]) == 0
    return out


@pytest.mark.slow
def test_one_alternation_runs_both_arms_on_the_same_rows(driver, tmp_path, monkeypatch, capsys):
    cards = [3 + f for f in range(26)]
    out = _run_tiny(driver, tmp_path, monkeypatch, cards, "--windows", "2")
    runs = json.loads(out.read_text())["runs"]
    assert [(r["arm"], r["threads"]) for r in runs] == [("reference", 1), ("recforge", 1)]
    assert all(len(r["all"]) == 2 and r["min"] > 0 for r in runs)
    built = json.loads((tmp_path / "built.json").read_text())
    # the Kaggle run's architecture over the data's own table sizes: 27 vectors of 16 -> 351 + 16 = 367
    assert built == {"m_spa": 16, "ln_emb": cards, "ln_bot": [13, 512, 256, 64, 16], "ln_top": [367, 512, 256, 1],
                     "op": "dot", "itself": False, "sigmoid_top": 2, "loss": "bce"}
    assert "| 1 | 0 |" in capsys.readouterr().out


@pytest.mark.slow
def test_in_process_windows_pair_the_arms_and_time_the_mlps_alone(driver, tmp_path, monkeypatch, capsys):
    out = _run_tiny(driver, tmp_path, monkeypatch, [3 + f for f in range(26)], "--windows", "3", "--in-process",
                    "--floor")
    (run,) = json.loads(out.read_text())["runs"]
    assert run["threads"] == 1 and all(len(run[arm]) == 3 for arm in ("reference", "recforge", "mlps"))
    # one ratio per window pair, recforge over the reference of the same window
    assert run["pair_ratios"] == pytest.approx([m / r for m, r in zip(run["recforge"], run["reference"])])
    assert min(run["reference"] + run["recforge"] + run["mlps"]) > 0
    printed = capsys.readouterr().out
    assert "| 1 | 0 |" in printed and "reference / MLPs alone" in printed


def test_the_mlps_window_leaves_the_model_untouched_and_counts_its_rows(driver):
    from recforge.models.dlrm import DLRM

    model = DLRM(cardinalities=[5, 7], n_dense=3, embedding_dim=4, dense_arch=[8], over_arch=[6])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows, seconds = driver.mlps_window(model, batch=9)(1, 2)
    assert rows == 18 and seconds > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())

"""benchmarks/gru4rec_reference.py: the official tree's compatibility edits, and one rotation of
arms end to end (the official arm played by a stand-in tree: the real code is not shipped)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import benchmark_module


@pytest.fixture(scope="module")
def driver():
    with benchmark_module("gru4rec_reference") as module:
        yield module


def _official_tree(root, driver, recall="0.5", mrr="0.25"):
    """A stand-in for the official tree: the two lines the edits target, and a run.py that
    records its arguments and prints the official code's result line."""
    root.mkdir()
    (root / "gru4rec_pytorch.py").write_text("\n".join(old for _, old, _ in driver.COMPAT_EDITS) + "\n")
    (root / "run.py").write_text(
        "import json, sys, torch\n"
        "json.dump({'argv': sys.argv, 'threads': torch.get_num_threads()}, open('argv.json', 'w'))\n"
        f"print('Recall@20: {recall} MRR@20: {mrr}')\n"
    )
    return root


def test_compatibility_edits_apply_once_and_leave_the_source_alone(driver, tmp_path):
    source = _official_tree(tmp_path / "official", driver)
    before = (source / "gru4rec_pytorch.py").read_text()
    copy = driver.prepare_official(source, tmp_path / "copy")
    text = (copy / "gru4rec_pytorch.py").read_text()
    for _, old, new in driver.COMPAT_EDITS:
        assert new in text and old not in text.replace(new, "")
    assert (source / "gru4rec_pytorch.py").read_text() == before


def test_another_version_of_the_official_code_is_refused_naming_the_file(driver, tmp_path):
    source = _official_tree(tmp_path / "official", driver)
    (source / "gru4rec_pytorch.py").write_text("sigma = 1.0\n")
    with pytest.raises(SystemExit, match=r"gru4rec_pytorch\.py: expected one occurrence"):
        driver.prepare_official(source, tmp_path / "copy")


def _sessions(path, sessions, items, seed):
    rng = np.random.default_rng(seed)
    lines = ["SessionId\tItemId\tTime"]
    t = 1_000_000
    for s in range(sessions):
        for _ in range(rng.integers(2, 6)):
            t += 1
            lines.append(f"{s}\t{rng.integers(1, items + 1)}\t{t}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_rotation_runs_every_arm_and_reports_its_metrics(driver, tmp_path, capsys):
    train = _sessions(tmp_path / "train.txt", 200, 30, 0)
    test = _sessions(tmp_path / "test.txt", 40, 30, 1)
    official = _official_tree(tmp_path / "official", driver, recall="0.4321", mrr="0.1234")
    out = tmp_path / "runs.json"
    rc = driver.main(["--official-dir", str(official), "--train", str(train), "--test", str(test),
                      "--configs", "xe", "--arms", "official,fast", "--seeds", "3", "--epochs", "1",
                      "--threads", "1", "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    assert rc == 0
    runs = {r["arm"]: r for r in json.loads(out.read_text())["runs"]}
    assert (runs["official"]["recall@20"], runs["official"]["mrr@20"]) == (0.4321, 0.1234)
    # each run's CPU seconds are its own process's: training an epoch costs more than the stand-in
    assert 0 < runs["official"]["cpu_s"] < runs["fast"]["cpu_s"]
    called = json.loads((tmp_path / "work" / "official" / "argv.json").read_text())
    assert called["argv"][1:4] == [str(train), "-ps", driver.OFFICIAL_PARAMS["xe"].format(epochs=1)]
    assert called["threads"] == 1
    # the recforge arm trained one epoch of the fast step and tested: its own metrics.json
    metrics = json.loads((tmp_path / "work" / "xe-3-fast" / "metrics.json").read_text())
    assert metrics["epochs"] == 1 and runs["fast"]["recall@20"] == metrics["test/recall@20"]
    config = (tmp_path / "work" / "xe-3-fast" / ".hydra" / "config.yaml").read_text()
    assert "fast_step: true" in config and "seed: 3" in config
    table = capsys.readouterr().out
    assert "| xe | fast |" in table and "| xe | official |" in table
    fast_row = next(line for line in table.splitlines() if line.startswith("| xe | fast |"))
    cells = [c.strip() for c in fast_row.strip("|").split("|")]
    wall_ratio = runs["official"]["wall_s"] / runs["fast"]["wall_s"]
    assert cells[4] == f"{wall_ratio:.2f}x" and cells[5] == f"{wall_ratio:.2f} ({wall_ratio:.2f}x)"
    assert cells[7] == f"{runs['official']['cpu_s'] / runs['fast']['cpu_s']:.2f}x"

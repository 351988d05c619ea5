"""The README's figures (issue 20 §2): benchmarks/readme_figures.py and the analysis helpers it
draws with, checked against values worked out by hand from the inputs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import yaml
from conftest import REPO_ROOT, run_command

from recforge.analysis import load_reference_runs, plot_against_reference

matplotlib.use("Agg")

RUNS = {
    "threads": 2, "malloc": "keep", "epochs": 10,
    "runs": [
        {"config": "xe", "seed": s, "arm": arm, "wall_s": wall, "recall@20": r, "mrr@20": m}
        for s, arm, wall, r, m in [
            (0, "official", 80.0, 0.60, 0.30), (1, "official", 60.0, 0.62, 0.32), (2, "official", 70.0, 0.64, 0.31),
            (0, "fast", 40.0, 0.61, 0.30), (1, "fast", 50.0, 0.63, 0.31), (2, "fast", 35.0, 0.65, 0.33),
        ]
    ] + [
        {"config": "bprmax", "seed": 0, "arm": "official", "wall_s": 90.0, "recall@20": 0.5, "mrr@20": 0.25},
        {"config": "bprmax", "seed": 0, "arm": "fast", "wall_s": 60.0, "recall@20": 0.52, "mrr@20": 0.24},
    ],
}


def _write_runs(path: Path, record=RUNS) -> Path:
    path.write_text(json.dumps(record))
    return path


def test_reference_runs_are_read_with_their_settings(tmp_path: Path):
    runs = load_reference_runs(_write_runs(tmp_path / "r.json"))
    assert len(runs) == 8 and set(runs["arm"]) == {"official", "fast"}
    assert runs.attrs == {"threads": 2, "malloc": "keep", "epochs": 10}


@pytest.mark.parametrize("content, message", [
    (None, "reference runs not found"),
    ({"runs": []}, "non-empty 'runs' list"),
    ({"runs": [{"config": "xe", "arm": "fast"}]}, r"runs lack \['wall_s'\]"),
])
def test_bad_reference_runs_are_named(tmp_path: Path, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        _write_runs(path, content)
    with pytest.raises((FileNotFoundError, ValueError), match=message) as error:
        load_reference_runs(path)
    assert str(path) in str(error.value)


def test_bars_are_the_medians_and_means_and_the_label_is_the_ratio(tmp_path: Path):
    runs = load_reference_runs(_write_runs(tmp_path / "r.json"))
    fig = plot_against_reference(runs, ["recall@20", "mrr@20"])
    wall, recall, mrr = fig.axes
    # bars are drawn arm by arm (official, then fast), config by config (xe, bprmax)
    heights = [round(p.get_height(), 6) for p in wall.patches]
    assert heights == [70.0, 90.0, 40.0, 60.0]  # medians of 80/60/70, 90; 40/50/35, 60
    assert [round(p.get_height(), 6) for p in recall.patches] == [0.62, 0.5, 0.63, 0.52]  # means
    assert [round(p.get_height(), 6) for p in mrr.patches] == [0.31, 0.25, 0.313333, 0.24]
    ratios = [t.get_text() for t in wall.texts]
    assert ratios == ["1.75x", "1.50x"]  # 70 / 40, 90 / 60
    assert "threads 2, malloc keep, epochs 10" in fig._suptitle.get_text()


# Lightning's CSVLogger layout for two epochs of one job: validation row, training-epoch row
def _job(sweep: Path, name: str, model: str, hr: list[float]) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"model={model}"]))
    (job / "csv").mkdir()
    rows = ["epoch,step,train/loss_epoch,val/hr@10,val/ndcg@10"]
    for epoch, value in enumerate(hr):
        rows += [f"{epoch},{epoch * 10 + 9},,{value},{value / 2}", f"{epoch},{epoch * 10 + 9},{3 - epoch},,"]
    (job / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_the_script_draws_both_figures_from_a_sweep_and_a_runs_file(tmp_path: Path):
    sweep = tmp_path / "sweep"
    _job(sweep, "0", "hstu", [0.5, 0.6])
    _job(sweep, "1", "sasrec", [0.4, 0.55])
    out = tmp_path / "figures"
    done = run_command(f"python benchmarks/readme_figures.py --sweep {sweep} --out {out} "
                       f"--gru4rec-runs {_write_runs(tmp_path / 'r.json')}", cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("learning_curves.png", "gru4rec_vs_official.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not list(out.glob(".*.partial"))


def test_only_the_bar_chart_is_redrawn_without_a_sweep(tmp_path: Path):
    out = tmp_path / "figures"
    done = run_command(f"python benchmarks/readme_figures.py --only gru4rec --out {out} "
                       f"--gru4rec-runs {_write_runs(tmp_path / 'r.json')}", cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gru4rec_vs_official.png"]  # no sweep ran, no curves
    refused = run_command(f"python benchmarks/readme_figures.py --only gru4rec --sweep {tmp_path} --out {out}",
                          cwd=REPO_ROOT)
    assert refused.returncode == 2 and "--sweep feeds the learning curves" in refused.stderr


def test_the_script_names_a_sweep_without_the_curves(tmp_path: Path):
    sweep = tmp_path / "sweep"
    _job(sweep, "0", "hstu", [0.5])
    frame = pd.read_csv(sweep / "0" / "csv" / "metrics.csv").drop(columns=["val/ndcg@10"])
    frame.to_csv(sweep / "0" / "csv" / "metrics.csv", index=False)
    done = run_command(f"python benchmarks/readme_figures.py --sweep {sweep} --out {tmp_path / 'f'} "
                       f"--gru4rec-runs {_write_runs(tmp_path / 'r.json')}", cwd=REPO_ROOT)
    assert done.returncode != 0 and "val/ndcg@10" in done.stderr
    assert not (tmp_path / "f").exists()


def test_the_readme_shows_the_committed_figures_and_says_how_to_remake_them():
    readme = (REPO_ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert {"notebooks/figures/learning_curves.png", "notebooks/figures/gru4rec_vs_official.png"} <= set(images)
    for image in images:
        assert (REPO_ROOT / image).is_file(), image
    assert "python benchmarks/readme_figures.py" in readme
    # the committed runs file is what the bar chart was drawn from
    assert len(load_reference_runs(REPO_ROOT / "benchmarks" / "results" / "gru4rec_reference.json")) >= 4

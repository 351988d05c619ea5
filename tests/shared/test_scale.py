"""benchmarks/scale.py: its size-cost exponent, its memory and time measurement of a child process."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, benchmark_module


@pytest.fixture(scope="module")
def scale():
    with benchmark_module("scale") as module:
        yield module


@pytest.mark.parametrize("power", [0.0, 1.0, 1.5, 2.0])
def test_the_exponent_of_an_exact_power_law_is_its_power(scale, power):
    sizes = [1e6, 2e6, 4e6, 8e6]
    assert scale.fitted_exponent(sizes, [3.0 * s**power for s in sizes]) == pytest.approx(power, abs=1e-12)


def test_the_exponent_is_the_least_squares_slope_of_the_logs(scale):
    # by hand: x = 0, 1, 2 and y = 0, 2, 3 (means 1 and 5/3): slope = (1 * 5/3 + 0 + 1 * 4/3) / (1 + 0 + 1) = 1.5
    sizes = [1.0, math.e, math.e**2]
    costs = [1.0, math.e**2, math.e**3]
    assert scale.fitted_exponent(sizes, costs) == pytest.approx(1.5)


def test_the_exponent_needs_two_sizes_and_positive_costs(scale):
    assert scale.fitted_exponent([1e6, 1e6], [1.0, 2.0]) is None
    assert scale.fitted_exponent([1e6, 2e6], [None, 2.0]) is None
    assert scale.fitted_exponent([1e6, 2e6, 4e6], [1.0, 2.0, None]) == pytest.approx(1.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory sampler reads /proc (Linux)")
def test_a_child_process_tree_is_timed_and_its_peak_memory_seen(scale, tmp_path):
    # the grandchild holds 300 MiB (touched) for half a second: the tree's peak must see it,
    # although the direct child itself stays small
    hold = ("import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.5)")
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {hold!r}], check=True); print('done')"
    measured = scale.run_measured([sys.executable, "-c", spawn], env=None, cwd=tmp_path)
    assert measured.returncode == 0 and measured.stdout.strip() == "done"
    assert measured.peak_bytes >= 300 * 2**20
    assert measured.peak_bytes < 2 * 2**30
    assert measured.seconds >= 0.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory sampler reads /proc (Linux)")
def test_pages_a_forked_worker_shares_with_its_parent_count_once(scale, tmp_path):
    # the parent touches 300 MiB, then forks two workers that only sleep: each worker's resident set
    # holds the 300 MiB too (mapped, shared), so a sum of resident sets would read ~900 MiB.
    # This process first peaks at 600 MiB: the kernel puts that peak into the child's ru_maxrss (the
    # memory it ran in before its exec), which must not be taken for the child's.
    ballast = bytearray(600 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])
    del ballast
    hold = ("import os, time\n"
            "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])\n"
            "pids = [os.fork() or (time.sleep(1.0), os._exit(0)) for _ in range(2)]\n"
            "time.sleep(1.0)\n"
            "for pid in pids: os.waitpid(pid, 0)\n"
            "print('done')\n")
    measured = scale.run_measured([sys.executable, "-c", hold], env=None, cwd=tmp_path)
    assert measured.returncode == 0 and measured.stdout.strip() == "done"
    assert 300 * 2**20 <= measured.peak_bytes < 450 * 2**20


def test_a_worker_that_exits_between_listing_and_reading_is_not_counted(scale, monkeypatch):
    # The tree is listed (with resident sets) first, the PSS of each process read after: a worker
    # that exits in between has no smaps_rollup any more. Its resident set (the pages it shared
    # with its parent) must not stand in for it, or the parent's memory counts twice (CI read 596
    # MiB for a 300 MiB tree). Where the kernel gives no PSS at all, resident sets are the measure.
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                              "import sys; sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        real = scale._proc_bytes
        gone = f"/proc/{child.pid}/smaps_rollup"
        monkeypatch.setattr(scale, "_proc_bytes", lambda path, field: None if path == gone else real(path, field))
        without = scale._tree_rss(os.getpid())
        monkeypatch.setattr(scale, "_proc_bytes", real)
        with_child = scale._tree_rss(os.getpid())
        assert with_child - without >= 60 * 2**20  # the child's own 64 MiB, counted once it is readable
        monkeypatch.setattr(scale, "_pss_readable", lambda: False)
        monkeypatch.setattr(scale, "_proc_bytes", lambda path, field: None if "smaps_rollup" in path else real(path, field))
        assert scale._tree_rss(os.getpid()) >= 64 * 2**20  # no PSS anywhere: resident sets
    finally:
        child.communicate("")


def test_a_failing_stage_names_itself_and_its_error(scale, tmp_path):
    measured = scale.run_measured([sys.executable, "-c", "import sys; sys.exit('recforge: bad input')"], None, tmp_path)
    with pytest.raises(scale.StageFailed, match="preparation failed \\(exit 1\\): recforge: bad input"):
        scale._check(measured, "preparation")


def test_the_work_dir_may_not_be_inside_the_repository(scale, capsys):
    with pytest.raises(SystemExit):
        scale.parse_args(["ml-20m", "--work-dir", str(REPO_ROOT / "data" / "scale")])
    assert "inside the repository" in capsys.readouterr().err


@pytest.mark.slow
def test_two_tiny_fractions_run_every_stage_through_the_projects_commands(tmp_path):
    import json

    from conftest import run_command

    done = run_command(
        f"python benchmarks/scale.py ml-20m --fractions 0.002,0.004 --presets sasrec_ml-20m --work-dir {tmp_path} "
        "--threads 1 --windows 1 --train-steps 1 --eval-batches 1 --override model.embedding_dim=8 "
        "--override data.batch_size=64 --json " + str(tmp_path / "scale.json"),
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "scale.json").read_text())
    assert result == json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["fraction"] for r in result["fractions"]] == [0.002, 0.004]
    for row in result["fractions"]:
        ratings = tmp_path / "ml-20m" / f"f{row['fraction']:g}" / "raw" / "ratings.csv"
        assert row["raw_rows"] == len(ratings.read_text().splitlines()) - 1  # the header
        assert row["prepare"]["seconds"] > 0 and row["prepare"]["peak_bytes"] > 0
        train, evaluation = row["train"]["sasrec_ml-20m"], row["eval"]["sasrec_ml-20m"]
        assert train["epoch_seconds"] == pytest.approx(train["epoch_updates"] / train["updates_per_s"])
        assert train["state_bytes"]["parameters"] > 0 and train["state_bytes"]["optimizer_state"] > 0
        assert evaluation["batches_run"] == 1 and evaluation["test_batches"] >= 1
        assert not (tmp_path / "ml-20m" / f"f{row['fraction']:g}" / "prepared").exists()  # not kept by default
    exponents = result["exponents"]
    assert exponents["prepare_seconds"] is not None and "seconds_per_update" in exponents["sasrec_ml-20m"]
    assert "| exponent |" in done.stdout

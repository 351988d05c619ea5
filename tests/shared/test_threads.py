"""extras.threads: the CPU thread count chosen once at start (recforge.utils.threads, issue 21)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from recforge.errors import UserInputError
from recforge.utils.threads import busy_cpus, choose_threads


def _stat(path: Path, user: int, idle: int) -> Path:
    # /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return path


def test_busy_cpus_reads_the_share_of_jiffies_spent_busy(tmp_path: Path, monkeypatch):
    stat = _stat(tmp_path / "stat", user=1000, idle=3000)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)

    def later(seconds):  # between the two reads: 300 busy and 100 idle jiffies, on 4 CPUs
        _stat(stat, user=1300, idle=3100)

    monkeypatch.setattr("recforge.utils.threads.time.sleep", later)
    assert busy_cpus(stat=stat) == pytest.approx(3.0)  # 300 / 400 of 4 CPUs
    assert busy_cpus(stat=tmp_path / "missing") is None


@pytest.mark.parametrize("cpus,busy,processes,expected", [
    (2, 0.0, 1, 2),   # a quiet machine: every CPU
    (2, 1.0, 1, 1),   # one CPU-bound job beside the run: the other CPU
    (2, 0.4, 1, 2),   # background noise rounds away
    (2, 2.0, 1, 1),   # everything busy: still one
    (8, 2.2, 2, 3),   # 6 free CPUs for 2 ranks
    (2, 0.0, 2, 1),   # ddp_cpu on 2 CPUs: one each
])
def test_auto_takes_the_free_cpus_shared_among_the_processes(cpus, busy, processes, expected):
    count, line = choose_threads("auto", processes, environ={}, busy=busy, cpus=cpus)
    assert count == expected
    assert line.startswith(f"threads: {expected} (auto: {cpus} CPUs, {busy:.1f} busy with other work")
    assert "extras.threads=N" in line


def test_a_number_is_taken_and_the_environment_wins():
    assert choose_threads(3, environ={}, busy=2.0, cpus=2) == (3, "threads: 3 (extras.threads)")
    count, line = choose_threads("auto", environ={"OMP_NUM_THREADS": "5"}, busy=0.0, cpus=2)
    assert count is None and line.startswith("threads: 5 (OMP_NUM_THREADS, from the environment")


def test_a_count_exported_by_recforge_is_chosen_again_here_and_kept_in_its_children():
    mine = {"OMP_NUM_THREADS": "2", "_RECFORGE_THREADS_SET": f"2:{os.getpid()}"}
    assert choose_threads("auto", environ=mine, busy=1.0, cpus=2)[0] == 1  # the next job of a multirun
    inherited = {"OMP_NUM_THREADS": "2", "_RECFORGE_THREADS_SET": "2:1"}
    assert choose_threads("auto", environ=inherited, busy=1.0, cpus=2) == (
        None, "threads: 2 (chosen by the launching process)")


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5, True, None])
def test_anything_else_is_refused_in_one_line(bad):
    with pytest.raises(UserInputError, match=r"^extras.threads: expected auto or a whole number >= 1; got "):
        choose_threads(bad, environ={}, busy=0.0, cpus=2)

"""The test process stays safe for the minutes of training it runs: one OpenMP runtime only, and
tests marked ``isolated`` run, pass, fail and skip in a pytest process of their own."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ISOLATED_CHILD, _run_in_child


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the Linux process map")
def test_one_openmp_runtime_in_the_test_process():
    """scikit-learn's wheel brings a second libgomp; the DLRM tests ask it in a child process."""
    import torch

    torch.ones(64, 64).matmul(torch.ones(64, 64))  # torch's own runtime is loaded
    libraries = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if re.search(r"lib(g|i)?omp[^/]*\.so", line.split()[-1])}
    assert len(libraries) <= 1, f"several OpenMP runtimes in one process: {sorted(libraries)}"
    assert "sklearn" not in sys.modules


CHILD_TESTS = '''
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "the child's own message"

def test_skips():
    pytest.skip("no such device here")

def test_segfaults_once():
    import os, signal
    from pathlib import Path
    mark = Path(__file__).with_name("segfaulted")
    if not mark.exists():
        mark.write_text("once")
        os.kill(os.getpid(), signal.SIGSEGV)
'''


@pytest.fixture
def child_suite(tmp_path):
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    return lambda name: SimpleNamespace(nodeid=f"test_child.py::{name}", config=SimpleNamespace(rootpath=tmp_path))


def test_isolated_pass_is_a_pass(child_suite):
    _run_in_child(child_suite("test_passes"))


def test_isolated_failure_fails_with_the_child_output(child_suite):
    with pytest.raises(pytest.fail.Exception, match="the child's own message"):
        _run_in_child(child_suite("test_fails"))


def test_isolated_skip_is_a_skip_with_its_reason(child_suite):
    with pytest.raises(pytest.skip.Exception, match="no such device here"):
        _run_in_child(child_suite("test_skips"))


def test_an_isolated_known_segfault_runs_once_more_and_an_unknown_one_fails(child_suite):
    with pytest.raises(pytest.fail.Exception, match=r"rc -11"):
        _run_in_child(child_suite("test_segfaults_once"))
    (child_suite("x").config.rootpath / "segfaulted").unlink()
    with pytest.warns(UserWarning, match=r"run again after a segfault \(a library\)"):
        _run_in_child(child_suite("test_segfaults_once"), "a library")


def test_a_missing_test_is_a_failure(child_suite):
    with pytest.raises(pytest.fail.Exception):
        _run_in_child(child_suite("test_not_there"))


# ---------------------------------------------------------------- stopping the suite (issue 21)
# A child pytest session with the suite's stop handling (-p processes). Its first test fits a
# Lightning model whose training step waits; the signal arrives during that fit. Lightning turns a
# KeyboardInterrupt there into sys.exit(1) and ignores SIGINT from then on, so without the
# handling the session would record one failure and go on to the second test.
STOP_TESTS = '''
import os, subprocess, sys, time
from pathlib import Path

import lightning as L
import torch

from processes import run_child

MARKS = Path(os.environ["STOP_MARKS"])


class Waits(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        (MARKS / "fitting").write_text("")
        time.sleep(0.05)
        return (self.w - batch).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.ones(100_000, 1)  # one tensor: a list of 100k would take pytest ~25 s to show in a traceback


def test_first():
    if os.environ["STOP_CASE"] == "fit":
        L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu").fit(Waits())
    else:  # a child that starts a sleeper of its own and waits: the sleeper must not outlive the suite
        run_child([sys.executable, str(MARKS.parent / "spawn.py"), str(MARKS / "pids")])


def test_after():
    (MARKS / "after").write_text("")
'''
SPAWN = '''
import subprocess, sys, time
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(sleeper.pid))
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("sig,case", [(signal.SIGINT, "fit"), (signal.SIGTERM, "fit"), (signal.SIGTERM, "child")])
def test_a_stop_signal_ends_the_session_and_its_children(tmp_path: Path, sig: int, case: str):
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "test_stop.py").write_text(STOP_TESTS)
    (tmp_path / "spawn.py").write_text(SPAWN)
    env = {**os.environ, "STOP_MARKS": str(marks), "STOP_CASE": case,
           "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop(ISOLATED_CHILD, None)
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "processes", "-p", "no:cacheprovider", "test_stop.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        started = marks / ("fitting" if case == "fit" else "pids")
        while not (started.exists() and started.read_text() != ("" if case == "child" else None)):
            assert session.poll() is None and time.monotonic() < deadline, session.communicate()[0]
            time.sleep(0.1)
        sleeper = int((marks / "pids").read_text()) if case == "child" else None
        session.send_signal(sig)
        out, _ = session.communicate(timeout=60)
    finally:
        if session.poll() is None:
            session.kill()
    assert not (marks / "after").exists(), f"the session went on after {sig.name}:\n{out[-3000:]}"
    assert session.returncode != 0 and f"signal {sig.name}" in out, out[-3000:]
    if sleeper is not None:
        deadline = time.monotonic() + 10
        while _alive(sleeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(sleeper), "a grandchild of the stopped session is still running"


KILLED_PARENT = '''
import sys, time
sys.path.insert(0, sys.argv[1])
from processes import run_child
pid_file = sys.argv[2]
run_child([sys.executable, "-c", f"import os, time; open({pid_file!r}, 'w').write(str(os.getpid())); time.sleep(600)"])
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_a_killed_test_process(tmp_path: Path):
    pid_file = tmp_path / "child"
    (tmp_path / "parent.py").write_text(KILLED_PARENT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(Path(__file__).parents[1]),
                               str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.kill()  # SIGKILL: no handler runs
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ranks_lightning_started_end_when_rank_zero_is_killed(tmp_path: Path):
    """``hardware=ddp_cpu``: Lightning starts rank 1 as a child of the command. SIGKILL the command
    (rank 0, no handler runs): rank 1 ends too. (On gloo its next collective also fails once rank 0
    is gone, so this holds without end_with_rank_zero, which the test above checks on its own: it
    covers a rank outside a collective and NCCL's long timeout.)"""
    from conftest import TINY_RUN, user_checkout

    checkout = user_checkout(tmp_path / "repo", TINY_RUN)  # 10 batches an epoch
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop(ISOLATED_CHILD, None)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    rank0 = subprocess.Popen(  # trains until stopped
        [sys.executable, "src/train.py", "hardware=ddp_cpu", "trainer.max_epochs=100000"],
        cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rank1 = None
    try:
        deadline = time.monotonic() + 180
        while rank1 is None or not list((checkout / "outputs").rglob("epoch_000.ckpt")):
            assert rank0.poll() is None, "the DDP run ended by itself"
            assert time.monotonic() < deadline, "the DDP run did not finish an epoch"
            rank1 = rank1 or next(iter(_children(rank0.pid)), None)
            time.sleep(0.2)
        assert _alive(rank1)
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 30
        while _alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank1), "rank 1 outlived its SIGKILLed rank 0"
    finally:
        for pid in [rank0.pid, *([rank1] if rank1 else [])]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


RANK_PARENT = '''
import os, subprocess, sys, time
env = {**os.environ, "LOCAL_RANK": sys.argv[2], "WORLD_SIZE": "2"}
code = ("from recforge.distributed.launched_ranks import end_with_rank_zero; import os, sys, time; "
        "asked = end_with_rank_zero(); open(sys.argv[1], 'w').write(f'{os.getpid()} {asked}'); time.sleep(600)")
subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], env=env)
time.sleep(600)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("local_rank, ends", [("1", True), ("0", False)])
def test_a_launched_rank_asks_to_end_with_its_parent(tmp_path: Path, local_rank: str, ends: bool):
    """A process started as rank 1 (LOCAL_RANK=1, as Lightning's launcher starts it) that calls
    end_with_rank_zero dies when its parent is SIGKILLed; rank 0's own process asks nothing."""
    mark = tmp_path / "child"
    (tmp_path / "parent.py").write_text(RANK_PARENT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", ISOLATED_CHILD)}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(mark), local_rank], env=env,
                              start_new_session=True)
    child = None
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() or not mark.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        pid, asked = mark.read_text().split()
        child = int(pid)
        assert asked == str(ends)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(child) != ends
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)

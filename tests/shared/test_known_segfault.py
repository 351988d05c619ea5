"""The harness's second run after a known library segfault: only for a SIGSEGV, only where the
test names the crash, once, and said as a warning (conftest._once_more_after_a_known_segfault)."""
from __future__ import annotations

import textwrap

import pytest
from conftest import run_command

# segfaults (SIGSEGV to itself) while its counter file holds fewer than N lines, then exits 0
_CRASH_N_TIMES = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    counter, crashes, code = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    runs = len(counter.read_text().splitlines()) if counter.exists() else 0
    counter.write_text("run\\n" * (runs + 1))
    if runs < crashes:
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.exit(code)
""")


@pytest.fixture
def crasher(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_N_TIMES)
    counter = tmp_path / "runs.txt"

    def command(crashes: int, code: int = 0) -> str:
        return f"python {script} {counter} {crashes} {code}"

    return command, counter


def _runs(counter) -> int:
    return len(counter.read_text().splitlines())


def test_a_known_segfault_is_run_once_more_and_said(tmp_path, crasher):
    command, counter = crasher
    with pytest.warns(UserWarning, match="run again after a segfault \\(some library\\)"):
        done = run_command(command(crashes=1), cwd=tmp_path, known_segfault="some library")
    assert done.returncode == 0 and _runs(counter) == 2


def test_a_second_segfault_is_the_result(tmp_path, crasher):
    command, counter = crasher
    with pytest.warns(UserWarning):
        done = run_command(command(crashes=2), cwd=tmp_path, known_segfault="some library")
    assert done.returncode < 0 and _runs(counter) == 2


def test_no_second_run_without_a_named_crash_or_for_another_failure(tmp_path, crasher, recwarn):
    command, counter = crasher
    done = run_command(command(crashes=1), cwd=tmp_path)
    assert done.returncode < 0 and _runs(counter) == 1
    counter.unlink()
    done = run_command(command(crashes=0, code=3), cwd=tmp_path, known_segfault="some library")
    assert done.returncode == 3 and _runs(counter) == 1
    assert not [w for w in recwarn if "segfault" in str(w.message)]

"""The test process stays safe for the minutes of training it runs: one OpenMP runtime only, and
tests marked ``isolated`` run, pass, fail and skip in a pytest process of their own."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import _run_in_child


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


def test_a_missing_test_is_a_failure(child_suite):
    with pytest.raises(pytest.fail.Exception):
        _run_in_child(child_suite("test_not_there"))

"""recforge.utils.startup: a command's imports without the cycle collector, in a fresh interpreter
(the collector's state is process-wide)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import gc, json, sys
from recforge.utils.startup import imports_without_gc
{before}
inside = []
with imports_without_gc():
    inside.append(gc.isenabled())
    import fractions, decimal  # something to import
print(json.dumps({{"inside": inside[0], "after": gc.isenabled(), "frozen": gc.get_freeze_count()}}))
"""


def _probe(before: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_collector_is_off_inside_and_on_after_with_the_imports_frozen():
    seen = _probe()
    assert seen["inside"] is False and seen["after"] is True
    assert seen["frozen"] > 1000  # the interpreter's and the imported modules' objects


def test_a_collector_the_caller_had_turned_off_stays_off():
    assert _probe("gc.disable()")["after"] is False


@pytest.mark.parametrize("command", ["src/train.py", "src/eval.py"])
def test_the_entry_points_start_cleanly(command):
    # frozen objects are unfrozen at exit, so the shutdown frees them: Triton's bindings print
    # "nanobind: leaked ..." on stderr otherwise
    done = subprocess.run([sys.executable, command, "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr

"""extras.malloc: the policy really changes how glibc serves a run's large temporaries.

The oracle is the kernel's own count of page faults: a 64 MiB tensor made and freed over and over
costs a fresh, zero-filled mapping each time under glibc's defaults, and (almost) nothing once the
heap has grown to hold it when freed memory is kept. Each arm runs in a fresh interpreter: mallopt settings are
process-wide and last until exit.
"""
from __future__ import annotations

import json
import os
import platform
import sys

import pytest

from processes import run_child

from recforge.errors import UserInputError
from recforge.utils import allocator
from recforge.utils.allocator import USER_VARIABLES, apply_malloc_policy

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

FAULTS = """
import json, resource, sys
import torch
from recforge.utils.allocator import apply_malloc_policy
line = apply_malloc_policy(sys.argv[1])

def steps():
    for _ in range(12):
        block = torch.empty(16 * 1024 * 1024)  # 64 MiB
        block.fill_(1.0)  # touches every page
        del block

steps()  # the heap grows to its working size
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"line": line, "faults": after - before}))
"""


def _faults(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in USER_VARIABLES}
    out = run_child([sys.executable, "-c", FAULTS, policy], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_keep_stops_the_same_large_tensor_being_faulted_in_every_time():
    default, keep = _faults("default"), _faults("keep")
    assert default["line"] == "malloc: glibc's defaults (extras.malloc=default)"
    assert keep["line"].startswith("malloc: freed memory kept for reuse")
    # default: 12 fresh mappings of 64 MiB (16,384 pages each, fewer with huge pages); keep: the
    # memory of the first round, reused
    assert default["faults"] >= 12 * 16
    assert keep["faults"] * 10 < default["faults"], (keep, default)


@glibc_only
def test_keep_sets_glibc_through_mallopt_with_values_it_accepts(monkeypatch):
    calls = []

    class FakeLibc:
        def mallopt(self, parameter, value):
            calls.append((parameter.value, value.value))
            return 1

    monkeypatch.setattr(allocator, "_libc", lambda: FakeLibc())
    line = apply_malloc_policy("keep", environ={})
    assert line.startswith("malloc: freed memory kept for reuse")
    # mallopt's value is a C int: both fit without wrapping (4 GiB would wrap to 0: trim always)
    assert calls == [(allocator.M_MMAP_THRESHOLD, 1 << 30), (allocator.M_TRIM_THRESHOLD, 2**31 - 1)]


def test_a_user_s_own_malloc_variables_win(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: pytest.fail("mallopt must not be called"))
    line = apply_malloc_policy("keep", environ={"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert line == "malloc: left to the environment (MALLOC_MMAP_THRESHOLD_ set); extras.malloc=keep not applied"


def test_default_and_other_c_libraries_change_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(allocator.platform, "system", lambda: "Darwin")
    assert apply_malloc_policy("keep", environ={}) == "malloc: not glibc (Darwin); extras.malloc=keep has nothing to set"
    assert apply_malloc_policy("default", environ={}) == "malloc: glibc's defaults (extras.malloc=default)"


def test_a_refused_setting_is_said(monkeypatch):
    class OldLibc:
        def mallopt(self, parameter, value):
            return 0 if parameter.value == allocator.M_MMAP_THRESHOLD else 1

    monkeypatch.setattr(allocator, "_libc", lambda: OldLibc())
    assert apply_malloc_policy("keep", environ={}) == (
        "malloc: glibc refused M_MMAP_THRESHOLD; extras.malloc=keep applied in part")


def test_an_unknown_policy_is_one_line_naming_the_key():
    with pytest.raises(UserInputError, match=r"^extras\.malloc: expected one of keep, default; got 'tuned'$"):
        apply_malloc_policy("tuned", environ={})

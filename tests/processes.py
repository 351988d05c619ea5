"""Stopping the test suite: Ctrl-C and SIGTERM end the session, and no child process outlives it.

Two things kept a stopped suite going (issue 21):

- Lightning answers a KeyboardInterrupt inside ``Trainer.fit`` by ignoring SIGINT for good and
  calling ``sys.exit(1)``: in a test process that is one failed test, and every later Ctrl-C is
  ignored. Lightning also takes SIGTERM over while it fits. The session's own handlers record the
  signal first; after the test it arrived in, the session ends, whatever the test made of it.
- A child started by a test (``src/train.py``, its DDP ranks, a converter's workers) was left
  running when the test process stopped. :func:`run_child` starts each in a process group of its
  own, ends the whole group on the way out (a normal end included: a rank left behind by a
  child that crashed), and asks the kernel to kill the child if the test process dies without a
  chance to clean up (SIGKILL).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

import pytest

_received: list[int] = []


def _record(signum, frame):
    _received.append(signum)
    # Every running test gets the same exception a terminal's Ctrl-C gives.
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def install_stop_handlers() -> None:
    """SIGINT and SIGTERM recorded and raised as KeyboardInterrupt in the main thread."""
    signal.signal(signal.SIGINT, _record)
    signal.signal(signal.SIGTERM, _record)


def stop_if_signalled() -> None:
    """End the session if a stop signal arrived during the test that just ran."""
    if _received:
        name = signal.Signals(_received[0]).name
        install_stop_handlers()  # Lightning may have left SIGINT ignored
        pytest.exit(f"stopped by signal {name}", returncode=128 + _received[0])


# The two as pytest hooks: tests/conftest.py imports them, a child session takes ``-p processes``.
def pytest_sessionstart(session):
    install_stop_handlers()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    stop_if_signalled()
    return result


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is empty
        pass


def _end_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the child's process group, SIGKILL to what is left after ``grace`` seconds."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _start(args, **kwargs) -> subprocess.Popen:
    """The child in a process group of its own (ended whole with :func:`_end_group`), killed by the
    kernel if the test process dies first."""
    return subprocess.Popen(args, start_new_session=True, preexec_fn=_die_with_parent, **kwargs)


def run_child(args, *, input=None, capture_output: bool = False, timeout: float | None = None,
              check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose child, and every process it starts, ends with the call: on
    return, on a timeout, on Ctrl-C or SIGTERM of the test process; and dies with it on SIGKILL."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    proc = _start(args, stdin=subprocess.PIPE if input is not None else kwargs.pop("stdin", None), **kwargs)
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _end_group(proc, grace=0.5)
        raise subprocess.TimeoutExpired(proc.args, timeout, exc.output, exc.stderr) from None
    except BaseException:
        _end_group(proc)
        raise
    finally:
        _signal_group(proc, signal.SIGKILL)  # what the child left running
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def run_children(commands: list[list[str]], *, timeout: float | None = None,
                 **kwargs) -> list[subprocess.CompletedProcess]:
    """:func:`run_child` for several commands at once (the machine's cores work on them side by
    side), their text output captured; each ends, with what it started, when the call does."""
    import tempfile
    import time

    with contextlib.ExitStack() as stack:
        started = []
        for args in commands:
            out = stack.enter_context(tempfile.TemporaryFile("w+"))
            err = stack.enter_context(tempfile.TemporaryFile("w+"))
            proc = _start(args, stdout=out, stderr=err, text=True, **kwargs)
            stack.callback(_signal_group, proc, signal.SIGKILL)  # what each left running
            stack.callback(lambda p=proc: p.poll() is None and _end_group(p))
            started.append((proc, out, err))
        deadline = None if timeout is None else time.monotonic() + timeout
        done = []
        for proc, out, err in started:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(proc.args, timeout) from None
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
        return done

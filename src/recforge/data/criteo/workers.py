"""Runs of raw lines handed to worker processes, their results taken back in order.

:class:`OrderedPool` maps a function over tasks in ``workers`` processes and yields the results
in task order, with at most ``2 * workers`` tasks in flight: memory stays a few runs' worth, not
the file's, and the process that takes the results (the conversion's writer) sees exactly the
sequence a serial run sees, so the output is the same bytes whatever ``workers`` is.
``workers=0`` runs every task in this process (no pool, no copies).

Workers are started with ``spawn`` (a fresh interpreter: no inherited threads or locks of a
process that already runs torch or arrow), once per pool; ``initializer(*initargs)`` runs in each
(and in this process when ``workers=0``) to set what every task shares (a vocabulary, a split
plan), so it is sent once per worker rather than with every task.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from recforge.errors import UserInputError

__all__ = ["OrderedPool", "check_workers"]

_PARENT_POLL_SECONDS = 1.0


def _start_worker(parent: int, initializer: Callable[..., None] | None, initargs: tuple) -> None:
    """In each worker: end it when the process that started it is gone (killed with SIGKILL, its
    pool never shuts down, and an idle worker would wait for tasks forever), then run the
    pool's initializer."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def check_workers(workers: Any) -> int:
    """``workers`` as an int >= 0; a one-line user error otherwise."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise UserInputError(f"workers must be an integer >= 0 (0: convert in this process), got {workers!r}")
    return workers


class OrderedPool:
    """``with OrderedPool(workers, initializer, initargs) as pool: for r in pool.map(fn, tasks)``."""

    def __init__(self, workers: int, initializer: Callable[..., None] | None = None,
                 initargs: tuple = ()) -> None:
        self.workers = check_workers(workers)
        self._initializer = initializer
        self._initargs = initargs
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> OrderedPool:
        if self.workers == 0:
            if self._initializer is not None:
                self._initializer(*self._initargs)
        else:
            self._executor = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker, initargs=(os.getpid(), self._initializer, self._initargs))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def map(self, fn: Callable[..., Any], tasks: Iterable[tuple]) -> Iterator[Any]:
        """``fn(*task)`` for each task, in task order. A task's exception is raised here when its
        turn comes; stopping early (or an error) cancels the tasks not started yet."""
        if self._executor is None:
            for task in tasks:
                yield fn(*task)
            return
        pending: deque[Future] = deque()
        try:
            for task in tasks:
                pending.append(self._executor.submit(fn, *task))
                del task  # a run's bytes are freed once sent, not held here until the next one
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

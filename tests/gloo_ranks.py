"""The distributed tests' harness: a test's function run in several gloo processes on this machine.

Each process joins one gloo process group on a free local port, with one intra-op thread (the same
reduction order in every process, and no more threads than the CI machine's two cores), runs the
function and leaves the group, whatever happened.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, world: int, worker: Callable[..., Any], args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = worker(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable[..., Any], *args: Any, world: int = 2) -> list[Any]:
    """``worker(rank, *args)`` in ``world`` processes of one gloo group, and what each returned,
    by rank. ``worker`` is a module-level function (the processes are spawned: it is pickled by
    name) and returns something picklable."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), world, worker, args, out), nprocs=world, join=True)
        return [out[rank] for rank in range(world)]

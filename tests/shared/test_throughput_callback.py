"""EventThroughput counts events and mini-batches, also when steps arrive grouped."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recforge.callbacks.throughput import EventThroughput
from recforge.data.batches import SessionStep, SessionSteps


def _step(rows: int) -> SessionStep:
    items = torch.zeros(rows, dtype=torch.long)
    return SessionStep(items, items, torch.zeros(rows, dtype=torch.bool))


@pytest.mark.parametrize("grouped", [False, True])
def test_events_and_mini_batches_per_second(grouped, monkeypatch):
    clock = iter([100.0, 102.0])  # epoch start, epoch end: 2 seconds
    monkeypatch.setattr("recforge.callbacks.throughput.time.perf_counter", lambda: next(clock))
    logged = {}
    module = SimpleNamespace(log=lambda name, value, **kw: logged.__setitem__(name, value))
    trainer = SimpleNamespace(training=True, sanity_checking=False, world_size=1)
    steps = [_step(32), _step(32), _step(32), _step(20)]  # the batch shrinks at the epoch end
    batches = [SessionSteps(steps[:3]), SessionSteps(steps[3:])] if grouped else steps

    callback = EventThroughput(prog_bar_every=0)
    callback.on_train_epoch_start(trainer, module)
    for i, batch in enumerate(batches):
        callback.on_train_batch_end(trainer, module, None, batch, i)
    callback.on_train_epoch_end(trainer, module)

    assert callback.totals["train/events"] == 116
    assert logged["train/events_per_s"] == pytest.approx(58.0)
    assert logged["train/batches_per_s"] == pytest.approx(2.0)  # 4 mini-batches either way


@pytest.mark.parametrize(("world", "readers", "events"), [(2, 2, 2 * 116), (4, 2, 2 * 116), (2, 1, 116)])
def test_the_run_counts_each_data_parallel_ranks_rows_once(monkeypatch, world, readers, events):
    """Under DDP every rank counts its own rows (the sum is the run's); the table-sharding ranks of
    a mesh read the same rows as their data-parallel rank (counted once); the slowest rank's time
    is the run's. Every rank here counts 116 rows in 2 s, the last one in 4 s."""
    clock = iter([100.0, 102.0])
    monkeypatch.setattr("recforge.callbacks.throughput.time.perf_counter", lambda: next(clock))

    def reduce(tensor, reduce_op):  # what the ranks' all-reduce returns, every rank alike
        return tensor * world if reduce_op == "sum" else torch.full_like(tensor, 4.0)

    trainer = SimpleNamespace(training=True, sanity_checking=False, world_size=world,
                              distributed_sampler_kwargs={"num_replicas": readers, "rank": 0},
                              strategy=SimpleNamespace(reduce=reduce))
    module = SimpleNamespace(log=lambda *a, **kw: None, device=torch.device("cpu"))
    callback = EventThroughput(prog_bar_every=0)
    callback.on_train_epoch_start(trainer, module)
    for i, rows in enumerate((32, 32, 32, 20)):
        callback.on_train_batch_end(trainer, module, None, _step(rows), i)
    callback.on_train_epoch_end(trainer, module)
    assert callback.totals["train/events"] == events
    assert callback.totals["train/events_per_s"] == pytest.approx(events / 4.0)
    assert callback.totals["train/batches_per_s"] == pytest.approx(4 / 4.0)  # a rank's steps

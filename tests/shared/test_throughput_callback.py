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
    trainer = SimpleNamespace(training=True, sanity_checking=False)
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

"""benchmarks/history_loader_throughput.py on a tiny prepared directory: one rank's share in every
workers row, the ratio against a given training rate."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO_ROOT, run_command

from recforge.data.sequences.prepared import Histories, write_prepared


def test_the_loader_report_covers_a_ranks_epoch_in_every_row(tmp_path):
    n_users, length, n_items = 41, 6, 30  # odd: the last rank's share is padded by one
    offsets = np.arange(n_users + 1, dtype=np.int64) * length
    items = np.random.default_rng(0).integers(0, n_items, offsets[-1]).astype(np.int32)
    write_prepared(tmp_path / "p", Histories(
        users=np.array([f"u{u}" for u in range(n_users)], dtype=object), offsets=offsets, items=items,
        timestamps=np.arange(offsets[-1], dtype=np.int64), ratings=np.ones(offsets[-1], np.float32),
        item_ids=np.array([f"m{j}" for j in range(n_items)], dtype=object),
        item_counts=np.bincount(items, minlength=n_items).astype(np.int64),
    ), dataset="ml-20m", inputs=[], params={})
    done = run_command(f"python benchmarks/history_loader_throughput.py --prepared-dir {tmp_path / 'p'} "
                       "--workers 0,1 --shm-handoff --repeats 2 --batch-size 4 --world 2 --rank 1 "
                       "--train-rate sasrec_ml-20m=2.5", cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["train_rows"] == n_users and report["max_seq_len"] == 200  # ml-20m's preset
    assert "(21 sequences per epoch on this rank" in done.stdout
    assert set(report["loader"]) == {"0", "1", "1 shm"}
    for row in report["loader"].values():  # each window: the rank's 21 sequences in 6 batches
        assert len(row["seq_per_s"]) == 2 and min(row["seq_per_s"]) > 0
        assert [s / b for s, b in zip(row["seq_per_s"], row["batches_per_s"])] == pytest.approx([21 / 6] * 2)
    assert report["training"]["sasrec_ml-20m"]["seq_per_s"]["median"] == 2.5
    assert "loader workers 1 shm / training:" in done.stdout

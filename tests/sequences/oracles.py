"""Oracles the sequential families (SASRec, HSTU) share."""
from __future__ import annotations


def most_popular_hr(datamodule, k: int) -> float:
    """HR@k of ranking by training popularity, history excluded, ties against the target (numpy)."""
    import numpy as np

    popularity = datamodule.task_inputs()["item_popularity"].astype(np.float64)
    hits = []
    for batch in datamodule.test_dataloader():
        for b in range(batch.size):
            excluded = set(batch.exclude_items[batch.exclude_offsets[b]:batch.exclude_offsets[b + 1]].tolist())
            target = int(batch.targets[b])
            others = np.array([j for j in range(len(popularity)) if j != target and j not in excluded])
            hits.append(1 + np.sum(popularity[others] >= popularity[target]) <= k)
    return float(np.mean(hits))

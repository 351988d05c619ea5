#!/usr/bin/env python
"""DLRM training samples/s on pre-made batches through recforge's real code path: the model, loss
and optimizer the config builds (``experiment=dlrm_criteo_kaggle`` by default), and the update
``CTRTask.training_step`` makes (forward, BCE, zero_grad, backward, optimizer step) without
Lightning's loop.

Batches are made before timing, as the reference's own benchmark numbers are taken (spec §4): 13
dense values log(1 + randint(0, 100)), one uniform id per table (with ``--multi-hot mlperf``, that
id's MLPerf bag), random labels. Tables default to
the full Kaggle sizes (33.8M rows; ``--tables small`` uses the reference oracle's 500 + 13 i rows:
step time barely depends on it, since sparse SGD touches batch x 26 rows). Fixed thread count;
``--windows`` windows of ``--steps`` steps after ``--warmup``; prints min and median samples/s
and one JSON line. Compare with facebookresearch/dlrm's ``DLRM_Net`` timed the same way, taken
alternately (the machine is shared): see benchmarks/README.md.

    python benchmarks/dlrm_throughput.py --batch 128
    python benchmarks/dlrm_throughput.py --batch 2048 --override model.dot_interaction.kernel=triton --device cuda
    python benchmarks/dlrm_throughput.py --experiment dlrm_dcnv2_criteo_terabyte --batch 2048 --multi-hot mlperf
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

# facebookresearch/dlrm's per-feature counts on Criteo Kaggle without max-ind-range (spec §2)
KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="dlrm_criteo_kaggle")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--tables", choices=["kaggle", "small"], default="kaggle")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--steps", type=int, default=100, help="training steps per window")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--multi-hot", choices=["none", "mlperf"], default="none",
                   help="mlperf: each id becomes a bag of MLPerf DLRM-DCNv2's size (sum-pooled lookup)")
    return p.parse_args(argv)


def _parts(args):
    """The model, loss and optimizer of the experiment, built as the pipeline builds them."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import recforge.utils.resolvers  # noqa: F401
    from recforge.tasks.ctr import CTRTask

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={args.experiment}", *args.override])
    cards = KAGGLE_CARDINALITIES if args.tables == "kaggle" else [500 + 13 * i for i in range(26)]
    task = CTRTask(
        model=instantiate(cfg.model), loss=instantiate(cfg.loss), optimizer=instantiate(cfg.optimizer),
        evaluation=instantiate(cfg.evaluation), cardinalities=cards, n_dense=13,
    )
    return task, cards


def main(argv=None) -> dict:
    args = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    task, cards = _parts(args)
    build_s = time.perf_counter() - started
    device = torch.device(args.device)
    task.to(device).train()
    optimizer = task.optimizer_factory(params=task.optimizer_params())

    from recforge.data.criteo.multi_hot import MLPERF_BAG_SIZES, MultiHot

    multi_hot = MultiHot(MLPERF_BAG_SIZES, tuple(cards)) if args.multi_hot == "mlperf" else None
    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(64):
        dense = torch.log1p(torch.randint(0, 100, (args.batch, 13), generator=g).float())
        sparse = torch.stack([torch.randint(0, c, (args.batch,), generator=g) for c in cards], 1)
        if multi_hot is not None:
            sparse = multi_hot.expand(sparse.numpy())
        labels = torch.randint(0, 2, (args.batch,), generator=g).float()
        batches.append((dense.to(device), sparse.to(device), labels.to(device)))

    def step(i: int) -> None:
        dense, sparse, labels = batches[i % len(batches)]
        loss = task.loss(task.model(dense, sparse), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(args.warmup):
        step(i)
    sync()
    rates, k = [], 0
    for _ in range(args.windows):
        t = time.perf_counter()
        for _ in range(args.steps):
            step(k)
            k += 1
        sync()
        rates.append(args.steps * args.batch / (time.perf_counter() - t))
    out = {
        "impl": "recforge", "experiment": args.experiment, "overrides": args.override, "batch": args.batch,
        "multi_hot": args.multi_hot, "threads": args.threads, "tables": args.tables, "device": args.device, "build_s": round(build_s, 1),
        "samples_per_s_min": round(min(rates)), "samples_per_s_median": round(statistics.median(rates)),
        "samples_per_s_max": round(max(rates)),
    }
    print(f"samples/s: min {out['samples_per_s_min']}, median {out['samples_per_s_median']} "
          f"(batch {args.batch}, {args.threads} threads, {args.windows} windows of {args.steps} steps)",
          file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

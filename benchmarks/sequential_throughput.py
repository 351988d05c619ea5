#!/usr/bin/env python
"""Training sequences/s and evaluation users/s of a sequential recommender (SASRec by default, HSTU)
through recforge's real code path: ``recforge.pipeline.build``, then the task's public
``train_loss`` + an optimizer step (the update ``training_step`` makes, without Lightning's loop)
and its ``test_step`` over the test split.

Default: the ml-1m preset on the real ml-1m prefix in ``../shared/data/ml-1m`` (2,999 users, the
reference protocol, batch 128, histories of at most 200 items), fixed thread count. Training is
timed in ``--windows`` windows of ``--steps`` batches each, after ``--warmup`` untimed batches;
evaluation once per window over every test user. Prints min and median per figure, then one JSON
line. Other jobs on the box skew the minimum less than the median: compare runs as ratios, taken
alternately.

    python benchmarks/sequential_throughput.py                      # SASRec, ml-1m prefix
    python benchmarks/sequential_throughput.py --experiment hstu_ml-1m   # or hstu_large_ml-1m
    python benchmarks/sequential_throughput.py --override loss.shared_negatives=true
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="sasrec_ml-1m")
    p.add_argument("--shared-data", default=os.environ.get("RECFORGE_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training batches per window")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the task and its batches are moved there)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def _config(args, workdir: Path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    ml1m = Path(args.shared_data) / "ml-1m"
    overrides = [f"experiment={args.experiment}", "data.protocol=reference"]
    if args.experiment.endswith("ml-1m"):
        if not (ml1m / "ratings.partial.dat.gz").is_file():
            sys.exit(f"the ml-1m prefix is not at {ml1m} (set --shared-data or RECFORGE_SHARED_DATA)")
        overrides.append(f"data.ratings_path={ml1m / 'ratings.partial.dat.gz'}")
    overrides += args.override
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(workdir)
        cfg.paths.root_dir = str(REPO)
        cfg.paths.output_dir = str(workdir)
        cfg.paths.data_dir = str(workdir / "data")
    HydraConfig.instance().set_config(cfg)  # the config check reads the group choices
    return cfg


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1), "n": len(values)}


def main(argv=None) -> int:
    args = _args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import lightning as L
    import torch

    from recforge.pipeline import build
    from recforge.utils.quiet import silence_known_noise

    torch.set_num_threads(args.threads)
    silence_known_noise()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, Path(tmp))
        L.seed_everything(cfg.seed, verbose=False)
        datamodule, task = build(cfg)
        datamodule.setup("fit")
        datamodule.setup("test")
        device = torch.device(args.device)
        task.to(device)
        optimizer = task.optimizer_factory(params=task.parameters())
        train_batches = [b.to(device) for b in datamodule.train_dataloader()]
        test_batches = [b.to(device) for b in datamodule.test_dataloader()]
        needed = args.warmup + args.windows * args.steps
        if len(train_batches) < needed:
            train_batches = (train_batches * (needed // len(train_batches) + 1))[:needed]
        mean_len = float(torch.cat([b.lengths for b in train_batches]).float().mean())
        print(f"# {args.experiment}, {datamodule.task_inputs()['n_items']} items, "
              f"{sum(b.size for b in test_batches)} test users, mean training history {mean_len:.1f}; "
              f"torch {torch.__version__}, {args.device}, {args.threads} threads, load {os.getloadavg()[0]:.2f}")

        def sync() -> None:  # a window ends when the device has finished its work
            if device.type == "cuda":
                torch.cuda.synchronize()

        def train_step(batch) -> None:
            loss = task.train_loss(batch)  # what training_step optimises
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        task.train()
        for batch in train_batches[: args.warmup]:
            train_step(batch)
        train_rates, eval_rates = [], []
        position = args.warmup
        for _ in range(args.windows):
            window = train_batches[position: position + args.steps]
            position += args.steps
            task.train()
            start = time.perf_counter()
            for batch in window:
                train_step(batch)
            sync()
            train_rates.append(sum(b.size for b in window) / (time.perf_counter() - start))
            if args.no_eval:
                continue
            task.eval()
            start = time.perf_counter()
            with torch.inference_mode():
                for i, batch in enumerate(test_batches):
                    task.test_step(batch, i)
                task.evaluation.compute_and_reset("test")
            sync()
            eval_rates.append(sum(b.size for b in test_batches) / (time.perf_counter() - start))
        result = {"benchmark": "sequential_throughput", "experiment": args.experiment,
                  "overrides": args.override, "threads": args.threads,
                  "train_sequences_per_s": _summary(train_rates)}
        print(f"train sequences/s: min {min(train_rates):,.1f}  median {statistics.median(train_rates):,.1f}")
        if eval_rates:
            result["eval_users_per_s"] = _summary(eval_rates)
            print(f"eval users/s:      min {min(eval_rates):,.1f}  median {statistics.median(eval_rates):,.1f}")
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Wall time and peak memory of one evaluation pass of a sequential experiment at full size.

The config is composed as ``src/train.py`` composes it (``experiment=X`` + ``--override``s, the
same composition as ``train_throughput.py``), ``recforge.pipeline.build`` makes the data module and
the (untrained) task, and every test batch (or the first ``--users`` users) goes through the
task's own ``test_step`` under ``torch.inference_mode``: the encoder over each history, the
full-catalogue ranking in tiles with the history excluded, the metric sums. Nothing else runs.

Memory is the process's resident set from the kernel (torch keeps no allocator statistics for CPU
tensors): ``VmHWM`` after the data is read and the model built (the baseline), then reset to the
current RSS through ``/proc/self/clear_refs`` and read again after the pass, so the pass's own peak
is ``VmHWM - VmRSS before``. The batch/attention/tile sizes in force are printed, so the bound the
pass should respect (a function of ``eval_batch_size``, ``max_seq_len`` and ``chunk_size``, never of
the number of users or items x users) can be compared with the figure.

Data: by default generated full-size user histories (``data=synthetic_histories`` with
``--users-in-data``/``--items``, lengths log-uniform in ``[--min-length, --max-length]``), written once
under ``--data-dir`` (keep it out of the repo); or name real data with ``--override
data.ratings_path=...``.

    python benchmarks/eval_at_size.py --experiment sasrec_ml-20m --users-in-data 138493 --items 27278
    python benchmarks/eval_at_size.py --experiment hstu_amzn-books --users-in-data 100000 --items 695762 \\
        --min-length 5 --max-length 200 --sample 8192     # one partial Books validation (8,192 users)

A measurement tool: nothing here asserts.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", required=True)
    p.add_argument("--override", action="append", default=[], help="KEY=VALUE, repeatable")
    p.add_argument("--users-in-data", type=int, default=138_493, help="generated users")
    p.add_argument("--items", type=int, default=27_278, help="generated catalogue size")
    p.add_argument("--min-length", type=int, default=20)
    p.add_argument("--max-length", type=int, default=600)
    p.add_argument("--users", type=int, default=None, help="evaluate only the first N test users (longest first)")
    p.add_argument("--sample", type=int, default=None,
                   help="one partial validation pass instead: evaluation.max_users=N, a sampled epoch")
    p.add_argument("--eval-batch-size", type=int, default=None, help="data.eval_batch_size")
    p.add_argument("--stride", type=int, default=1,
                   help="rank every S-th batch only and project the pass (S x the time): the batches "
                        "go longest history first, so every S-th one spans the lengths evenly")
    p.add_argument("--row-order", action="store_true",
                   help="batches in row order, as before evaluation shards went longest first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default="data/bench", help="where generated data is cached")
    p.add_argument("--generate-only", action="store_true", help="write the data, measure nothing")
    return p.parse_args(argv)


def _status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch
    from timing import cpu_model, load_average
    from train_throughput import compose_config

    from recforge.pipeline import build
    from recforge.utils.allocator import apply_malloc_policy
    from recforge.utils.quiet import silence_known_noise

    torch.set_num_threads(args.threads)
    silence_known_noise()
    names_data = any(o.split("=", 1)[0].startswith("data.ratings_path") or o.startswith("data=")
                     for o in args.override)
    generated = [] if names_data else [
        "data=synthetic_histories", f"data.protocol={'loo' if args.sample else 'reference'}",
        f"data.generator.n_users={args.users_in_data}", f"data.generator.n_items={args.items}",
        f"data.generator.min_length={args.min_length}", f"data.generator.max_length={args.max_length}",
    ]
    sized = [f"data.eval_batch_size={args.eval_batch_size}"] if args.eval_batch_size else []
    if args.sample:
        sized += [f"evaluation.max_users={args.sample}", "evaluation.full_every_n_epochs=5"]
    compose_args = argparse.Namespace(experiment=args.experiment, device="cpu", batch_size=None,
                                      override=generated + sized + args.override, data_dir=args.data_dir)
    with tempfile.TemporaryDirectory(prefix="recforge-evalsize-") as tmp:
        cfg, overrides, _ = compose_config(compose_args, Path(tmp))
        print(f"# {apply_malloc_policy(cfg.extras.malloc)}", flush=True)  # as a run does (extras.malloc)
        started = time.perf_counter()
        datamodule, task = build(cfg)
        datamodule.setup("test")
        if args.generate_only:
            print(f"# data ready in {time.perf_counter() - started:.1f} s")
            return 0
        split = "test"
        if args.sample:
            # the validation loader as a fit builds it, at an epoch that ranks the sample only
            split = "val"
            datamodule.trainer = argparse.Namespace(lightning_module=task, global_rank=0, world_size=1)
            loader = datamodule.val_dataloader()
            loader.sampler.set_epoch(1)
        else:
            loader = datamodule.test_dataloader()
        n_test = len(loader.dataset)
        if args.row_order:
            loader = torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size,
                                                 collate_fn=loader.collate_fn)
        step = task.validation_step if split == "val" else task.test_step
        task.eval()
        # code paths loaded on two users before the baseline (no batch-sized buffer cached yet)
        tiny = next(iter(torch.utils.data.DataLoader(loader.dataset, batch_size=2, collate_fn=loader.collate_fn)))
        with torch.inference_mode():
            task.test_step(tiny, 0)
        task.evaluation.compute_and_reset("test")
        setup_s = time.perf_counter() - started
        baseline_hwm, baseline_rss = _status_kb("VmHWM"), _status_kb("VmRSS")
        reset = _reset_peak()
        users, batch_times = 0, []
        cpu_start = time.process_time()
        with torch.inference_mode():
            batches = iter(loader)
            for index in itertools.count():
                if args.users is not None and users >= args.users:
                    break
                t0 = time.perf_counter()
                batch = next(batches, None)  # building the batch counts in its time
                if batch is None:
                    break
                if index % args.stride:
                    continue
                step(batch, index)
                batch_times.append(time.perf_counter() - t0)
                users += batch.size
        pass_s, cpu_s = sum(batch_times), time.process_time() - cpu_start
        metrics = {k: round(float(v), 5) for k, v in task.evaluation.compute_and_reset(split).items()}
        peak_kb, rss_after = _status_kb("VmHWM"), _status_kb("VmRSS")
    data = cfg.data
    result = {
        "benchmark": "eval_at_size", "experiment": args.experiment, "overrides": overrides,
        "threads": args.threads, "torch": torch.__version__, "cpu": cpu_model(), "load_average": load_average(),
        "n_items": task.n_items, "split_users": n_test, "users_evaluated": users,
        "eval_batch_size": data.eval_batch_size, "max_seq_len": data.max_seq_len,
        "chunk_size": cfg.evaluation.chunk_size, "setup_s": round(setup_s, 1), "pass_s": round(pass_s, 1),
        "stride": args.stride, "row_order": args.row_order, "cpu_s": round(cpu_s, 1),
        "users_per_s": round(users / pass_s, 1), "full_pass_projected_s": round(n_test * pass_s / max(users, 1), 1),
        "batch_s_min": round(min(batch_times), 3), "batch_s_median": round(statistics.median(batch_times), 3),
        "rss_before_mb": round(baseline_rss / 1024), "peak_before_mb": round(baseline_hwm / 1024),
        "peak_during_pass_mb": round(peak_kb / 1024) if reset else None,
        "pass_added_mb": round((peak_kb - baseline_rss) / 1024) if reset else None,
        "rss_after_mb": round(rss_after / 1024), "metrics": metrics,
    }
    print(f"# {args.experiment}, {'a sampled validation' if args.sample else 'the test'} pass: {users:,} of {n_test:,} users x {task.n_items:,} items, eval batch "
          f"{data.eval_batch_size}, max_seq_len {data.max_seq_len}, chunk {cfg.evaluation.chunk_size}, "
          f"{args.threads} threads")
    print(f"# pass {pass_s:.1f} s, CPU {cpu_s:.1f} s ({users / pass_s:.0f} users/s; all {n_test:,}: "
          f"{result['full_pass_projected_s']:.0f} s), peak RSS {result['peak_during_pass_mb']} MB during the pass "
          f"(+{result['pass_added_mb']} MB over the {result['rss_before_mb']} MB before it)")
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DLRM's tables split across processes (``hardware=model_parallel*``, issue 19): what each rank
holds, and what splitting costs in speed.

1. A memory projection, printed from the model's own shapes: a DLRM built with
   ``lazy_tables=true`` (tables on the meta device, nothing allocated) for a configuration's table
   sizes, and for each world size the rows a rank keeps (``row_range``: ``torch.chunk``'s split of
   the one combined table), their bytes, the row-wise Adagrad accumulator beside them, and the
   dense layers with their Adagrad state, which every rank holds whole. Configurations:
   ``mlperf_dcnv2`` (DLRM-DCNv2 of MLPerf Training: 26 tables of Criteo 1TB capped at 40M rows,
   204.2M rows in all, dimension 128; the sizes TorchRec's DLRM-v2 example passes as
   ``--num_embeddings_per_feature``) and ``kaggle`` (the Kaggle tables, 33.8M rows, dimension 16).
2. A measured run (``--measure``): ``src/train.py model=dlrm`` on synthetic Criteo rows with the
   Kaggle-shaped tables, ``hardware=model_parallel_cpu`` at 1 and 2 processes (alternating,
   ``--rounds``), each process ``--threads`` threads: the training samples/s of the run
   (``train/events_per_s`` in its metrics.json: every rank of a table-sharding group steps through
   the same batches, so this is the group's rate) and each rank's local table rows, read back
   from the run's checkpoint metadata. On one 2-core machine the two processes share the cores,
   so the figure says what the split costs here, not what it gives on two machines or GPUs.

    python benchmarks/sharded_tables.py                       # the projection only
    python benchmarks/sharded_tables.py --measure --rounds 2  # and the CPU runs
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# DLRM-DCNv2 (MLPerf Training v2.0+): Criteo 1TB's 26 tables capped at 40M rows (TorchRec's
# examples/golden_training / dlrm_main --num_embeddings_per_feature for the MLPerf run)
MLPERF_TABLES = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
                 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
CONFIGS = {
    "mlperf_dcnv2": dict(embedding_dim=128, dense_arch=[512, 256], over_arch=[1024, 1024, 512, 256],
                         interaction="dcnv2", dcn_layers=3, dcn_rank=512),
    "kaggle": dict(embedding_dim=16, dense_arch=[512, 256, 64], over_arch=[512, 256], interaction="dot"),
}


def _tables(name: str) -> list[int]:
    if name == "mlperf_dcnv2":
        return list(MLPERF_TABLES)
    from recforge.data.criteo.fullsize import KAGGLE_CARDINALITIES

    return list(KAGGLE_CARDINALITIES)


def projection(name: str, worlds: list[int]) -> list[dict]:
    """Per-rank bytes at each world size, from a lazily built model's shapes."""
    import torch

    from recforge.distributed.sharded_table import row_range
    from recforge.models.dlrm import DLRM

    model = DLRM(_tables(name), **CONFIGS[name], lazy_tables=True)
    rows, dim = model.sparse_arch.embedding.weight.shape
    itemsize = model.sparse_arch.embedding.weight.element_size()
    table_ids = {id(p) for p in model.sparse_parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in table_ids)
    out = []
    for world in worlds:
        start, end = row_range(rows, world, 0)  # rank 0 holds the most rows
        local = end - start
        out.append({
            "config": name, "world": world, "table_rows": int(rows), "dim": int(dim), "rank_rows": local,
            "rank_table_gb": local * dim * itemsize / 1e9,
            "rank_rowwise_adagrad_gb": local * torch.finfo(torch.float32).bits / 8 / 1e9,
            "dense_gb": dense * itemsize * 2 / 1e9,  # weights + Adagrad's sum, on every rank
        })
    for row in out:
        row["rank_total_gb"] = row["rank_table_gb"] + row["rank_rowwise_adagrad_gb"] + row["dense_gb"]
    return out


def measure(world: int, args, work: Path) -> dict:
    log_dir = work / f"w{world}-{len(list(work.glob(f'w{world}-*')))}"
    tables = ",".join(str(n) for n in _tables("kaggle"))
    cmd = [sys.executable, "src/train.py", "model=dlrm", "hardware=model_parallel_cpu", f"trainer.devices={world}",
           f"++data.generator.cardinalities=[{tables}]",
           f"trainer.strategy.tensor_parallel_size={world}", "model.lazy_tables=true", "optimizer=rowwise_adagrad",
           f"data.generator.n_rows={args.rows}", f"data.batch_size={args.batch_size}", "trainer.max_epochs=1",
           f"trainer.limit_train_batches={args.steps}", "trainer.limit_val_batches=0", "test=false",
           "~callbacks.early_stopping", "callbacks.progress_bar.refresh_rate=0", "extras.print_config=false",
           f"paths.log_dir={log_dir}", f"paths.data_dir={args.data_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"world {world} failed:\n{done.stderr[-3000:]}")
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    from torch.distributed.checkpoint import FileSystemReader

    last = run_dir / "checkpoints" / "last.ckpt"
    stored = FileSystemReader(str(last)).read_metadata().state_dict_metadata
    table = stored["state_dict.model.sparse_arch.embedding.weight"]
    rank_rows = sorted(int(chunk.sizes[0]) for chunk in table.chunks)
    return {"world": world, "samples_per_s": metrics["train/events_per_s"], "rank_rows": rank_rows,
            "table_rows": int(table.size[0])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="mlperf_dcnv2,kaggle")
    p.add_argument("--worlds", default="1,2,8,16", help="world sizes of the projection")
    p.add_argument("--measure", action="store_true", help="also run world 1 and 2 on this CPU")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--rows", type=int, default=200_000, help="synthetic training rows")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument("--data-dir", type=Path, default=REPO / "data" / "bench")
    args = p.parse_args(argv)

    worlds = [int(w) for w in args.worlds.split(",")]
    print("| config | world | table rows | rows on a rank | table GB / rank | row-wise Adagrad GB / rank "
          "| dense + Adagrad GB (every rank) | total GB / rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        for row in projection(name, worlds):
            print(f"| {name} | {row['world']} | {row['table_rows']:,} | {row['rank_rows']:,} | "
                  f"{row['rank_table_gb']:.2f} | {row['rank_rowwise_adagrad_gb']:.3f} | {row['dense_gb']:.3f} | "
                  f"{row['rank_total_gb']:.2f} |")
    if not args.measure:
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="recforge-sharded-") as tmp:
        for _ in range(args.rounds):
            for world in (1, 2):
                runs.append(measure(world, args, Path(tmp)))
                print(json.dumps(runs[-1]), flush=True)
    for world in (1, 2):
        rates = [r["samples_per_s"] for r in runs if r["world"] == world]
        rows = next(r["rank_rows"] for r in runs if r["world"] == world)
        print(f"world {world}: samples/s min {min(rates):,.0f} median {statistics.median(rates):,.0f} "
              f"({len(rates)} runs, {args.threads} thread(s) per process); table rows per rank {rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

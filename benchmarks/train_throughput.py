#!/usr/bin/env python
"""Training throughput of any experiment through recforge's real code path, at two levels.

The config is composed as ``src/train.py`` composes it (``train.yaml`` + ``experiment=X`` + the
overrides), and ``recforge.pipeline.build`` makes the data module and the task. Then:

* ``lightning``: ``Trainer.fit`` (one epoch, ``limit_train_batches``, no validation, logger,
  checkpoints or progress bar), clocked by a callback;
* ``bare``: the same data module and task in a plain loop: the task's public ``train_loss``,
  ``backward``, the optimizer (and scheduler) from its ``configure_optimizers``, its clipping, and
  ``on_train_epoch_start`` at each epoch start (GRU4Rec resets its hidden state there).

Every level is timed in ``--windows`` windows, alternating level by level so load from other jobs
hits both alike. A window starts a fresh epoch, runs ``--lead`` untimed updates, then ``--steps``
timed updates (default: as many as fill ``--window-seconds``, judged from an untimed warm-up
window). Evaluation (``test_step`` over the test split, or ``--eval-batches``) is timed the same
way unless ``--no-eval``. Reported, for every family alike: the rate in the family's unit
(GRU4Rec events, SASRec/HSTU sequences, DLRM samples) and in updates per second, min and median
over the windows, the threads, and the overrides the config was composed from (one JSON line at
the end also has every window's value).

When the command names no data (no ``data=`` or ``data.*_path`` override), the experiment runs on
a stand-in: the YooChoose 100k sample for rsc15, the ml-1m prefix (reference protocol) for ml-1m,
both under ``paths.shared_data_dir`` (``$RECFORGE_SHARED_DATA`` or ``../shared/data``), and
synthetic Criteo rows with Criteo Kaggle's table sizes (uniform ids, nothing missing) for the
Criteo datasets.

    python benchmarks/train_throughput.py --experiment gru4rec_rsc15_xe
    python benchmarks/train_throughput.py --experiment sasrec_ml-1m --level bare
    python benchmarks/train_throughput.py --experiment dlrm_criteo_kaggle --batch-size 2048 \\
        --override data.multi_hot=mlperf --device cuda
    python benchmarks/train_throughput.py --experiment gru4rec_rsc15_bprmax --override data=synthetic \\
        --override data.generator.n_items=20000 --override data.generator.n_sessions=100000

A measurement tool, not a test: nothing here asserts on a timing.
"""
from __future__ import annotations

import argparse
import json
import logging
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

# facebookresearch/dlrm's per-feature counts on Criteo Kaggle without max-ind-range (spec §2)
KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# The reference's own benchmark draws one uniform id per table and no missing values; 200,000 rows
# (140,000 for training) fill a window of a few seconds at any batch size here.
_KAGGLE_STAND_IN = [
    "data=synthetic_criteo",
    f"++data.generator.cardinalities=[{','.join(map(str, KAGGLE_CARDINALITIES))}]",
    "++data.generator.zipf_exponent=0",
    f"++data.generator.sparse_missing=[{','.join(['0'] * 26)}]",
    f"++data.generator.dense_missing=[{','.join(['0'] * 13)}]",
    "data.generator.n_rows=200000",
]
# data config -> overrides used when the command names no data of its own
STAND_IN_DATA = {
    "rsc15": [
        "data.train_path=${paths.shared_data_dir}/yoochoose/yoochoose-clicks-100k_train_full.txt",
        "data.test_path=${paths.shared_data_dir}/yoochoose/yoochoose-clicks-100k_test.txt",
    ],
    "ml-1m": ["data.ratings_path=${paths.shared_data_dir}/ml-1m/ratings.partial.dat.gz", "data.protocol=reference"],
    "criteo_kaggle": _KAGGLE_STAND_IN,
    "criteo_terabyte": _KAGGLE_STAND_IN,
}
# what one row of each batch type is
UNITS = {"SessionStep": "events", "HistoryBatch": "sequences", "CTRBatch": "samples"}
LEVELS = ("lightning", "bare")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", required=True, help="a conf/experiment preset, e.g. gru4rec_rsc15_xe")
    p.add_argument("--level", default="lightning,bare", help="lightning, bare, or both (comma-separated)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="Hydra override, repeatable (e.g. loss.kernel=triton, task.n_sample=0)")
    p.add_argument("--batch-size", type=int, default=None, help="data.batch_size (default: the config's)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (and OMP/MKL)")
    p.add_argument("--omp-wait-policy", choices=("ACTIVE", "PASSIVE"), default=None,
                   help="OMP_WAIT_POLICY (default: unset); PASSIVE stops idle OpenMP threads spinning "
                   "when other jobs share the cores")
    p.add_argument("--windows", type=int, default=5, help="timed windows per level")
    p.add_argument("--steps", type=int, default=None,
                   help="timed updates per window (default: as many as fill --window-seconds)")
    p.add_argument("--window-seconds", type=float, default=2.0)
    p.add_argument("--lead", type=int, default=2, help="untimed updates at the start of every window")
    p.add_argument("--warmup", type=int, default=10, help="updates of the untimed warm-up window")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation windows")
    p.add_argument("--no-train", action="store_true",
                   help="evaluation windows only: no update runs, so the process's peak memory is the "
                        "evaluation's own (no gradients or optimizer state)")
    p.add_argument("--eval-batches", type=int, default=0, help="test batches per evaluation window (0: all)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: hardware=gpu, and every window ends after a device synchronise")
    p.add_argument("--data-dir", default=str(REPO / "data" / "bench"),
                   help="paths.data_dir: where prepared and synthetic data are kept between runs")
    args = p.parse_args(argv)
    args.level = [v.strip() for v in args.level.split(",") if v.strip()]
    if not args.level or any(v not in LEVELS for v in args.level):
        p.error(f"--level: expected {' or '.join(LEVELS)} (comma-separated), got {','.join(args.level)!r}")
    for name in ("windows", "threads", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps: expected an integer >= 1, got {args.steps}")
    if args.no_train and args.no_eval:
        p.error("--no-train with --no-eval measures nothing: drop one of them")
    return args


# ----------------------------------------------------------------------------------- config
def _names_data(overrides: list[str]) -> bool:
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return any(k == "data" or (k.startswith("data.") and k.endswith(("_path", "prepared_dir"))) for k in keys)


def compose_config(args, workdir: Path):
    """The run's config, the overrides it was composed from, and the data config's name."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    given = [
        *(["hardware=gpu"] if args.device == "cuda" else []),
        *([f"data.batch_size={args.batch_size}"] if args.batch_size else []),
        *args.override,
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        experiment = [f"experiment={args.experiment}"]
        data = compose("train", overrides=experiment + given, return_hydra_config=True).hydra.runtime.choices.data
        stand_in = [] if _names_data(args.override) else STAND_IN_DATA.get(data, [])
        overrides = experiment + stand_in + given
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(workdir)
        cfg.paths.root_dir = str(REPO)
        cfg.paths.output_dir = str(workdir)
        cfg.paths.log_dir = str(workdir / "logs")
        cfg.paths.data_dir = str(Path(args.data_dir).resolve())
    HydraConfig.instance().set_config(cfg)  # the pipeline's config check reads the group choices
    return cfg, overrides, cfg.hydra.runtime.choices.data


# ----------------------------------------------------------------------------------- windows
class WindowClock:
    """Rows and updates of the batches from index ``lead`` on, and the wall time from the start
    of batch ``lead`` to the end of the last one; ``sync`` waits for the device's queued work."""

    def __init__(self, lead: int, sync) -> None:
        self.lead, self.sync = lead, sync
        self.rows = self.updates = 0
        self.t0 = self.t1 = None

    def batch_start(self, index: int) -> None:
        if index == self.lead:
            self.sync()
            self.t0 = time.perf_counter()

    def batch_end(self, batch, index: int, last: bool = True) -> None:
        if index < self.lead:
            return
        self.rows += int(batch.size)
        self.updates += int(getattr(batch, "n_steps", 1))  # a grouped batch holds several updates
        if last:
            self.stop()
        else:  # a window cut short by the epoch's end still has an end
            self.t1 = time.perf_counter()

    def stop(self) -> None:
        self.sync()
        self.t1 = time.perf_counter()

    def result(self) -> tuple[int, int, float]:
        if self.t0 is None or self.t1 is None:
            return 0, 0, 0.0
        return self.rows, self.updates, self.t1 - self.t0


def _clock_callback(clock: WindowClock, last_index: int | None):
    """The clock as a Lightning callback over training or test batches; ``last_index`` None
    synchronises after every batch (an evaluation's length is not known in advance)."""
    import lightning as L

    class Clocked(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.batch_start(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.batch_end(batch, batch_idx, last_index in (None, batch_idx))

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            clock.batch_start(batch_idx)

        def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            clock.batch_end(batch, batch_idx, last_index in (None, batch_idx))

    return Clocked()


def _trainer(cfg, callback, **limits):
    from hydra.utils import instantiate

    return instantiate(
        cfg.trainer, callbacks=[callback], logger=False, max_epochs=1, min_epochs=1, limit_val_batches=0,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, **limits,
    )


class Level:
    """One level's data module and task, and its training and evaluation windows."""

    def __init__(self, name: str, cfg, device) -> None:
        from timing import synchronize

        from recforge.pipeline import build

        self.name, self.cfg, self.device = name, cfg, device
        self.sync = functools.partial(synchronize, device)
        self.datamodule, self.task = build(cfg)
        self.datamodule.setup("fit")
        self.datamodule.setup("test")
        if name == "bare":  # the Lightning level is moved by its Trainer
            self.task.to(device)
            configured = self.task.configure_optimizers()
            if isinstance(configured, dict):
                self.optimizer, self.scheduler = configured["optimizer"], configured["lr_scheduler"]
            else:
                self.optimizer, self.scheduler = configured, None

    def train_window(self, lead: int, steps: int) -> tuple[int, int, float]:
        return (self._fit if self.name == "lightning" else self._loop)(lead, steps)

    def eval_window(self, max_batches: int) -> tuple[int, int, float]:
        return (self._test if self.name == "lightning" else self._eval_loop)(max_batches)

    def _fit(self, lead: int, steps: int) -> tuple[int, int, float]:
        # lead and steps count updates; the Trainer counts Lightning batches, which may group several
        per_batch = int(getattr(self.datamodule, "steps_per_batch", 1))
        lead, steps = -(-lead // per_batch), -(-steps // per_batch)
        clock = WindowClock(lead, self.sync)
        trainer = _trainer(self.cfg, _clock_callback(clock, lead + steps - 1), limit_train_batches=lead + steps)
        trainer.fit(self.task, datamodule=self.datamodule)
        self.optimizer = trainer.optimizers[0]  # kept for state_bytes: its state is the run's
        return clock.result()

    def state_bytes(self) -> dict:
        """Bytes the task holds: its parameters (embedding tables included) and, once a window has
        trained, the optimizer's state (moments, row-wise accumulators)."""
        import torch

        def tensor_bytes(value) -> int:
            if isinstance(value, torch.Tensor):
                return value.numel() * value.element_size()
            if isinstance(value, dict):
                return sum(tensor_bytes(v) for v in value.values())
            if isinstance(value, (list, tuple)):
                return sum(tensor_bytes(v) for v in value)
            return 0

        optimizer = getattr(self, "optimizer", None)
        return {"parameters": sum(p.numel() * p.element_size() for p in self.task.parameters()),
                "optimizer_state": None if optimizer is None else tensor_bytes(optimizer.state_dict()["state"])}

    def epoch_size(self) -> dict:
        """Updates in one training epoch and batches in the test split, where the loaders know
        their length (a projected time is their count over their rate per second)."""
        sizes = {}
        per_batch = int(getattr(self.datamodule, "steps_per_batch", 1))
        for key, loader, scale in (("train_updates", self.datamodule.train_dataloader(), per_batch),
                                   ("test_batches", self.datamodule.test_dataloader(), 1)):
            try:
                sizes[key] = len(loader) * scale
            except TypeError:  # an iterable dataset of unknown length
                sizes[key] = None
        return sizes

    def _loop(self, lead: int, steps: int) -> tuple[int, int, float]:
        task, optimizer = self.task, self.optimizer
        task.train()
        task.on_train_epoch_start()
        clock = WindowClock(lead, self.sync)
        updates = (u for batch in self.datamodule.train_dataloader() for u in getattr(batch, "steps", (batch,)))
        for index, batch in enumerate(updates):
            batch = batch.to(self.device, non_blocking=True)
            clock.batch_start(index)
            loss = task.train_loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if task.gradient_clip_val:
                task.configure_gradient_clipping(optimizer, task.gradient_clip_val, task.gradient_clip_algorithm)
            optimizer.step()
            if self.scheduler is not None and task.scheduler_interval == "step":
                self.scheduler.step()
            last = index + 1 == lead + steps
            clock.batch_end(batch, index, last)
            if last:
                break
        return clock.result()

    def _test(self, max_batches: int) -> tuple[int, int, float]:
        clock = WindowClock(0, self.sync)
        trainer = _trainer(self.cfg, _clock_callback(clock, None), **({"limit_test_batches": max_batches} if max_batches else {}))
        trainer.test(self.task, datamodule=self.datamodule, verbose=False)
        return clock.result()

    def _eval_loop(self, max_batches: int) -> tuple[int, int, float]:
        import torch

        task = self.task
        task.eval()
        task.on_test_epoch_start()
        clock = WindowClock(0, self.sync)
        with torch.inference_mode():
            for index, batch in enumerate(self.datamodule.test_dataloader()):
                if max_batches and index >= max_batches:
                    break
                batch = batch.to(self.device, non_blocking=True)
                clock.batch_start(index)
                task.test_step(batch, index)
                clock.batch_end(batch, index, last=False)
            task.evaluation.compute_and_reset("test")  # what on_test_epoch_end does, minus the logging
        clock.stop()
        task.train()
        return clock.result()


def sampler_fill(task) -> dict | None:
    """Seconds to fill one negative-sample store like the task's: the windows are far shorter than
    one store, so its cost is reported apart, amortised per update (GRU4Rec's popularity sampler)."""
    if int(getattr(task, "n_sample", 0) or 0) <= 0:
        return None
    from recforge.data.negatives import PopularitySampler

    sampler = PopularitySampler(task.popularity.cpu(), task.n_sample, task.sample_alpha, task.sample_store_size, seed=0)
    start = time.perf_counter()
    sampler.sample()  # the first draw fills the store
    seconds = time.perf_counter() - start
    return {"fill_s": round(seconds, 3), "updates_per_fill": sampler.rows,
            "amortised_ms_per_update": round(1000 * seconds / sampler.rows, 3)}


# ----------------------------------------------------------------------------------- driver
def _rate(count: int, seconds: float, what: str) -> float:
    if seconds <= 0:
        raise SystemExit(f"a {what} window timed nothing: the epoch is shorter than --lead + 1 updates "
                         "(or the test split is empty); lower --lead or give more data")
    return count / seconds


def measure(args, cfg, log) -> dict:
    import torch
    from timing import summary

    device = torch.device(args.device)
    levels = {name: Level(name, cfg, device) for name in args.level}
    first = levels[args.level[0]]
    unit = UNITS.get(first.task.batch_type.__name__, "rows")
    rates = {name: {f"train_{unit}_per_s": [], "train_updates_per_s": [], f"eval_{unit}_per_s": [],
                    "eval_batches_per_s": []} for name in levels}
    steps = 0
    if args.no_train:  # warm-up (untimed): the evaluation's code paths and buffers
        for level in levels.values():
            level.eval_window(2)
        log(f"# unit: {unit}; evaluation only (--no-train)")
    else:
        # warm-up (untimed): allocator, optimizer state, code paths; its pace sets the window length
        paces = []
        for level in levels.values():
            rows, updates, seconds = level.train_window(args.lead, args.warmup)
            paces.append(seconds / max(updates, 1))
            if not args.no_eval:
                level.eval_window(2)
        steps = args.steps or max(1, round(args.window_seconds / max(min(paces), 1e-9)))
        log(f"# unit: {unit}; data.batch_size={first.datamodule.batch_size}; windows of {steps} timed updates "
            f"after {args.lead} untimed ({'given' if args.steps else f'~{args.window_seconds:g} s from the warm-up'})")
        for _ in range(args.windows):
            for name, level in levels.items():
                rows, updates, seconds = level.train_window(args.lead, steps)
                if updates < steps:
                    log(f"#   note: a {name} window ran {updates} of {steps} updates (the epoch ended)")
                rates[name][f"train_{unit}_per_s"].append(_rate(rows, seconds, f"{name} training"))
                rates[name]["train_updates_per_s"].append(updates / seconds)
    if not args.no_eval:
        for _ in range(args.windows):
            for name, level in levels.items():
                rows, batches, seconds = level.eval_window(args.eval_batches)
                rates[name][f"eval_{unit}_per_s"].append(_rate(rows, seconds, f"{name} evaluation"))
                rates[name]["eval_batches_per_s"].append(batches / seconds)
    return {"unit": unit, "steps": steps, "sampler_store": None if args.no_train else sampler_fill(first.task),
            "epoch": first.epoch_size(), "state_bytes": first.state_bytes(),
            "levels": {name: {k: summary(v) for k, v in r.items() if v} for name, r in rates.items()}}


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def table(result: dict) -> str:
    unit = result["unit"]
    columns = [(f"train_{unit}_per_s", f"train {unit}/s"), ("train_updates_per_s", "updates/s"),
               (f"eval_{unit}_per_s", f"eval {unit}/s")]
    head = ["level"] + [f"{title} {stat}" for _, title in columns for stat in ("min", "median")]
    lines = []
    for name, stats in result["levels"].items():
        cells = [name]
        for key, _ in columns:
            cells += [_figure(stats[key][s]) if key in stats else "-" for s in ("min", "median")]
        lines.append(cells)
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in [head, *lines])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # before torch is imported: OpenMP reads these when it loads
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import lightning as L
    import torch
    from omegaconf import OmegaConf
    from timing import cpu_model, load_average

    from recforge.errors import UserInputError
    from recforge.utils.allocator import apply_malloc_policy
    from recforge.utils.quiet import silence_known_noise

    torch.set_num_threads(args.threads)
    silence_known_noise()
    for name in ("lightning.pytorch", "lightning.fabric"):  # a Trainer per window: its banners, each time
        logging.getLogger(name).setLevel(logging.WARNING)

    def log(message: str) -> None:
        print(message, flush=True)

    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="recforge-bench-") as tmp:
        cfg, overrides, data = compose_config(args, Path(tmp))
        log(f"# train_throughput {args.experiment} (data: {data}); overrides: {' '.join(overrides)}")
        # as a run does (extras.malloc; --override extras.malloc=default for glibc's defaults)
        malloc = apply_malloc_policy(cfg.extras.malloc)
        log(f"# {malloc}")
        log(f"# torch {torch.__version__}, lightning {L.__version__}, {args.device}, {torch.get_num_threads()} "
            f"threads (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}); CPU {cpu_model()}; "
            f"load average {load_start}")
        used = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("data", "model", "loss", "optimizer", "task")}
        L.seed_everything(cfg.seed, verbose=False)
        try:
            result = measure(args, cfg, log)
        except UserInputError as error:
            print(f"recforge: {error}", file=sys.stderr)
            return 2
    load_end = load_average()
    log(table(result))
    if result["sampler_store"]:
        store = result["sampler_store"]
        log(f"# negative-sample store: {store['fill_s']:.2f} s per fill, every {store['updates_per_fill']:,} "
            f"updates = {store['amortised_ms_per_update']:.2f} ms per update amortised (outside the windows)")
    log(f"# load average at end: {load_end} (other jobs on the box skew the min)")
    print(json.dumps({
        "benchmark": "train_throughput", "experiment": args.experiment, "overrides": overrides, "data": data,
        "device": args.device, "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "malloc": malloc,
        "torch": torch.__version__, "lightning": L.__version__, "cpu": cpu_model(),
        "load_average": {"start": load_start, "end": load_end}, "windows": args.windows, "lead": args.lead,
        "warmup": None if args.no_train else args.warmup, "trained": not args.no_train,
        "eval_batches": None if args.no_eval else (args.eval_batches or "all"), **result,
        "config": used,
    }, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

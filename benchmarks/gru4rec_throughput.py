#!/usr/bin/env python
"""Training and evaluation throughput of recforge's GRU4Rec on CPU, through the real code paths.

Two levels, per dataset x loss config x batch size:

* ``lightning``: the Hydra config composed with the compose API, the data module and task built by
  ``recforge.pipeline.build``, and ``trainer.fit`` / ``trainer.test`` timed by a small callback;
* ``bare``: the same data module and task, but the step loop written out by hand
  (the task's loss + ``backward`` + optimizer step, ``task.test_step`` under inference mode),
  to show what the Lightning loop costs on top.

Every figure is measured in several windows (after an untimed warm-up) and reported as min and median:
the machine is shared and noisy, a single timing means nothing. Output: a header (torch version,
threads, CPU, dataset sizes), an aligned table and one JSON line.

Usage (from the repo root)::

    python benchmarks/gru4rec_throughput.py                      # defaults: 5 windows x 300 steps
    python benchmarks/gru4rec_throughput.py --windows 3 --steps 200 --datasets yoochoose
    RECFORGE_SHARED_DATA=/path/to/data python benchmarks/gru4rec_throughput.py --configs xe

This is a measurement tool, not a test: nothing here asserts on a timing.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

# Configurations: the published presets (spec §2), the same ones the reference figures used:
# xe = rsc15_xe_shared_100_best, bprmax = the constrained bpr-max sample parameters.
CONFIGS: dict[str, list[str]] = {
    "xe": ["experiment=gru4rec_rsc15_xe"],
    "bprmax": ["experiment=gru4rec_rsc15_bprmax"],
}
# Always on: hidden 100, no loggers or callbacks (the timing callback is added by this script).
COMMON_OVERRIDES = ["model=gru4rec", "model.hidden_size=100", "~logger", "callbacks=none"]

YOOCHOOSE_FILES = ("yoochoose-clicks-100k_train_full.txt", "yoochoose-clicks-100k_test.txt")

# Reference: the official PyTorch GRU4Rec on this 2-core box, spec §4 (2 threads, batch 32, 100
# units, 2048 extra negative samples, 37,483-item synthetic catalogue).
REFERENCE = {
    "xe": {"train_events_per_s": 5080.0, "train_batches_per_s": 158.8, "eval_events_per_s": 60000 / 10.9},
    "bprmax": {"train_events_per_s": 4724.0, "train_batches_per_s": 147.6, "eval_events_per_s": 60000 / 11.3},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (and OMP/MKL)")
    p.add_argument(
        "--omp-wait-policy",
        choices=("ACTIVE", "PASSIVE"),
        default=None,
        help="set OMP_WAIT_POLICY (default: leave it): PASSIVE stops idle OpenMP threads spinning, "
        "which softens the collapse of a 2-thread run when another job shares the 2 cores",
    )
    p.add_argument("--windows", type=int, default=5, help="measurement windows per figure")
    p.add_argument("--steps", type=int, default=300, help="training steps timed per window")
    p.add_argument("--warmup", type=int, default=50, help="untimed training steps before the windows")
    p.add_argument(
        "--lead",
        type=int,
        default=5,
        help="untimed steps at the start of every window (each window is a fresh epoch start)",
    )
    p.add_argument("--configs", default="xe,bprmax", help=f"comma-separated, from {sorted(CONFIGS)}")
    p.add_argument("--batch-sizes", default="32", help="comma-separated training batch sizes")
    p.add_argument(
        "--datasets", default="yoochoose,synthetic", help="comma-separated: yoochoose, synthetic"
    )
    p.add_argument(
        "--levels", default="lightning,bare", help="comma-separated: lightning, bare"
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=0,
        help="test batches per evaluation window (0: the whole test set)",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation windows")
    p.add_argument(
        "--n-sample",
        type=int,
        default=None,
        help="extra negative samples per mini-batch (task.n_sample); default: the config's value",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: hardware=gpu for the Lightning level, the bare level moved to the GPU, and the "
        "windows timed after a device synchronise",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every run, repeatable (e.g. loss.kernel=triton)",
    )
    p.add_argument(
        "--steps-per-batch",
        type=int,
        default=None,
        help="mini-batches per Lightning batch (data.steps_per_batch); default: the config's value",
    )
    p.add_argument("--synthetic-items", type=int, default=20000)
    p.add_argument("--synthetic-sessions", type=int, default=100000)
    p.add_argument(
        "--cache-dir",
        default=str(REPO / "data" / "synthetic"),
        help="where the synthetic dataset is written once and reused (keyed by its config)",
    )
    args = p.parse_args(argv)
    args.configs = _csv(args.configs, CONFIGS, "--configs")
    args.datasets = _csv(args.datasets, ("yoochoose", "synthetic"), "--datasets")
    args.levels = _csv(args.levels, ("lightning", "bare"), "--levels")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.windows < 1 or args.steps < 1 or args.threads < 1 or not args.batch_sizes:
        p.error("--windows, --steps, --threads must be >= 1 and --batch-sizes non-empty")
    return args


def _csv(value: str, allowed, flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown {bad or value!r}; choose from {sorted(allowed)}")
    return items


def fix_threads(n: int, wait_policy: str | None = None) -> None:
    """Pin the thread count; must run before torch is imported for the env vars to count."""
    if wait_policy:
        os.environ["OMP_WAIT_POLICY"] = wait_policy
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)


def quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "recforge"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*self.log\\(\\)` but the `self.trainer`.*")
    warnings.filterwarnings("ignore", message=".*number of training batches.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*Total length of .* across ranks is zero.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    warnings.filterwarnings("ignore", message=".*Sparse invariant checks are implicitly disabled.*")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------- datasets
def datasets(args) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """Dataset name -> (train_path, test_path); and name -> reason for those skipped."""
    found, skipped = {}, {}
    if "yoochoose" in args.datasets:
        shared = Path(os.environ.get("RECFORGE_SHARED_DATA") or REPO.parent / "shared" / "data")
        train, test = (shared / "yoochoose" / f for f in YOOCHOOSE_FILES)
        missing = [str(p) for p in (train, test) if not p.is_file()]
        if missing:
            skipped["yoochoose"] = f"not found: {', '.join(missing)} (set RECFORGE_SHARED_DATA)"
        else:
            found["yoochoose"] = (str(train), str(test))
    if "synthetic" in args.datasets:
        from recforge.data.sessions.synthetic import SyntheticSessionsConfig, write_synthetic_dataset

        gen = SyntheticSessionsConfig(n_items=args.synthetic_items, n_sessions=args.synthetic_sessions)
        t0 = time.perf_counter()
        paths = write_synthetic_dataset(gen, args.cache_dir)
        took = time.perf_counter() - t0
        if took > 1.0:
            print(f"# synthetic dataset written in {took:.1f} s: {paths['train_full'].parent}")
        found[f"synthetic-{args.synthetic_items // 1000}k"] = (
            str(paths["train_full"]),
            str(paths["test"]),
        )
    return found, skipped


def describe(train_path: str, test_path: str, batch_sizes: list[int]) -> dict:
    from recforge.data.sessions.datamodule import SessionDataModule
    from recforge.data.sessions.parallel import count_steps

    dm = SessionDataModule(train_path, test_path)
    train, test = dm.split("train"), dm.split("test")
    steps = {
        b: count_steps(train.offsets, train.order, b, 2) for b in batch_sizes
    }  # min_rows=2: in-batch negatives only
    return {
        "items": dm.catalog.n_items,
        "train_events": train.n_events,
        "train_sessions": train.n_sessions,
        "train_targets": train.n_targets,
        "test_events": test.n_events,
        "test_sessions": test.n_sessions,
        "test_targets": test.n_targets,
        "steps_per_epoch": steps,
    }


# ----------------------------------------------------------------------------------- config
def compose_config(
    train_path: str, test_path: str, config: str, batch_size: int, workdir: Path, n_sample=None,
    steps_per_batch=None, extra: tuple[str, ...] = (),
):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    overrides = [
        "data=rsc15",
        f"data.train_path={train_path}",
        f"data.test_path={test_path}",
        f"data.batch_size={batch_size}",
        *COMMON_OVERRIDES,
        *CONFIGS[config],
    ]
    if n_sample is not None:
        overrides.append(f"task.n_sample={n_sample}")
    if steps_per_batch is not None:
        overrides.append(f"data.steps_per_batch={steps_per_batch}")
    overrides.extend(extra)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(workdir)
        cfg.paths.root_dir = str(REPO)
        cfg.paths.output_dir = str(workdir)
        cfg.paths.log_dir = str(workdir / "logs")
        cfg.paths.data_dir = str(workdir / "data")
    # recforge.pipeline reads the config-group choices from Hydra (check_combination).
    HydraConfig.instance().set_config(cfg)
    return cfg


def build(cfg):
    import lightning as L

    from recforge.pipeline import build as pipeline_build

    L.seed_everything(cfg.seed, verbose=False)
    return pipeline_build(cfg)


def _synchronize() -> None:
    """Wait for queued GPU work, so a clock read after it covers it (no-op on CPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------- lightning
def _window_timer(lead: int, last: int | None = None):
    """``last``: the final batch index, after which the clock waits for the GPU (None: every
    batch, for evaluation windows whose length is not known in advance)."""
    import lightning as L

    class WindowTimer(L.Callback):
        """Time from on_*_batch_start of batch ``lead`` to on_*_batch_end of the last batch."""

        def __init__(self) -> None:
            self.events = 0
            self.batches = 0
            self.t0: float | None = None
            self.t1: float | None = None

        def _start(self, batch_idx: int) -> None:
            if batch_idx == lead:
                _synchronize()
                self.t0 = time.perf_counter()

        def _end(self, batch, batch_idx: int) -> None:
            if batch_idx >= lead:
                self.events += int(batch.size)
                # mini-batches: a grouped Lightning batch (data.steps_per_batch) holds several
                self.batches += int(getattr(batch, "n_steps", 1))
                if last is None or batch_idx == last:
                    _synchronize()
                self.t1 = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._end(batch, batch_idx)

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self._start(batch_idx)

        def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self._end(batch, batch_idx)

        def result(self) -> tuple[int, int, float]:
            if self.t0 is None or self.t1 is None:
                return 0, 0, 0.0
            return self.events, self.batches, self.t1 - self.t0

    return WindowTimer()


def _trainer(cfg, callbacks, **limits):
    from hydra.utils import instantiate

    return instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=False,
        max_epochs=1,
        min_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **limits,
    )


def lightning_train(cfg, task, dm, lead: int, steps: int) -> tuple[int, int, float]:
    # lead and steps count mini-batches; the Trainer counts (possibly grouped) Lightning batches
    per_batch = int(getattr(dm, "steps_per_batch", 1))
    lead, steps = -(-lead // per_batch), -(-steps // per_batch)
    timer = _window_timer(lead, last=lead + steps - 1)
    trainer = _trainer(cfg, [timer], limit_train_batches=lead + steps)
    trainer.fit(task, datamodule=dm)
    return timer.result()


def lightning_eval(cfg, task, dm, max_batches: int) -> tuple[int, int, float]:
    # lead=0: the first test batch is timed from its on_test_batch_start (loader set up already).
    timer = _window_timer(0)
    limits = {"limit_test_batches": max_batches} if max_batches else {}
    trainer = _trainer(cfg, [timer], **limits)
    trainer.test(task, datamodule=dm, verbose=False)
    return timer.result()


# ----------------------------------------------------------------------------------- bare loop
def bare_train(task, dm, optimizer, lead: int, steps: int) -> tuple[int, int, float]:
    task.train()
    task.on_train_epoch_start()  # a fresh epoch: hidden state reset, like every Lightning window
    events = batches = 0
    t0 = t1 = None
    groups = dm.train_dataloader()
    steps_in_order = (s for g in groups for s in getattr(g, "steps", (g,)))
    for i, batch in enumerate(steps_in_order):
        batch = batch.to(task.device, non_blocking=True)
        if i == lead:
            _synchronize()
            t0 = time.perf_counter()
        # the task optimises manually inside training_step; without a Trainer, do it here
        loss = task.train_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i >= lead:
            events += batch.size
            batches += 1
        if i + 1 >= lead + steps:
            break
    _synchronize()
    t1 = time.perf_counter() if t0 is not None else None
    if t0 is None or t1 is None:
        return 0, 0, 0.0
    return events, batches, t1 - t0


def bare_eval(task, dm, max_batches: int) -> tuple[int, int, float]:
    import torch

    task.eval()
    task.on_test_epoch_start()
    events = batches = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, batch in enumerate(dm.test_dataloader()):
            if max_batches and i >= max_batches:
                break
            task.test_step(batch.to(task.device, non_blocking=True), i)
            events += batch.size
            batches += 1
        task.evaluation.compute_and_reset("test")  # what on_test_epoch_end does, minus the logging
    _synchronize()
    seconds = time.perf_counter() - t0
    task.train()
    return events, batches, seconds


def sampler_store_cost(task) -> dict | None:
    """Seconds to fill one negative-sample store like the task's (not inside the timed windows).

    A store holds ``store_size // n_sample`` mini-batches of negatives and is refilled when used up;
    the windows are far shorter than one store, so this cost is reported apart, amortised per step.
    """
    n_sample = int(getattr(task, "n_sample", 0) or 0)
    if n_sample <= 0:
        return None
    try:
        from recforge.data.negatives import PopularitySampler
    except ImportError:
        return None
    sampler = PopularitySampler(
        task.popularity.cpu(), n_sample, task.sample_alpha, task.sample_store_size, seed=0
    )
    t0 = time.perf_counter()
    sampler.sample()  # the first draw fills the store
    seconds = time.perf_counter() - t0
    return {
        "fill_s": round(seconds, 3),
        "steps_per_fill": sampler.rows,
        "amortised_ms_per_step": round(1000 * seconds / sampler.rows, 3),
    }


# ----------------------------------------------------------------------------------- driver
def _stats(values: list[float]) -> dict:
    return {
        "min": round(min(values), 1),
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
        "n": len(values),
    }


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_one(args, train_path, test_path, config, batch_size, workdir, log) -> dict:
    """All windows for one dataset x config x batch size, both levels interleaved window by window."""
    extra = (*(["hardware=gpu"] if args.device == "cuda" else []), *args.override)
    cfg = compose_config(
        train_path, test_path, config, batch_size, workdir, args.n_sample, args.steps_per_batch,
        extra,
    )
    built = {}
    for level in args.levels:
        dm, task = build(cfg)
        dm.setup("fit")
        dm.setup("test")
        if level == "bare":
            task.to(args.device)  # the Lightning level is moved by its Trainer
        optimizer = task.configure_optimizers() if level == "bare" else None
        built[level] = (dm, task, optimizer)

    def train_window(level: str, lead: int, steps: int):
        dm, task, optimizer = built[level]
        if level == "lightning":
            return lightning_train(cfg, task, dm, lead, steps)
        return bare_train(task, dm, optimizer, lead, steps)

    def eval_window(level: str, max_batches: int):
        dm, task, _ = built[level]
        if level == "lightning":
            return lightning_eval(cfg, task, dm, max_batches)
        return bare_eval(task, dm, max_batches)

    # Warm-up (untimed): allocator, optimizer state, code paths.
    for level in args.levels:
        train_window(level, 0, args.warmup)
        if not args.no_eval:
            eval_window(level, 2)

    samples: dict[str, dict[str, list[float]]] = {
        lv: {"train_events_per_s": [], "train_batches_per_s": [], "eval_events_per_s": []}
        for lv in args.levels
    }
    counted: dict[str, dict[str, int]] = {lv: {} for lv in args.levels}
    # Alternate levels window by window so that machine noise hits both alike.
    for w in range(args.windows):
        for level in args.levels:
            events, batches, seconds = train_window(level, args.lead, args.steps)
            if batches < args.steps:
                log(f"#   note: {level} window {w} ran {batches} of {args.steps} steps (epoch end)")
            samples[level]["train_events_per_s"].append(events / seconds)
            samples[level]["train_batches_per_s"].append(batches / seconds)
            counted[level].update(train_events=events, train_batches=batches)
    if not args.no_eval:
        for w in range(args.windows):
            for level in args.levels:
                events, batches, seconds = eval_window(level, args.eval_batches)
                samples[level]["eval_events_per_s"].append(events / seconds)
                counted[level].update(eval_events=events, eval_seconds=round(seconds, 3))
    task = built[args.levels[0]][1]
    result = {
        "n_sample": int(getattr(task, "n_sample", 0) or 0),
        "steps_per_batch": int(getattr(built[args.levels[0]][0], "steps_per_batch", 1)),
    }
    store = sampler_store_cost(task)
    if store:
        result["sampler_store"] = store
        log(
            f"#   negative-sample store: {store['fill_s']:.2f} s per fill, every "
            f"{store['steps_per_fill']:,} steps = {store['amortised_ms_per_step']:.2f} ms/step "
            "amortised (outside the timed windows)"
        )
    for level in args.levels:
        result[level] = {k: _stats(v) for k, v in samples[level].items() if v}
        result[level]["per_window"] = {k: [round(x, 1) for x in v] for k, v in samples[level].items()}
        result[level]["counted"] = counted[level]
    return result


def format_table(rows: list[dict]) -> str:
    head = [
        "dataset", "config", "B", "neg", "grp", "level",
        "train ev/s min", "median", "mb/s min", "median",
        "eval ev/s min", "median", "L/bare",
    ]
    lines = []
    for r in rows:
        def f(key, stat, fmt="{:,.0f}"):
            s = r["stats"].get(key)
            return fmt.format(s[stat]) if s else "-"

        lines.append([
            r["dataset"], r["config"], str(r["batch_size"]), str(r["n_sample"]),
            str(r.get("steps_per_batch", 1)), r["level"],
            f("train_events_per_s", "min"), f("train_events_per_s", "median"),
            f("train_batches_per_s", "min", "{:,.1f}"), f("train_batches_per_s", "median", "{:,.1f}"),
            f("eval_events_per_s", "min"), f("eval_events_per_s", "median"),
            r.get("ratio", ""),
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    right = {2, 3, 4, *range(6, len(head))}

    def fmt_line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt_line(head), sep, *(fmt_line(line) for line in lines)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fix_threads(args.threads, args.omp_wait_policy)
    import lightning
    import torch

    sys.path.insert(0, str(REPO / "src"))  # harmless when recforge is installed (editable)
    quiet()

    def log(msg: str) -> None:
        print(msg, flush=True)

    log("# GRU4Rec throughput (recforge)")
    log(
        f"# torch {torch.__version__}, lightning {lightning.__version__}, python "
        f"{platform.python_version()}; threads: torch {torch.get_num_threads()} "
        f"(OMP/MKL_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}), os.cpu_count()={os.cpu_count()}"
    )
    log(f"# CPU: {cpu_model()}; load average at start (1/5/15 min): {load_average()}")
    load_start = load_average()
    log(
        f"# windows={args.windows} x steps={args.steps} (+{args.lead} untimed lead-in each, "
        f"warm-up {args.warmup}); eval: "
        + ("off" if args.no_eval else f"{args.eval_batches or 'all'} test batches per window")
    )
    found, skipped = datasets(args)
    for name, reason in skipped.items():
        log(f"# dataset {name}: SKIPPED, {reason}")
    sizes = {}
    for name, (train_path, test_path) in found.items():
        sizes[name] = describe(train_path, test_path, args.batch_sizes)
        s = sizes[name]
        spe = ", ".join(f"B={b}: {n}" for b, n in s["steps_per_epoch"].items())
        log(
            f"# dataset {name}: {s['items']:,} items; train {s['train_events']:,} events / "
            f"{s['train_sessions']:,} sessions ({spe} steps/epoch); test {s['test_events']:,} events, "
            f"{s['test_targets']:,} targets"
        )
        need = args.lead + args.steps
        for b, n in s["steps_per_epoch"].items():
            if n < need:
                log(f"#   note: B={b} has {n} steps per epoch < lead+steps={need}: windows run short")

    rows, results, failed = [], [], []
    with tempfile.TemporaryDirectory(prefix="recforge-bench-") as tmp:
        workdir = Path(tmp)
        for name, (train_path, test_path) in found.items():
            for batch_size in args.batch_sizes:
                for config in args.configs:
                    t0 = time.perf_counter()
                    try:
                        res = run_one(args, train_path, test_path, config, batch_size, workdir, log)
                    except Exception as exc:  # report and go on with the other combinations
                        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                        log(f"# {name} {config} B={batch_size}: FAILED, {reason}")
                        failed.append(
                            {"dataset": name, "config": config, "batch_size": batch_size, "error": reason}
                        )
                        continue
                    log(f"# {name} {config} B={batch_size}: done in {time.perf_counter() - t0:.0f} s")
                    ratio = ""
                    if "lightning" in res and "bare" in res:
                        lm = res["lightning"]["train_events_per_s"]["median"]
                        bm = res["bare"]["train_events_per_s"]["median"]
                        ratio = f"{lm / bm:.2f}"
                    for level in args.levels:
                        rows.append(
                            dict(dataset=name, config=config, batch_size=batch_size, level=level,
                                 n_sample=res["n_sample"], steps_per_batch=res["steps_per_batch"],
                                 stats=res[level],
                                 ratio=ratio if level == "lightning" else "")
                        )
                    results.append(
                        {"dataset": name, "config": config, "batch_size": batch_size, **res}
                    )

    load_end = load_average()
    log("")
    log(f"# load average at end (1/5/15 min): {load_end} (other jobs on the box skew the min)")
    log(format_table(rows) if rows else "(no dataset to run)")
    n_samples = sorted({r["n_sample"] for r in rows})
    caveats = ["other data and catalogue size"]
    if n_samples != [2048]:
        caveats.insert(0, f"neg={','.join(map(str, n_samples))} here vs 2048 there")
    log(
        "# L/bare = lightning / bare median training events/s. Reference (official PyTorch GRU4Rec, "
        f"spec §4, 2 threads, B=32, 2048 extra samples; not like-for-like: {'; '.join(caveats)}): "
        + "; ".join(
            f"{c} train {r['train_events_per_s']:,.0f} ev/s, {r['train_batches_per_s']:.1f} mb/s, "
            f"eval {r['eval_events_per_s']:,.0f} ev/s"
            for c, r in REFERENCE.items()
        )
    )
    summary = {
        "benchmark": "gru4rec_throughput",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "threads": args.threads,
        "device": args.device,
        "overrides": args.override,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cpu": cpu_model(),
        "load_average": {"start": load_start, "end": load_end},
        "windows": args.windows,
        "steps": args.steps,
        "warmup": args.warmup,
        "lead": args.lead,
        "eval_batches": args.eval_batches or None,
        "datasets": sizes,
        "skipped": skipped,
        "failed": failed,
        "results": results,
        "reference": {c: {k: round(v, 1) for k, v in r.items()} for c, r in REFERENCE.items()},
    }
    print(json.dumps(summary, separators=(",", ":"), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Training samples/s of recforge's DLRM against the reference ``DLRM_Net`` (facebookresearch/dlrm)
on this machine: the same model, the same rows, the same threads, the two arms in alternating
processes, so that issue 18's "DLRM at 1 and 2 threads" is a ratio taken side by side.

Nothing here is copied from the reference: the ``reference`` arm imports ``dlrm_s_pytorch`` from
``--reference-dir`` (an exported tree of facebookresearch/dlrm, see ``--help``) and drives
``DLRM_Net`` as the body of its training loop does on a CPU:

* model: ``DLRM_Net`` built as ``dlrm_s_pytorch.py`` builds it for the Kaggle run
  (``--arch-sparse-feature-size=16 --arch-mlp-bot=13-512-256-64-16 --arch-mlp-top=512-256-1
  --arch-interaction-op=dot``): 26 ``EmbeddingBag(sum, sparse=True)`` tables of Criteo Kaggle's
  sizes (33.8M rows in all), top MLP 367-512-256-1 with a sigmoid, ``BCELoss``;
* step (timed): ``dlrm(X, lS_o, lS_i)``, ``dlrm.loss_fn(Z, T)``, ``optimizer.zero_grad()``,
  ``backward``, ``SGD.step`` at the preset's learning rate (0.1): what the loop does per batch
  minus its numpy accuracy bookkeeping, logging and LR scheduler;
* rows: the first ``--batches`` training batches of recforge's own data module for
  ``experiment=dlrm_criteo_kaggle`` (the Kaggle stand-in: synthetic rows with Kaggle's table
  sizes, as ``train_throughput.py`` reads them), turned into the reference's layout (dense
  ``[B, 13]``, one offsets tensor ``arange(B)`` and one index tensor per feature) before the clock
  starts, then cycled.

The ``recforge`` arm is ``train_throughput.py --experiment dlrm_criteo_kaggle --level bare
--no-eval``: the task's ``train_loss``, ``backward``, the optimizer from ``configure_optimizers``,
each batch read through the data module inside the clock (the reference's batches are made
beforehand, which favours it).

Both arms: ``--windows`` windows of ``--steps`` timed steps after ``--lead`` untimed ones and an
untimed warm-up of ``--warmup`` steps; min and median samples/s over the windows; every
``--threads`` value, ``--rounds`` times, alternating arm by arm; the same environment, including
glibc's allocator settings, the same for both arms (issue 22): ``--malloc keep`` sets
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` in both processes' environment to what
recforge's default ``extras.malloc=keep`` sets, ``default`` leaves glibc's defaults; the recforge
arm runs with ``extras.malloc=default`` so that the environment decides for it too.

``--in-process``: both arms in one child process per thread count and round instead, window by
window (reference, recforge; then recforge, reference; ...), the recforge arm being the same bare
level; each window pair gives one ratio, taken within seconds of each other, so that the box's
drift (tens of percent over minutes on a shared machine) falls on both arms of a pair alike. With
``--floor`` a third window times the two MLPs alone (recforge's modules, forward and backward on
fixed inputs): the float32 matrix products every implementation of the model runs, so
``reference / MLPs alone`` bounds the ratio any code can reach.

    git -C /work/.mirror/facebookresearch+dlrm/repo archive 090956e | tar -x -C /tmp/dlrm
    python benchmarks/dlrm_reference.py --reference-dir /tmp/dlrm --threads 1,2 --rounds 2
    python benchmarks/dlrm_reference.py --reference-dir /tmp/dlrm --threads 1,2 --rounds 2 --windows 10 --in-process --floor

A measurement tool: it prints figures and asserts nothing about them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import last_json_line

from recforge.utils.allocator import USER_VARIABLES, keep_environment

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KEEP_MALLOC = keep_environment()
EXPERIMENT = "dlrm_criteo_kaggle"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference-dir", type=Path, required=True,
                   help="a tree of facebookresearch/dlrm holding dlrm_s_pytorch.py (git archive of a commit)")
    p.add_argument("--arm", choices=("both", "reference", "recforge", "paired"), default="both",
                   help="both: the parent, alternating the two in child processes")
    p.add_argument("--in-process", action="store_true",
                   help="both arms in one child process per thread count and round, window by window "
                        "(reference, recforge, then recforge, reference, ...): each pair of windows is one "
                        "ratio, taken in the same seconds of the box's drift")
    p.add_argument("--floor", action="store_true",
                   help="with --in-process: also time the two MLPs alone (recforge's DenseArch and OverArch, "
                        "forward and backward on fixed inputs of the step's shapes, no table, interaction or "
                        "update) in the same rotation: the matrix products both arms share, so reference / "
                        "floor is the most any code running them in float32 could reach")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=2, help="alternating pairs of runs per thread count")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="timed steps per window")
    p.add_argument("--lead", type=int, default=2, help="untimed steps at the start of every window")
    p.add_argument("--warmup", type=int, default=10, help="steps of the untimed warm-up window")
    p.add_argument("--batches", type=int, default=64, help="pre-made batches the reference arm cycles")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="glibc allocator settings for both arms: keep (recforge's default extras.malloc=keep, "
                        "set through the environment) or glibc's defaults (default: keep)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for both arms' data and model (e.g. data.generator.n_rows=...)")
    p.add_argument("--data-dir", default=str(REPO / "data" / "bench"), help="where the stand-in rows are kept")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = p.parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        p.error(f"--threads: expected comma-separated integers, got {args.threads!r}")
    if not args.threads or min(args.threads) < 1:
        p.error(f"--threads: expected integers >= 1, got {args.threads}")
    for name in ("rounds", "batch_size", "windows", "steps", "batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if not (args.reference_dir / "dlrm_s_pytorch.py").is_file():
        p.error(f"--reference-dir: {args.reference_dir} holds no dlrm_s_pytorch.py "
                "(export facebookresearch/dlrm there, see --help)")
    return args


# ----------------------------------------------------------------------------- reference arm
def reference_layout(dense, sparse, labels):
    """recforge's ``CTRBatch`` tensors as ``DLRM_Net.forward`` takes them: dense ``[B, 13]``,
    offsets ``[26, B]`` (one id per bag: ``arange(B)``), a list of 26 ``[B]`` index tensors, and
    the labels as ``[B, 1]`` (its ``BCELoss`` compares ``[B, 1]`` probabilities)."""
    import torch

    batch = sparse.shape[0]
    offsets = torch.arange(batch).unsqueeze(0).repeat(sparse.shape[1], 1)
    indices = [sparse[:, f].contiguous() for f in range(sparse.shape[1])]
    return dense.contiguous(), offsets, indices, labels.view(-1, 1)


def reference_batches(datamodule, count: int) -> list:
    """The data module's first ``count`` training batches in the reference's layout."""
    batches = []
    for batch in datamodule.train_dataloader():
        batches.append(reference_layout(batch.dense, batch.sparse, batch.labels))
        if len(batches) == count:
            break
    return batches


def build_reference(reference_dir: Path, cardinalities: list[int], lr: float):
    """``DLRM_Net`` with the Kaggle run's architecture, and the SGD its loop steps."""
    import numpy as np
    import torch

    sys.path.insert(0, str(reference_dir))
    argv, sys.argv = sys.argv, [sys.argv[0]]  # the module parses nothing at import, but be safe
    try:
        import dlrm_s_pytorch as ref
    finally:
        sys.argv = argv
    m_spa, bottom = 16, [13, 512, 256, 64, 16]
    n_fea = len(cardinalities) + 1
    top = [n_fea * (n_fea - 1) // 2 + bottom[-1], 512, 256, 1]  # the script's ln_top for "dot", itself=False
    model = ref.DLRM_Net(
        m_spa, np.array(cardinalities), np.array(bottom), np.array(top), arch_interaction_op="dot",
        arch_interaction_itself=False, sigmoid_bot=-1, sigmoid_top=len(top) - 2, loss_threshold=0.0,
        ndevices=-1, loss_function="bce",
    )
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def reference_stepper(model, optimizer, batches: list):
    """One training step of ``model`` per call, cycling ``batches``; returns the step's rows."""
    model.train()
    cursor = 0

    def step() -> int:
        nonlocal cursor
        X, lS_o, lS_i, T = batches[cursor % len(batches)]
        cursor += 1
        Z = model(X, lS_o, lS_i)
        E = model.loss_fn(Z, T)
        optimizer.zero_grad()
        E.backward()
        optimizer.step()
        return X.shape[0]

    return step


def run_reference(args, threads: int) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from timing import cpu_model, load_average
    from train_throughput import compose_config

    from recforge.pipeline import build
    from recforge.utils.quiet import silence_known_noise

    torch.set_num_threads(threads)
    silence_known_noise()
    compose = argparse.Namespace(experiment=EXPERIMENT, device="cpu", batch_size=args.batch_size,
                                 override=args.override, data_dir=args.data_dir)
    with tempfile.TemporaryDirectory(prefix="recforge-dlrm-ref-") as tmp:
        cfg, overrides, _ = compose_config(compose, Path(tmp))
        datamodule, task = build(cfg)
        datamodule.setup("fit")
        cardinalities = [int(c) for c in datamodule.cardinalities]
        batches = reference_batches(datamodule, args.batches)
        lr = float(cfg.optimizer.lr)
        del task, datamodule
    torch.manual_seed(cfg.seed)
    step = reference_stepper(*build_reference(args.reference_dir, cardinalities, lr), batches)

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.windows):
        for _ in range(args.lead):
            step()
        rows, start = 0, time.perf_counter()
        for _ in range(args.steps):
            rows += step()
        rates.append(rows / (time.perf_counter() - start))
    return {"arm": "reference", "threads": threads, "samples_per_s": rates, "cpu": cpu_model(),
            "load_average": load_average(), "overrides": overrides, "lr": lr,
            "table_rows": sum(cardinalities)}


def run_paired(args, threads: int) -> dict:
    """Both arms in this process, their windows alternating: the recforge arm is
    ``train_throughput``'s bare level (every batch read through the data module inside the clock),
    the reference arm ``DLRM_Net`` on the first ``--batches`` of the same data module's batches
    (and with ``--floor`` the MLPs alone, :func:`mlps_window`). Samples/s per window, per arm."""
    import torch

    sys.path.insert(0, str(HERE))
    from timing import cpu_model, load_average
    from train_throughput import Level, compose_config

    from recforge.utils.quiet import silence_known_noise

    torch.set_num_threads(threads)
    silence_known_noise()
    compose = argparse.Namespace(experiment=EXPERIMENT, device="cpu", batch_size=args.batch_size,
                                 override=[*args.override, "extras.malloc=default"], data_dir=args.data_dir)
    with tempfile.TemporaryDirectory(prefix="recforge-dlrm-paired-") as tmp:
        cfg, overrides, _ = compose_config(compose, Path(tmp))
        level = Level("bare", cfg, torch.device("cpu"))
    cardinalities = [int(c) for c in level.datamodule.cardinalities]
    batches = reference_batches(level.datamodule, args.batches)
    torch.manual_seed(cfg.seed)
    step = reference_stepper(*build_reference(args.reference_dir, cardinalities, float(cfg.optimizer.lr)), batches)

    def reference_window(lead: int, steps: int) -> tuple[int, float]:
        for _ in range(lead):
            step()
        rows, start = 0, time.perf_counter()
        for _ in range(steps):
            rows += step()
        return rows, time.perf_counter() - start

    def recforge_window(lead: int, steps: int) -> tuple[int, float]:
        rows, _, seconds = level.train_window(lead, steps)
        return rows, seconds

    arms = {"reference": reference_window, "recforge": recforge_window}
    if args.floor:
        arms["mlps"] = mlps_window(level.task.model, args.batch_size)
    for window in arms.values():  # warm-up, untimed
        window(0, args.warmup)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    names = list(arms)
    for w in range(args.windows):
        # two arms swap places every window; three rotate, so that none always follows the same one
        order = (names if w % 2 == 0 else names[::-1]) if len(names) == 2 else names[w % 3:] + names[:w % 3]
        for arm in order:
            rows, seconds = arms[arm](args.lead, args.steps)
            rates[arm].append(rows / seconds)
    return {"arm": "paired", "threads": threads, "samples_per_s": rates, "cpu": cpu_model(),
            "load_average": load_average(), "overrides": overrides, "table_rows": sum(cardinalities)}


def mlps_window(model, batch: int):
    """A window function timing ``model``'s two MLPs alone (copies: the model is not changed):
    forward and backward of the bottom MLP on a fixed ``[batch, n_dense]`` input and of the top
    MLP on a fixed ``[batch, interaction width]`` input that needs a gradient, as the
    interaction's output does; gradients set to None between steps, as the training loops do."""
    import copy

    import torch

    bottom, top = copy.deepcopy(model.dense_arch), copy.deepcopy(model.over_arch)
    generator = torch.Generator().manual_seed(0)
    dense = torch.rand(batch, model.n_dense, generator=generator)
    features = torch.randn(batch, model.interaction.out_features, generator=generator).requires_grad_()
    parameters = [*bottom.parameters(), *top.parameters(), features]

    def window(lead: int, steps: int) -> tuple[int, float]:
        start = None
        for k in range(lead + steps):
            if k == lead:
                start = time.perf_counter()
            for p in parameters:
                p.grad = None
            (bottom(dense).sum() + top(features).sum()).backward()
        return batch * steps, time.perf_counter() - start

    return window


# ----------------------------------------------------------------------------- the parent
def _env(threads: int, malloc: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in USER_VARIABLES}
    if malloc == "keep":
        env.update(KEEP_MALLOC)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


def child(args, arm: str, threads: int) -> dict:
    """One arm's run in a fresh process; its samples/s per window."""
    if arm in ("reference", "paired"):
        command = [sys.executable, __file__, "--arm", arm, "--reference-dir", str(args.reference_dir),
                   "--threads", str(threads)]
        for name in ("batch_size", "windows", "steps", "lead", "warmup", "batches"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        command += ["--floor"] if args.floor else []
    else:
        command = [sys.executable, str(HERE / "train_throughput.py"), "--experiment", EXPERIMENT, "--level", "bare",
                   "--no-eval", "--threads", str(threads), "--batch-size", str(args.batch_size),
                   "--windows", str(args.windows), "--steps", str(args.steps), "--lead", str(args.lead),
                   "--warmup", str(args.warmup), "--override", "extras.malloc=default"]
    command += ["--data-dir", args.data_dir, *[a for o in args.override for a in ("--override", o)]]
    done = subprocess.run(command, cwd=REPO, env=_env(threads, args.malloc), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {arm} arm failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    report = last_json_line(done.stdout)
    if arm == "recforge":
        report = {"arm": "recforge", "threads": threads, "load_average": report["load_average"]["end"],
                  "samples_per_s": report["levels"]["bare"]["train_samples_per_s"]["all"]}
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arm in ("reference", "paired"):
        run = run_reference if args.arm == "reference" else run_paired
        print(json.dumps(run(args, args.threads[0])), flush=True)
        return 0
    if args.in_process:
        return main_in_process(args)
    arms = ["reference", "recforge"] if args.arm == "both" else [args.arm]
    print(f"# {EXPERIMENT}, batch {args.batch_size}, {args.windows} windows of {args.steps} steps, threads "
          f"{args.threads}, {args.rounds} rounds, malloc {args.malloc}; load average {os.getloadavg()}", flush=True)
    runs = []
    for round_ in range(args.rounds):
        for threads in args.threads:
            for arm in (arms if round_ % 2 == 0 else arms[::-1]):
                report = child(args, arm, threads)
                rates = report["samples_per_s"]
                runs.append({"round": round_, "arm": arm, "threads": threads, "median": statistics.median(rates),
                             "min": min(rates), "all": rates, "load_average": report["load_average"]})
                print(f"round {round_} {threads} thr {arm:9s} median {statistics.median(rates):9,.0f}  "
                      f"min {min(rates):9,.0f} samples/s  (load {report['load_average']})", flush=True)
    print(f"# load average at end {os.getloadavg()}")
    if len(arms) == 2:
        print("\n| threads | round | reference median (min) | recforge median (min) | ratio of medians | ratio of mins |")
        print("|---:|---:|---:|---:|---:|---:|")
        for threads in args.threads:
            for round_ in range(args.rounds):
                ref, mine = ({r["arm"]: r for r in runs if r["threads"] == threads and r["round"] == round_}[a]
                             for a in arms)
                print(f"| {threads} | {round_} | {ref['median']:,.0f} ({ref['min']:,.0f}) | {mine['median']:,.0f} "
                      f"({mine['min']:,.0f}) | {mine['median'] / ref['median']:.2f}x | {mine['min'] / ref['min']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"batch_size": args.batch_size, "malloc": args.malloc, "runs": runs}, indent=1))
    return 0


def main_in_process(args) -> int:
    """``--in-process``: one child per thread count and round, both arms alternating window by
    window inside it; the figure is each window pair's ratio (recforge / reference), then their
    median, beside the ratio of the arms' medians."""
    print(f"# {EXPERIMENT}, batch {args.batch_size}, in one process: {args.windows} window pairs of {args.steps} "
          f"steps, threads {args.threads}, {args.rounds} rounds, malloc {args.malloc}; load average "
          f"{os.getloadavg()}", flush=True)
    runs = []
    for round_ in range(args.rounds):
        for threads in args.threads:
            report = child(args, "paired", threads)
            ref, mine = report["samples_per_s"]["reference"], report["samples_per_s"]["recforge"]
            pairs = [m / r for m, r in zip(mine, ref)]
            runs.append({"round": round_, "threads": threads, "reference": ref, "recforge": mine, "pair_ratios": pairs,
                         "load_average": report["load_average"],
                         **({"mlps": report["samples_per_s"]["mlps"]} if args.floor else {})})
            print(f"round {round_} {threads} thr: reference median {statistics.median(ref):,.0f} (min {min(ref):,.0f}), "
                  f"recforge median {statistics.median(mine):,.0f} (min {min(mine):,.0f}) samples/s; pair ratios "
                  f"{', '.join(f'{x:.2f}' for x in pairs)}  (load {report['load_average']})", flush=True)
    print(f"# load average at end {os.getloadavg()}")
    floor = args.floor
    print("\n| threads | round | reference median (min) | recforge median (min) | ratio of medians "
          "| window pairs: median (range) |" + (" MLPs alone, median | reference / MLPs alone |" if floor else ""))
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if floor else ""))
    for run in runs:
        ref, mine, pairs = run["reference"], run["recforge"], run["pair_ratios"]
        row = (f"| {run['threads']} | {run['round']} | {statistics.median(ref):,.0f} ({min(ref):,.0f}) | "
               f"{statistics.median(mine):,.0f} ({min(mine):,.0f}) | "
               f"{statistics.median(mine) / statistics.median(ref):.2f}x | "
               f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}-{max(pairs):.2f}) |")
        if floor:
            mlps = run["mlps"]
            ceilings = [m / r for m, r in zip(mlps, ref)]
            row += f" {statistics.median(mlps):,.0f} | {statistics.median(ceilings):.2f}x |"
        print(row)
    if args.json:
        args.json.write_text(json.dumps({"batch_size": args.batch_size, "malloc": args.malloc, "in_process": True,
                                         "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

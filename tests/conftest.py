"""Shared pytest fixtures."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from processes import pytest_runtest_protocol, pytest_sessionstart, run_child  # noqa: F401 (hooks)

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Triton kernels run in its interpreter on CPU-only machines; the switch is read when a kernel is
# defined, so it must be set before any kernel module is imported.
if os.environ.get("TRITON_INTERPRET") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# Every run the tests start, here or in a child process, computes with this process's thread count:
# extras.threads=auto follows the machine's load at start, and tests compare runs value for value.
# Under pytest-xdist (``-n auto``) the workers share the cores: each computes with its share. A
# worker inherits the value the session set for itself (all the cores), so it sets its own; two
# workers on all the cores each ran some tests 20-60 times slower (OpenMP threads spinning).
_SESSION_CORES = "RECFORGE_TEST_CORES"  # the cores the session computes on, when it chose them
if "OMP_NUM_THREADS" not in os.environ or _SESSION_CORES in os.environ:
    import torch

    _cores = int(os.environ.get(_SESSION_CORES) or torch.get_num_threads())
    os.environ[_SESSION_CORES] = str(_cores)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

MAX_WORKERS = 8
"""``-n auto``'s ceiling: each worker holds torch and Lightning (about 1 GB) and starts runs of
its own, some of them several processes."""


def pytest_xdist_auto_num_workers(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


# ---------------------------------------------------------------- tests in a process of their own
# torch.compile (dynamo's frame hook, inductor's compiled libraries and worker pool) and the PyTorch
# profiler leave process-wide state behind; a crash it causes later would be blamed on whichever
# test happens to be running. A test marked ``isolated`` runs its body in a fresh pytest process.
ISOLATED_CHILD = "RECFORGE_ISOLATED_TEST"


def _run_in_child(item: pytest.Item, known_crash: str | None = None) -> None:
    """``item``'s body in a fresh pytest process; once more if that dies of SIGSEGV and
    ``known_crash`` names the library crash (``@pytest.mark.isolated(known_segfault=...)``)."""
    env = {**os.environ, ISOLATED_CHILD: "1"}

    def run() -> subprocess.CompletedProcess:
        return run_child([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", item.nodeid],
                         cwd=item.config.rootpath, env=env, capture_output=True, text=True, timeout=900)

    done = _once_more_after_a_known_segfault(run, known_crash)
    out = done.stdout + done.stderr
    # the summary is stdout's last line: a plugin may warn on stderr after it (pytest-benchmark
    # does whenever pytest-xdist is installed)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == 0 and " skipped" in summary and " passed" not in summary:
        reasons = [line.split(": ", 1)[-1] for line in out.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(reasons[0] if reasons else summary)
    if done.returncode != 0 or " 1 passed" not in f" {summary}":
        pytest.fail(f"{item.nodeid} in its own process (rc {done.returncode}):\n{out[-6000:]}", pytrace=False)


def _once_more_after_a_known_segfault(run, known_crash: str | None) -> subprocess.CompletedProcess:
    """``run()``'s result; where it died of SIGSEGV and ``known_crash`` names a crash known to come
    from a library at random, the result of a second ``run()``, said as a warning in the session's
    summary, never silent. A crash of the second run fails the test as any failure does."""
    import warnings

    done = run()
    if known_crash and done.returncode == -signal.SIGSEGV:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        warnings.warn(f"run again after a segfault ({known_crash}); the first run ended: {' | '.join(tail)}",
                      stacklevel=3)
        done = run()
    return done


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ISOLATED_CHILD):
        return
    for item in items:
        marker = item.get_closest_marker("isolated")
        if marker is not None:
            item.runtest = functools.partial(_run_in_child, item, marker.kwargs.get("known_segfault"))

class SaveCheckpointAt:
    """A Lightning callback (``+callbacks.save_at._target_=conftest.SaveCheckpointAt``) that saves a
    checkpoint inside an epoch, once, at the end of the first training batch whose global step
    reaches ``step`` (a batch may hold several updates), as ``every_n_train_steps`` or a SLURM
    requeue would."""

    def __new__(cls, step: int, path: str):
        import lightning as L

        class _SaveAt(L.Callback):
            saved = False

            def on_train_batch_end(self, trainer, *args) -> None:
                if not self.saved and trainer.global_step >= step:
                    trainer.save_checkpoint(path)
                    self.saved = True

        return _SaveAt()


class SaveRankParameters:
    """A Lightning callback (``+callbacks.dump._target_=conftest.SaveRankParameters``) that saves,
    when training ends, each rank's parameters as that rank holds them (a sharded table's local
    rows, with their place in the whole: ``<name>.rows``) to ``<path>/rank<r>.pt``."""

    def __new__(cls, path: str):
        import lightning as L
        import torch

        class _Save(L.Callback):
            def on_train_end(self, trainer, pl_module) -> None:
                state = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
                for name, module in pl_module.named_modules():
                    if hasattr(module, "start") and hasattr(module, "end"):  # RowShardedEmbedding
                        state[f"{name}.weight.rows"] = (module.start, module.end)
                Path(path).mkdir(parents=True, exist_ok=True)
                torch.save(state, Path(path) / f"rank{trainer.global_rank}.pt")

        return _Save()


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The real data samples (``shared/data`` next to the repo, or ``$RECFORGE_SHARED_DATA``)."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    path = Path(os.environ.get("RECFORGE_SHARED_DATA", default))
    if not path.is_dir():
        pytest.skip(f"real data samples not found at {path} (set RECFORGE_SHARED_DATA)")
    return path


# ---------------------------------------------------------------- composed configs
# The real config (conf/) with a cheap test profile: CPU, one epoch, no progress bar, output under
# pytest's tmp_path; and test sizes, applied only where the composed config has the key, so that
# every model family composes with the same fixture. Keys every family has are here; a family's own
# (a generated dataset's size, a model width, a sampler store) are in its tests folder's
# cheap_sizes.yaml.
REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
CHEAP = [
    "trainer.max_epochs=1",
    "callbacks.progress_bar.refresh_rate=0",
    "trainer.enable_model_summary=false",
]


@contextlib.contextmanager
def benchmark_module(name: str):
    """``benchmarks/<name>.py`` (a script folder, not a package) imported for a test module's
    fixture; the folder stays on ``sys.path`` while the module is in use (its functions import
    their sibling scripts lazily) and is taken off after."""
    import importlib

    folder = str(REPO_ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def family_sizes(tests_dir: Path = Path(__file__).parent) -> list[str]:
    """The ``key=value`` test sizes of every family's ``tests/<family>/cheap_sizes.yaml``; a key two
    families set must have one value."""
    import yaml

    sizes: dict[str, object] = {}
    for path in sorted(tests_dir.glob("*/cheap_sizes.yaml")):
        for key, value in (yaml.safe_load(path.read_text()) or {}).items():
            if sizes.setdefault(key, value) != value:
                raise ValueError(f"{path}: {key}={value} contradicts {key}={sizes[key]} of another family")
    return [f"{key}={value}" for key, value in sizes.items()]


SHRINK = ["data.batch_size=32", "data.eval_batch_size=256", *family_sizes()]


def shrinks_for(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The SHRINK items whose key ``cfg`` has and ``overrides`` do not set."""
    from omegaconf import OmegaConf

    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    out = []
    for item in SHRINK:
        key = item.split("=", 1)[0]
        if key not in given and OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is not None:
            out.append(item)
    return out


def compose_config(
    name: str, overrides: list[str], output_dir: Path, data_dir: Path
) -> DictConfig:
    """Compose conf/<name>.yaml like Hydra's command line would, with paths set for a test."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.root_dir = str(REPO_ROOT)
        cfg.paths.output_dir = str(output_dir)
        cfg.paths.log_dir = str(output_dir.parent)
        cfg.paths.data_dir = str(data_dir)
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    output_dir.mkdir(parents=True, exist_ok=True)
    return cfg


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One cache of synthetic datasets for the whole test session."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def make_cfg(tmp_path, data_dir):
    """make_cfg(*overrides, name="train", run="run") -> a composed config writing into tmp_path."""
    from hydra.core.global_hydra import GlobalHydra

    def _make(*overrides: str, name: str = "train", run: str = "run"):
        base = list(CHEAP) if name == "train" else []
        if any(o.startswith(("debug=", "callbacks=")) for o in overrides):
            base = [o for o in base if not o.startswith("callbacks.")]
        cfg = compose_config(name, [*base, *overrides], tmp_path / run, data_dir)
        if name != "train":
            return cfg
        shrink = shrinks_for(cfg, list(overrides))
        return compose_config(name, [*base, *shrink, *overrides], tmp_path / run, data_dir) if shrink else cfg

    yield _make
    GlobalHydra.instance().clear()


# ---------------------------------------------------------------- commands as a user types them
# A user's command line is run word for word in a subprocess, from a directory laid out like the
# repository: src/train.py, src/eval.py and a copy of conf/. What makes it cheap goes where a user
# keeps machine-local settings, conf/local/default.yaml, so no paths.* or hydra.* override is
# needed on the command line (such overrides hid a multirun that could not start). The sizes are
# the default experiment's (GRU4Rec on generated sessions), the one the README's commands run.
TINY_RUN = [
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=2",
    "data.generator.n_items=100",
    "data.generator.n_sessions=1000",
    "task.sample_store_size=10000",
    "trainer.limit_train_batches=10",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "callbacks.progress_bar.refresh_rate=0",
]
_TINY_LOOP = [o for o in TINY_RUN if not o.startswith(("data.", "task."))]
# The same loop for the other families' commands (model=hstu|sasrec, model=dlrm), with their own
# generators shrunk: a family's data keys do not exist in another family's data config.
TINY_SEQUENCE_RUN = [
    *_TINY_LOOP,
    "data.generator.n_users=300",
    "data.generator.n_items=200",
    "data.generator.max_length=60",
    "data.max_seq_len=50",
    "data.eval_batch_size=64",
]
TINY_CTR_RUN = [
    *_TINY_LOOP,
    "data.generator.n_rows=6000",
    "data.eval_batch_size=1000",
    "model.dense_arch=[32,16]",
    "model.over_arch=[32]",
]


def tiny_profile(command: str) -> list[str]:
    """The conf/local profile for a README command line, by the family its ``model=`` picks."""
    models = " ".join(w.split("=", 1)[1] for w in command.split() if w.startswith("model="))
    if "dlrm" in models:
        return TINY_CTR_RUN
    if "hstu" in models or "sasrec" in models:
        return TINY_SEQUENCE_RUN
    return TINY_RUN


def user_checkout(root: Path, local: list[str] = TINY_RUN) -> Path:
    """``root`` shaped like a checkout: src/train.py, src/eval.py, conf/ with ``local`` as its
    conf/local/default.yaml (dotted ``key=value`` items)."""
    import shutil

    from omegaconf import OmegaConf

    (root / "src").mkdir(parents=True)
    for script in ("train.py", "eval.py"):
        shutil.copy2(REPO_ROOT / "src" / script, root / "src" / script)
    shutil.copytree(CONF_DIR, root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    body = OmegaConf.to_yaml(OmegaConf.from_dotlist(list(local)))
    (root / "conf" / "local" / "default.yaml").write_text("# @package _global_\n" + body)
    return root


def run_command(command: str, cwd: Path, timeout: int = 600,
                known_segfault: str | None = None) -> subprocess.CompletedProcess:
    """Run a shell-style command line (``python`` is this interpreter) in ``cwd``; with
    ``known_segfault`` (the library crash it names), once more if it dies of SIGSEGV."""
    import shlex

    words = shlex.split(command)
    if words[0] == "python":
        words[0] = sys.executable
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    env.pop("HYDRA_FULL_ERROR", None)

    def run() -> subprocess.CompletedProcess:
        return run_child(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    return _once_more_after_a_known_segfault(run, known_segfault)


def readme_commands() -> list[str]:
    """The ``python ...`` command lines of the README's bash blocks: continuations joined,
    trailing comments dropped."""
    import re

    text = (REPO_ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"\s+", " ", line)
            if line.startswith("python "):
                commands.append(line)
    return commands


@pytest.fixture(scope="session")
def user_sweep(tmp_path_factory):
    """user_sweep(command, local=TINY_RUN) -> (checkout, finished process), each command run once
    per test session in its own checkout (several test files read the same sweep)."""
    runs: dict[tuple, tuple[Path, subprocess.CompletedProcess]] = {}

    def _run(command: str, local: list[str] = TINY_RUN):
        key = (command, tuple(local))
        if key not in runs:
            checkout = user_checkout(tmp_path_factory.mktemp("checkout"), local)
            runs[key] = checkout, run_command(command, cwd=checkout)
        return runs[key]

    return _run

"""Shared pytest fixtures."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Triton kernels run in its interpreter on CPU-only machines; the switch is read when a kernel is
# defined, so it must be set before any kernel module is imported.
if os.environ.get("TRITON_INTERPRET") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The real data samples (``shared/data`` next to the repo, or ``$RECFORGE_SHARED_DATA``)."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    path = Path(os.environ.get("RECFORGE_SHARED_DATA", default))
    if not path.is_dir():
        pytest.skip(f"real data samples not found at {path} (set RECFORGE_SHARED_DATA)")
    return path


# ---------------------------------------------------------------- composed configs
# The real config (conf/) with a cheap test profile: tiny synthetic data, CPU, few batches, no
# progress bar, output under pytest's tmp_path.
REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
TINY_DATA = [
    "data.generator.n_items=300",
    "data.generator.n_sessions=3000",
    "data.batch_size=32",
    "data.eval_batch_size=256",
]
CHEAP = [
    "trainer.max_epochs=1",
    "callbacks.progress_bar.refresh_rate=0",
    "trainer.enable_model_summary=false",
    "model.hidden_size=32",
    "task.sample_store_size=100000",
]


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
        base = TINY_DATA + CHEAP if name == "train" else []
        if any(o.startswith(("debug=", "callbacks=")) for o in overrides):
            base = [o for o in base if not o.startswith("callbacks.")]
        if name == "train":
            # shrink the generated dataset only where the composed data config generates one
            probe = [o for o in base if not o.startswith("data.generator.")]
            cfg = compose_config(name, [*probe, *overrides], tmp_path / run, data_dir)
            if "generator" not in cfg.data:
                return cfg
        return compose_config(name, [*base, *overrides], tmp_path / run, data_dir)

    yield _make
    GlobalHydra.instance().clear()

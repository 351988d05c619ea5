"""OmegaConf resolvers used by the configs (registered once, on import)."""
from __future__ import annotations

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf


def launch_dir() -> str:
    """The directory the command was started from.

    ``${hydra:runtime.cwd}`` says the same inside a job, but a multirun resolves its sweep
    directory before Hydra sets the job config that resolver reads, so it cannot be used there.
    Jobs of other processes (joblib, submitit) read the launching process's cwd from their config.
    """
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.cwd)
    return os.getcwd()


def wandb_offline() -> bool:
    """W&B runs offline unless a key is configured (env var or ~/.netrc from `wandb login`)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return False
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc):
        with open(netrc) as f:
            if "api.wandb.ai" in f.read():
                return False
    return True


def wandb_group(task_name: str) -> str:
    """The W&B group of a run: one per sweep (``-m``), named after the sweep's directory
    (``train/multiruns/<time>``), so a sweep's jobs sit together; a single run's is its task."""
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return f"{task_name}/multiruns/{Path(str(hydra_cfg.sweep.dir)).name}"
    return task_name


def wandb_name() -> str | None:
    """The W&B run name: the job's command-line overrides (``model=hstu,trainer.max_epochs=2``),
    which is what tells a sweep's jobs apart; None (W&B picks a name) when there are none."""
    if HydraConfig.initialized():
        return str(HydraConfig.get().job.override_dirname) or None
    return None


def negate(value) -> bool:
    """``${recforge_not:${...}}``: the opposite of a boolean config value."""
    return not bool(value)


# Metrics that are better when smaller; every other logged metric (recall, NDCG, AUC, accuracy)
# is better when larger.
_MINIMISED = ("loss", "logloss")


def metric_mode(name: str) -> str:
    """``min`` or ``max``: which way a logged metric (``val/auc``, ``val/logloss``) improves, for
    checkpointing and early stopping that follow ``optimized_metric``."""
    last = str(name).rsplit("/", 1)[-1].split("@", 1)[0]
    return "min" if last.endswith(_MINIMISED) else "max"


def register() -> None:
    if not OmegaConf.has_resolver("recforge_launch_dir"):
        OmegaConf.register_new_resolver("recforge_launch_dir", launch_dir)
    if not OmegaConf.has_resolver("recforge_wandb_offline"):
        OmegaConf.register_new_resolver("recforge_wandb_offline", wandb_offline)
    if not OmegaConf.has_resolver("recforge_wandb_group"):
        OmegaConf.register_new_resolver("recforge_wandb_group", wandb_group)
    if not OmegaConf.has_resolver("recforge_wandb_name"):
        OmegaConf.register_new_resolver("recforge_wandb_name", wandb_name)
    if not OmegaConf.has_resolver("recforge_not"):
        OmegaConf.register_new_resolver("recforge_not", negate)
    if not OmegaConf.has_resolver("recforge_metric_mode"):
        OmegaConf.register_new_resolver("recforge_metric_mode", metric_mode)


register()

"""Build and run experiments from a composed config: the body of src/train.py and src/eval.py."""
from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

import recforge.utils.resolvers  # noqa: F401 - registers the config resolvers
from recforge.callbacks.run_config import RunConfigInCheckpoint
from recforge.config_checks import check_combination
from recforge.runs import write_metrics

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Config sections that describe the experiment itself (restored from a run for evaluation).
EXPERIMENT_KEYS = ("data", "model", "task", "optimizer", "loss", "evaluation")


def _choices() -> dict[str, str]:
    if HydraConfig.initialized():
        return {k: v for k, v in HydraConfig.get().runtime.choices.items() if v is not None}
    return {}


def output_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.output_dir)


def build(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule]:
    """Instantiate the data module and the task (model, loss, optimizer, metrics) it feeds."""
    check_combination(cfg, CONF_DIR, _choices())
    datamodule = instantiate(cfg.data)
    # _convert_: plain containers in the task's hyper-parameters keep checkpoints loadable with
    # torch.load(weights_only=True).
    task = instantiate(
        cfg.task,
        _convert_="all",
        model=instantiate(cfg.model),
        loss=instantiate(cfg.loss),
        optimizer=instantiate(cfg.optimizer),
        evaluation=OmegaConf.to_container(cfg.evaluation, resolve=True),
        # what the task must know about the data (catalogue size, popularity, ...): each data
        # module says, so build() stays the same for every model family
        **datamodule.task_inputs(),
    )
    return datamodule, task


def _instantiate_group(node: DictConfig | None) -> list[Any]:
    if not node:
        return []
    return [instantiate(v) for v in node.values() if isinstance(v, DictConfig) and "_target_" in v]


def _callbacks(cfg: DictConfig, has_validation: bool) -> list[L.Callback]:
    callbacks_cfg = cfg.get("callbacks")
    node = OmegaConf.create(
        OmegaConf.to_container(callbacks_cfg, resolve=True) if callbacks_cfg else {}
    )
    if not has_validation:
        # Nothing to monitor: keep the last checkpoint, stop by max_epochs.
        if "early_stopping" in node:
            del node["early_stopping"]
            log.warning("no validation split (data.valid_path is null): early stopping is off")
        if "model_checkpoint" in node:
            node.model_checkpoint.monitor = None
    callbacks = _instantiate_group(node)
    callbacks.append(RunConfigInCheckpoint(OmegaConf.to_container(cfg, resolve=True)))
    return callbacks


def _trainer(cfg: DictConfig, callbacks: list, loggers: list) -> L.Trainer:
    return instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)


def _finish_wandb() -> None:
    # One W&B run per Hydra job: a run left open would swallow the next multirun job's logs.
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def _scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit, then test the best checkpoint; write metrics.json; return the metrics."""
    started = time.perf_counter()
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule, task = build(cfg)
    callbacks = _callbacks(cfg, getattr(datamodule, "has_validation", True))
    loggers = _instantiate_group(cfg.get("logger"))
    try:
        trainer = _trainer(cfg, callbacks, loggers)
        for logger in trainer.loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        metrics: dict[str, Any] = {}
        if cfg.get("train", True):
            trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            metrics.update(_scalar_metrics(trainer.callback_metrics))
            metrics["epochs"] = trainer.current_epoch
        ckpt = trainer.checkpoint_callback
        test_ckpt = None
        if ckpt is not None:
            test_ckpt = ckpt.best_model_path or ckpt.last_model_path or None
            if ckpt.best_model_score is not None and ckpt.monitor:
                metrics[f"{ckpt.monitor}_best"] = float(ckpt.best_model_score)
        if cfg.get("test", True):
            if test_ckpt is None and cfg.get("train", True):
                log.warning("no checkpoint was saved: testing the weights as they are")
            trainer.test(task, datamodule=datamodule, ckpt_path=test_ckpt)
            metrics.update(_scalar_metrics(trainer.callback_metrics))
            metrics["test_checkpoint"] = test_ckpt
        for cb in trainer.callbacks:
            metrics.update(getattr(cb, "totals", {}))
        metrics["wall_time_s"] = time.perf_counter() - started
        metrics = {k: v for k, v in metrics.items() if not k.startswith("ev/s")}
        if trainer.is_global_zero:
            path = write_metrics(output_dir(cfg), metrics)
            log.info("metrics: %s", path)
        return metrics
    finally:
        _finish_wandb()


def run_config_for(ckpt_path: str | Path, run_config: str | None = None) -> DictConfig:
    """The training run's config: given, beside the checkpoint (<run>/.hydra), or inside it."""
    candidates = [Path(run_config)] if run_config else []
    ckpt_path = Path(ckpt_path)
    candidates.append(ckpt_path.resolve().parent.parent / ".hydra" / "config.yaml")
    for path in candidates:
        if path.exists():
            return OmegaConf.load(path)
    if run_config:
        raise FileNotFoundError(f"run_config={run_config}: no such file")
    if not ckpt_path.exists():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint")
    stored = torch.load(ckpt_path, map_location="cpu", weights_only=False).get(
        RunConfigInCheckpoint.key
    )
    if stored is None:
        raise ValueError(
            f"{ckpt_path} holds no run config and no .hydra/config.yaml sits beside its run: "
            "pass run_config=<path to the training run's .hydra/config.yaml>"
        )
    return OmegaConf.create(stored)


def _user_override_keys() -> list[str]:
    if not HydraConfig.initialized():
        return []
    keys = []
    for item in HydraConfig.get().overrides.task:
        key = item.split("=", 1)[0].lstrip("+~")
        keys.append(key)
    return keys


def evaluation_config(cfg: DictConfig) -> DictConfig:
    """The eval command's config: the run's experiment sections, overridden by the command line."""
    run_cfg = run_config_for(cfg.ckpt_path, cfg.get("run_config"))
    merged = cfg.copy()
    overridden = _user_override_keys()
    with open_dict(merged):
        for key in EXPERIMENT_KEYS:
            if key in run_cfg and not any(o == key for o in overridden):
                merged[key] = run_cfg[key]
        # Dotted overrides (data.test_path=...) win over the run's values.
        for key in overridden:
            section = key.split(".", 1)[0]
            if section in EXPERIMENT_KEYS and "." in key:
                OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    return merged


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test a checkpoint with its run's data and model; write metrics.json; return the metrics."""
    # Testing restores only weights and data state; the training callbacks it names are not needed.
    warnings.filterwarnings("ignore", message=r".*callbacks used to create the checkpoint need")
    cfg = evaluation_config(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule, task = build(cfg)
    loggers = _instantiate_group(cfg.get("logger"))
    try:
        trainer = _trainer(cfg, [], loggers)
        trainer.test(task, datamodule=datamodule, ckpt_path=str(cfg.ckpt_path))
        metrics: dict[str, Any] = _scalar_metrics(trainer.callback_metrics)
        metrics["test_checkpoint"] = str(cfg.ckpt_path)
        if trainer.is_global_zero:
            write_metrics(output_dir(cfg), metrics)
        return metrics
    finally:
        _finish_wandb()


def metric_value(metrics: dict[str, Any], name: str | None) -> float | None:
    """The value a sweeper optimises.

    A metric that was not logged (no validation split, say) is an error only where a sweeper
    needs the value (Optuna); a plain run just warns.
    """
    if not name:
        return None
    if name not in metrics:
        message = (
            f"optimized_metric={name} was not logged; logged metrics: {', '.join(sorted(metrics))}"
        )
        if _choices().get("hydra/sweeper") == "optuna":
            raise KeyError(message)
        log.warning(message)
        return None
    return float(metrics[name])

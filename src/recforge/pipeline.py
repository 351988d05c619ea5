"""Build and run experiments from a composed config: the body of src/train.py and src/eval.py.

Everything that can be found wrong before training is checked first, in this order: the
checkpoint (resume / eval), the config's values and combination, then every configured data
file; each failure is one ``recforge:`` line (:class:`recforge.errors.UserInputError`).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf, open_dict

import recforge.utils.resolvers  # noqa: F401 - registers the config resolvers
from recforge.callbacks.run_config import RunConfigInCheckpoint
from recforge.callbacks.wandb_run import (
    WandbRunInCheckpoint,
    continue_wandb_run,
    wandb_logger_nodes,
    wandb_run_ends_with_the_job,
)
from recforge.checkpoints import (
    check_resumable,
    check_weights_fit,
    checkpoint_path,
    command_line_keys,
    consolidate_checkpoint,
    is_distributed_checkpoint,
    load_checkpoint,
    run_config_for,
    with_run_experiment,
)
from recforge.config_checks import (
    CONF_DIR,
    check_combination,
    check_hardware,
    uses_device_mesh,
    warn_renamed_options,
)
from recforge.config_values import check_config_values, check_optimizer_values
from recforge.contracts import DataModule
from recforge.distributed.launched_ranks import end_with_rank_zero
from recforge.errors import UserInputError
from recforge.runs import write_metrics
from recforge.utils.allocator import apply_malloc_policy
from recforge.utils.atomic import atomic_write_text
from recforge.utils.config_tree import print_config_tree
from recforge.utils.quiet import silence_known_noise
from recforge.utils.threads import apply_threads

log = logging.getLogger(__name__)



def _choices() -> dict[str, str]:
    if HydraConfig.initialized():
        return {k: v for k, v in HydraConfig.get().runtime.choices.items() if v is not None}
    return {}


def output_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.output_dir)


def check_config(cfg: DictConfig) -> None:
    """Values against their targets' signatures, then the data x model x loss combination."""
    warn_renamed_options(_choices())
    check_config_values(cfg)
    check_optimizer_values(cfg)
    check_combination(cfg, CONF_DIR, _choices())
    check_hardware(cfg, _choices())


def _instantiate(node: DictConfig, **kwargs: Any) -> Any:
    # A UserInputError raised while building (a bad file, a bad combination of values) is the
    # user's one line, not Hydra's wrapped traceback.
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, UserInputError):
            raise error.__cause__ from None
        raise


def build(cfg: DictConfig) -> tuple[DataModule, L.LightningModule]:
    """Check the config, then instantiate the data module and the task it feeds."""
    check_config(cfg)
    return _build(cfg)


def _build(cfg: DictConfig) -> tuple[DataModule, L.LightningModule]:
    """Instantiate the data module and the task (model, loss, optimizer, metrics) it feeds."""
    datamodule = _instantiate(cfg.data)
    # _convert_: plain containers in the task's hyper-parameters keep checkpoints loadable with
    # torch.load(weights_only=True).
    task = _instantiate(
        cfg.task,
        _convert_="all",
        model=_instantiate(cfg.model),
        loss=_instantiate(cfg.loss),
        optimizer=_instantiate(cfg.optimizer),
        evaluation=_instantiate(cfg.evaluation),
        # what the task must know about the data (catalogue size, popularity, ...): each data
        # module says (keys checked against the task's arguments by check_combination), so
        # build() stays the same for every model family
        **datamodule.task_inputs(),
    )
    return datamodule, task


def _read_inputs(datamodule: DataModule, fit: bool, test: bool) -> None:
    # Every configured file is read (and refused, if bad) before training, not after it.
    if fit:
        datamodule.setup("fit")
    if test:
        datamodule.setup("test")


def _instantiate_group(node: DictConfig | None) -> list[Any]:
    if not node:
        return []
    return [_instantiate(v) for v in node.values() if isinstance(v, DictConfig) and "_target_" in v]


def _callbacks(cfg: DictConfig, has_validation: bool) -> list[L.Callback]:
    callbacks_cfg = cfg.get("callbacks")
    node = OmegaConf.create(
        OmegaConf.to_container(callbacks_cfg, resolve=True) if callbacks_cfg else {}
    )
    if not has_validation:
        # Nothing to monitor: keep the last checkpoint, stop by max_epochs.
        if "early_stopping" in node:
            del node["early_stopping"]
            log.info("no validation split: early stopping is off, the last checkpoint is tested")
        if "model_checkpoint" in node:
            node.model_checkpoint.monitor = None
    callbacks = _instantiate_group(node)
    callbacks.append(RunConfigInCheckpoint(OmegaConf.to_container(cfg, resolve=True)))
    if wandb_logger_nodes(cfg.get("logger")):
        callbacks.append(WandbRunInCheckpoint())
    return callbacks


def _check_stops(cfg: DictConfig, callbacks: list[L.Callback]) -> None:
    """Refuse a run that nothing would ever stop (``trainer.max_epochs=-1`` alone)."""
    trainer = cfg.trainer
    if trainer.get("max_epochs") != -1 or trainer.get("max_steps", -1) not in (-1, None):
        return
    if trainer.get("max_time") is not None or trainer.get("fast_dev_run"):
        return
    if any(isinstance(cb, EarlyStopping) for cb in callbacks):
        return
    raise UserInputError(
        "trainer.max_epochs=-1 trains until something stops it, and nothing would: early stopping "
        "needs a validation split (data.valid_path) and callbacks.early_stopping; otherwise set "
        "trainer.max_epochs, trainer.max_steps or trainer.max_time"
    )


def _check_monitors(cfg: DictConfig, evaluation: Any) -> None:
    """Refuse, before training, a callback that follows a figure no validation pass logs (a test
    figure, a misspelt ``optimized_metric``): Lightning would stop at the first epoch's end."""
    logged = [name for name in evaluation.logged_names() if not name.startswith("test/")]
    for name, node in (cfg.get("callbacks") or {}).items():
        monitor = node.get("monitor") if isinstance(node, DictConfig) else None
        if monitor is None or monitor in logged:
            continue
        source = " (optimized_metric)" if monitor == cfg.get("optimized_metric") else ""
        raise UserInputError(
            f"callbacks.{name}.monitor={monitor}{source}: not a figure validation logs while training; "
            f"it logs {', '.join(logged)}"
        )


def _check_manual_optimization(cfg: DictConfig) -> None:
    """Refuse the Trainer's own accumulation and clipping in one line each: recforge's tasks take
    their optimizer steps themselves (Lightning's manual optimisation), which has neither."""
    trainer = cfg.trainer
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if accumulate not in (None, 1):
        raise UserInputError(
            f"trainer.accumulate_grad_batches={accumulate}: recforge's tasks step their optimizers "
            "themselves (Lightning's manual optimisation), which accumulates nothing; train on larger "
            "mini-batches with data.batch_size instead")
    clip = trainer.get("gradient_clip_val")
    if clip not in (None, 0, 0.0):
        raise UserInputError(
            f"trainer.gradient_clip_val={clip}: clipping is the task's (it also clips the item tables' "
            f"sparse gradients, which the Trainer's cannot): set task.gradient_clip_val={clip} "
            "(and task.gradient_clip_algorithm) instead")


def _trainer(cfg: DictConfig, callbacks: list, loggers: list, has_validation: bool = True) -> L.Trainer:
    extra = {} if has_validation else {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    if "enable_checkpointing" not in cfg.trainer and not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        # callbacks=none and the debug presets chose no checkpoints: Lightning would add its own
        # and write one (a DLRM's tables: gigabytes) that nothing asked for
        extra["enable_checkpointing"] = False
    return instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **extra)


@contextmanager
def _trainer_refusals(cfg: DictConfig) -> Iterator[None]:
    """Lightning checks some trainer settings only once it runs them (``trainer.val_check_interval``
    beyond an epoch's batches, a fraction of batches a loader of unknown length cannot take): its
    refusal is the user's one line, each setting named by its config key (``trainer.<name>``)."""
    try:
        yield
    except (MisconfigurationException, ValueError) as error:
        if not isinstance(error, MisconfigurationException) and not _from_lightning_loader_setup(error):
            raise
        keys = set(cfg.trainer)
        message = re.sub(r"`(\w+)((?:=[^`]*)?)`",
                         lambda m: ("trainer." if m.group(1) in keys else "") + m.group(1) + m.group(2),
                         " ".join(str(error).split()))
        raise UserInputError(message) from error


def _from_lightning_loader_setup(error: BaseException) -> bool:
    """Whether Lightning raised ``error`` as it set its loaders up against the trainer's settings
    (where it checks ``val_check_interval`` with a plain ValueError)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame if tb is not None else None
    return (frame is not None and frame.f_code.co_name == "setup_data"
            and str(frame.f_globals.get("__name__", "")).startswith("lightning.pytorch."))


def _scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


@rank_zero_only
def _announce(cfg: DictConfig, what: str, from_run: bool = False, settings: list[str] = ()) -> None:
    """At start: the config tree and where this run writes.

    ``from_run``: the config took sections from a checkpoint's run (resume, eval), so the one
    Hydra saved in .hydra/ is not what runs; it is replaced (eval.py reads it back from there).
    """
    run_dir = output_dir(cfg)
    extras = cfg.get("extras") or {}
    if extras.get("print_config", True):
        print_config_tree(cfg, run_dir / "config_tree.log")
    if from_run and HydraConfig.initialized() and HydraConfig.get().output_subdir is not None:
        saved = run_dir / HydraConfig.get().output_subdir / "config.yaml"
        if saved.is_file():
            atomic_write_text(saved, OmegaConf.to_yaml(cfg))
    for line in settings:  # the process-wide settings chosen at start (allocator, threads)
        log.info(line)
    log.info("%s; run directory: %s", what, run_dir)


def _seed(cfg: DictConfig) -> None:
    # quietly: the seed is in the config tree printed once the run is accepted
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)


def _process_settings(cfg: DictConfig) -> list[str]:
    # before the data and the model are built: their allocations are the first large ones
    extras = cfg.get("extras") or {}
    return [apply_malloc_policy(extras.get("malloc", "keep")),
            apply_threads(extras.get("threads", "auto"), _processes_here(cfg))]


def _processes_here(cfg: DictConfig) -> int:
    """The run's processes on this machine that share its CPUs: ranks of a CPU run (ddp_cpu,
    model_parallel_cpu); one process per GPU leaves the CPUs to that one process each."""
    trainer = cfg.get("trainer") or {}
    devices = trainer.get("devices")
    if trainer.get("accelerator") == "cpu" and isinstance(devices, int) and devices > 1:
        return devices
    return 1


def _silence(cfg: DictConfig) -> None:
    extras = cfg.get("extras") or {}
    if extras.get("silence_known_warnings", True):
        silence_known_noise()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit, then test the best checkpoint; write metrics.json; return the metrics."""
    started = time.perf_counter()
    end_with_rank_zero()
    _silence(cfg)
    resume = checkpoint_path(cfg)
    run_cfg = None
    if resume is not None:
        # Resume continues the run's experiment; the command line's keys win (README: Resume).
        run_cfg = run_config_for(resume, cfg.get("run_config"))
        cfg = with_run_experiment(cfg, run_cfg)
    check_config(cfg)
    if resume is not None and is_distributed_checkpoint(resume) and not uses_device_mesh(cfg):
        raise UserInputError(
            f"ckpt_path={resume} is a distributed checkpoint (hardware=model_parallel*): resume it under "
            "hardware=model_parallel_cpu or model_parallel, with trainer.devices=1 "
            "trainer.strategy.tensor_parallel_size=1 for one process"
        )
    settings = _process_settings(cfg)
    _seed(cfg)
    datamodule, task = _build(cfg)
    do_fit, do_test = cfg.get("train", True), cfg.get("test", True)
    _read_inputs(datamodule, do_fit, do_test)
    has_validation = datamodule.has_validation
    callbacks = _callbacks(cfg, has_validation)
    if do_fit:
        datamodule.check_trainable(task.min_batch_rows)
        _check_stops(cfg, callbacks)
        _check_manual_optimization(cfg)
        if has_validation:
            _check_monitors(cfg, task.evaluation)
    if resume is not None:
        check_resumable(task, resume, cfg, run_cfg, do_fit)
    # every value, file and combination has passed: a refused run's one line is all it prints
    _announce(cfg, f"resuming {resume}" if resume else "training", from_run=resume is not None, settings=settings)
    if resume is not None and wandb_logger_nodes(cfg.get("logger")):
        continue_wandb_run(cfg.get("logger"), load_checkpoint(resume), resume)
    loggers = _instantiate_group(cfg.get("logger"))
    with wandb_run_ends_with_the_job() as job:
        trainer = job.trainer = _trainer(cfg, callbacks, loggers, has_validation)
        for logger in trainer.loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        metrics: dict[str, Any] = {}
        if do_fit:
            with _trainer_refusals(cfg):
                trainer.fit(task, datamodule=datamodule, ckpt_path=str(resume) if resume else None)
            metrics.update(_scalar_metrics(trainer.callback_metrics))
            metrics["epochs"] = trainer.current_epoch
        ckpt = trainer.checkpoint_callback
        test_ckpt = None
        if ckpt is not None:
            test_ckpt = ckpt.best_model_path or ckpt.last_model_path or None
            if ckpt.best_model_score is not None and ckpt.monitor:
                metrics[f"{ckpt.monitor}_best"] = float(ckpt.best_model_score)
        if not do_fit and resume is not None:
            test_ckpt = str(resume)  # train=false ckpt_path=...: the checkpoint is what is tested
        if do_test:
            if test_ckpt is None:
                if trainer.checkpoint_callback is None and do_fit:
                    log.info("no checkpoint callback (callbacks.model_checkpoint): testing the weights as they are")
                else:
                    log.warning("no checkpoint was saved: testing the weights as they are" if do_fit else
                                "train=false without ckpt_path: testing the model's initial weights")
            with _trainer_refusals(cfg):
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


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test a checkpoint with its run's data and model; write metrics.json; return the metrics."""
    end_with_rank_zero()
    _silence(cfg)
    ckpt_path = checkpoint_path(cfg)
    run_cfg = run_config_for(ckpt_path, cfg.get("run_config"))
    cfg = with_run_experiment(cfg, run_cfg)
    if cfg.get("evaluation") is not None and "evaluation.monitor" not in command_line_keys():
        # what the run's checkpointing followed: nothing follows it here, and other cut-offs or
        # metrics on the command line (evaluation.ks=[5,50]) need not log it
        with open_dict(cfg):
            cfg.evaluation.monitor = None
    check_config(cfg)
    settings = _process_settings(cfg)
    _seed(cfg)
    datamodule, task = _build(cfg)
    _read_inputs(datamodule, fit=False, test=True)
    check_weights_fit(task, load_checkpoint(ckpt_path), ckpt_path, cfg, run_cfg)
    _announce(cfg, f"testing {ckpt_path}", from_run=True, settings=settings)
    if is_distributed_checkpoint(ckpt_path) and not uses_device_mesh(cfg):
        # one process without a mesh reads a sharded run's checkpoint as one file, tables whole
        ckpt_path = consolidate_checkpoint(ckpt_path, output_dir(cfg) / "checkpoints" / f"{ckpt_path.name}.whole")
        log.info("read the distributed checkpoint into %s", ckpt_path)
    loggers = _instantiate_group(cfg.get("logger"))
    with wandb_run_ends_with_the_job() as job:
        trainer = job.trainer = _trainer(cfg, [], loggers)
        with _trainer_refusals(cfg):
            trainer.test(task, datamodule=datamodule, ckpt_path=str(ckpt_path))
        metrics: dict[str, Any] = _scalar_metrics(trainer.callback_metrics)
        metrics["test_checkpoint"] = str(ckpt_path)
        if trainer.is_global_zero:
            path = write_metrics(output_dir(cfg), metrics)
            log.info("metrics: %s", path)
        return metrics


def metric_value(metrics: dict[str, Any], name: str | None) -> float | None:
    """The value a sweeper optimises.

    Only a sweeper that optimises (Optuna) needs it: there a metric that was not logged (no
    validation split, say) is an error; a plain run or a grid sweep does not mention it.
    """
    if not name or name not in metrics:
        if name and _choices().get("hydra/sweeper") == "optuna":
            raise UserInputError(
                f"optimized_metric={name} was not logged, so the sweeper has nothing to optimise; "
                f"logged metrics: {', '.join(sorted(metrics))}"
            )
        return None
    return float(metrics[name])

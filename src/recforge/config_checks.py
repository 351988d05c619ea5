"""Fail at start, in one line, on a combination of config groups that cannot work.

Every edge of an experiment (data -> task -> model, task -> loss, task -> evaluation) is a pair of
declarations on the classes the configs name (see :mod:`recforge.contracts`); the check compares
them before anything is built and lists the options of the offending group that would fit,
read from the config directory. Adding a family adds classes with declarations, not code here.
"""
from __future__ import annotations

import inspect
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra.utils import get_class
from omegaconf import DictConfig

from recforge.contracts import accepted_contracts, declares
from recforge.errors import UserInputError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The repository's config directory (the configs the option lists in errors are read from)."""


class IncompatibleConfigError(UserInputError):
    pass


# Config group options renamed, kept working for one release under their old name: (group, old) -> new.
RENAMED_OPTIONS: dict[tuple[str, str], str] = {
    ("evaluation", "full_ranking"): "session_next_item",
    ("evaluation", "sequential_ranking"): "sequential_retrieval",
}


def warn_renamed_options(choices: dict[str, str]) -> None:
    """One deprecation line for each config group option chosen under its old name."""
    for group, option in choices.items():
        new = RENAMED_OPTIONS.get((group, option))
        if new is not None:
            warnings.warn(
                f"{group}={option} is deprecated and will be removed in the next release: use {group}={new}",
                FutureWarning,
                stacklevel=2,
            )


def _options(conf_dir: Path, group: str) -> dict[str, str]:
    """Option name -> its ``_target_`` for a config group (files without one are skipped)."""
    found = {}
    for path in sorted((conf_dir / group).glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        if isinstance(node, dict) and "_target_" in node:
            found[path.stem] = node["_target_"]
    return found


def fitting_options(conf_dir: Path, group: str, fits: Callable[[type], bool]) -> list[str]:
    """The options of a config group whose target class ``fits``."""
    names = []
    for name, target in _options(conf_dir, group).items():
        try:
            if fits(get_class(target)):
                names.append(name)
        except Exception:  # an option whose class cannot be imported here is not a suggestion
            continue
    return names


def _name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))


def _drives(task_cls: type, model_cls: type) -> bool:
    """Whether the task drives a contract the model declares (a task may drive several)."""
    return any(declares(model_cls, c) for c in accepted_contracts(task_cls))


def _task_inputs(data_cls: type) -> list[str]:
    """The task arguments a data module provides: the keys of its ``task_inputs()`` TypedDict."""
    return list(typing.get_type_hints(typing.get_type_hints(data_cls.task_inputs)["return"]))


def _unknown_inputs(data_cls: type, task_cls: type) -> list[str]:
    """The arguments ``data_cls`` hands a task that ``task_cls``'s constructor does not take."""
    params = inspect.signature(task_cls).parameters
    return [key for key in _task_inputs(data_cls) if key not in params]


def check_combination(cfg: DictConfig, conf_dir: Path, choices: dict[str, str] | None = None) -> None:
    """Raise :class:`IncompatibleConfigError` naming the combination and what is allowed."""
    choices = choices or {}
    classes = {g: get_class(cfg[g]._target_) for g in ("data", "task", "model", "loss", "evaluation")}
    data_cls, task_cls, model_cls = classes["data"], classes["task"], classes["model"]
    loss_cls, eval_cls = classes["loss"], classes["evaluation"]
    chosen = {g: choices.get(g, cfg[g]._target_) for g in classes}
    model = chosen["model"]

    def refuse(group: str, problem: str, fits: Callable[[type], bool]) -> None:
        allowed = fitting_options(conf_dir, group, fits)
        raise IncompatibleConfigError(
            f"model={model} with {group}={chosen[group]}: {problem}; {group} options for "
            f"model={model}: {', '.join(allowed) or 'none'}"
        )

    contracts = accepted_contracts(task_cls)
    if contracts and not _drives(task_cls, model_cls):
        raise IncompatibleConfigError(
            f"model={model} with task={chosen['task']}: the task drives a "
            f"{' or '.join(map(_name, contracts))} but the model implements "
            f"{', '.join(map(_name, getattr(model_cls, 'implements', ()))) or 'nothing declared'}; "
            f"task options for model={model}: "
            f"{', '.join(fitting_options(conf_dir, 'task', lambda t: _drives(t, model_cls))) or 'none'}"
        )
    batch_in, batch_out = getattr(task_cls, "batch_type", None), getattr(data_cls, "batch_type", None)
    if batch_in is not batch_out:
        refuse("data", f"the model trains on {_name(batch_in)} batches but the data yields {_name(batch_out)}",
               lambda d: getattr(d, "batch_type", None) is batch_in)
    unknown = _unknown_inputs(data_cls, task_cls)
    if unknown:
        refuse("data", f"the data hands the task {', '.join(unknown)}, which {_name(task_cls)} does not take",
               lambda d: getattr(d, "batch_type", None) is batch_in and not _unknown_inputs(d, task_cls))
    produces, consumes = getattr(task_cls, "produces", None), getattr(loss_cls, "consumes", None)
    if produces != consumes:
        refuse("loss", f"the model produces {produces} scores but the loss expects {consumes}",
               lambda loss: getattr(loss, "consumes", None) == produces)
    wanted, kind = getattr(task_cls, "evaluation_kind", None), getattr(eval_cls, "kind", None)
    if wanted != kind:
        refuse("evaluation", f"the model is evaluated by {wanted} but the evaluation is {kind}",
               lambda e: getattr(e, "kind", None) == wanted)


def uses_device_mesh(cfg: DictConfig) -> bool:
    """Whether the run's strategy is Lightning's ``ModelParallelStrategy`` (or a subclass): processes
    on a device mesh, tables sharded (``hardware=model_parallel*``)."""
    strategy = (cfg.get("trainer") or {}).get("strategy")
    if not (isinstance(strategy, DictConfig) and "_target_" in strategy):
        return False
    from lightning.pytorch.strategies import ModelParallelStrategy

    return issubclass(get_class(strategy["_target_"]), ModelParallelStrategy)


def _check_mesh(cfg: DictConfig, choices: dict[str, str] | None) -> None:
    """``hardware=model_parallel*``: the model must have tables to shard, and the mesh must be the
    processes: ``devices x num_nodes = data_parallel_size x tensor_parallel_size`` (Lightning says
    so only once the processes are up, as a traceback from each)."""
    if not uses_device_mesh(cfg):
        return
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy")
    option = f"hardware={(choices or {}).get('hardware', '...')}"
    task = cfg.get("task") or {}
    contract = getattr(get_class(task["_target_"]), "model_contract", None) if "_target_" in task else None
    if not hasattr(contract, "shard_tables"):  # the contract a task drives declares it (CTRModel)
        model = (choices or {}).get("model", "...")
        raise UserInputError(f"{option} splits DLRM's embedding tables across processes; model={model} "
                             "has none to split: use hardware=ddp_cpu or hardware=ddp")
    nodes, devices = trainer.get("num_nodes", 1), trainer.get("devices", 1)
    sizes = {}
    for name in ("data_parallel_size", "tensor_parallel_size"):
        size = strategy.get(name, "auto")
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise UserInputError(f"{option}: trainer.strategy.{name}={size}: expected a positive integer or auto")
        sizes[name] = size
    known = isinstance(devices, int) and devices > 0 and isinstance(nodes, int) and nodes > 0
    if not known:
        return  # every GPU (devices=-1): Lightning counts them, and checks the product itself
    # Lightning's auto: one data-parallel rank per node, the tables split across a node's devices
    dp = nodes if sizes["data_parallel_size"] == "auto" else sizes["data_parallel_size"]
    tp = devices if sizes["tensor_parallel_size"] == "auto" else sizes["tensor_parallel_size"]
    world = devices * nodes
    if dp * tp != world:
        processes = f"trainer.devices={devices}" + (f" x trainer.num_nodes={nodes}" if nodes != 1 else "")
        fix = (f"set trainer.strategy.tensor_parallel_size={world // dp}" if world % dp == 0 else
               f"set trainer.devices x trainer.num_nodes to a multiple of data_parallel_size={dp}")
        raise UserInputError(f"{option}: {processes} cannot form a mesh of data_parallel_size={dp} x "
                             f"tensor_parallel_size={tp}; {fix}")


def check_hardware(cfg: DictConfig, choices: dict[str, str] | None = None, cuda_devices: int | None = None) -> None:
    """Refuse, in one line, a GPU run on a machine whose torch sees no GPU, or fewer GPUs than
    ``trainer.devices`` asks for, before anything is built (Lightning would say it only when the
    Trainer is made, after the data is read, as a wrapped ``MisconfigurationException``).

    ``cuda_devices``: the GPUs visible (default: ``torch.cuda.device_count()``)."""
    trainer = cfg.get("trainer") or {}
    _check_mesh(cfg, choices)
    if str(trainer.get("accelerator", "auto")) not in ("gpu", "cuda"):
        return
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count()
    option = f"hardware={(choices or {}).get('hardware', '...')}"
    if cuda_devices == 0:
        raise UserInputError(
            f"{option}: trainer.accelerator=gpu, but torch sees no GPU on this machine; run on the CPU "
            "with hardware=cpu (one process) or hardware=ddp_cpu (several)"
        )
    wanted = trainer.get("devices", 1)
    if isinstance(wanted, int) and wanted > cuda_devices:
        raise UserInputError(
            f"{option}: trainer.devices={wanted}, but torch sees {cuda_devices} GPU"
            f"{'s' if cuda_devices != 1 else ''} here; set trainer.devices={cuda_devices} (or -1: every GPU)"
        )

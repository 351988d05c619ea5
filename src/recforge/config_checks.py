"""Fail at start, in one line, on data x model x loss combinations that cannot work.

Each data module declares the batch type it yields, each task the batch type it trains on and the
score kind it produces, each loss the score kind it consumes; the check compares them and lists
the config options that would fit, read from the config directory.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from hydra.utils import get_class
from omegaconf import DictConfig

from recforge.errors import UserInputError


class IncompatibleConfigError(UserInputError):
    pass


def _options(conf_dir: Path, group: str) -> dict[str, str]:
    """Option name -> its ``_target_`` for a config group (files without one are skipped)."""
    found = {}
    for path in sorted((conf_dir / group).glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        if isinstance(node, dict) and "_target_" in node:
            found[path.stem] = node["_target_"]
    return found


def _matching(conf_dir: Path, group: str, attr: str, wanted) -> list[str]:
    names = []
    for name, target in _options(conf_dir, group).items():
        try:
            if getattr(get_class(target), attr, None) == wanted:
                names.append(name)
        except Exception:  # an option whose class cannot be imported here is not a suggestion
            continue
    return names


def _describe(kind) -> str:
    return getattr(kind, "__name__", str(kind))


def check_combination(cfg: DictConfig, conf_dir: Path, choices: dict[str, str] | None = None) -> None:
    """Raise :class:`IncompatibleConfigError` naming the combination and what is allowed."""
    choices = choices or {}
    data_cls = get_class(cfg.data._target_)
    task_cls = get_class(cfg.task._target_)
    loss_cls = get_class(cfg.loss._target_)
    model = choices.get("model", cfg.model.get("_target_", "?"))
    data = choices.get("data", cfg.data._target_)
    loss = choices.get("loss", cfg.loss._target_)
    batch_in, batch_out = getattr(task_cls, "batch_type", None), getattr(data_cls, "batch_type", None)
    if batch_in is not batch_out:
        allowed = _matching(conf_dir, "data", "batch_type", batch_in)
        raise IncompatibleConfigError(
            f"model={model} with data={data}: the model trains on {_describe(batch_in)} batches "
            f"but the data yields {_describe(batch_out)}; data options for model={model}: "
            f"{', '.join(allowed) or 'none'}"
        )
    produces, consumes = getattr(task_cls, "produces", None), getattr(loss_cls, "consumes", None)
    if produces != consumes:
        allowed = _matching(conf_dir, "loss", "consumes", produces)
        raise IncompatibleConfigError(
            f"model={model} with loss={loss}: the model produces {produces} scores but the loss "
            f"expects {consumes}; loss options for model={model}: {', '.join(allowed) or 'none'}"
        )

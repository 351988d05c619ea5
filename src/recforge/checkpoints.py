"""A checkpoint as the input of a command: resuming training (``train.py ckpt_path=...``) and
testing (``eval.py ckpt_path=...``).

Both take the experiment (data, model, task, optimizer, loss, evaluation) from the run that wrote
the checkpoint, with what the command line sets on top, and check before anything runs that the
checkpoint exists and that its weights fit the model the config builds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from recforge.callbacks.run_config import RunConfigInCheckpoint
from recforge.errors import UserInputError
from recforge.utils.atomic import atomic_torch_save

# Config sections that describe the experiment itself: restored from the run for resume and eval.
EXPERIMENT_KEYS = ("data", "model", "task", "optimizer", "loss", "evaluation")


class CheckpointError(UserInputError):
    """A checkpoint that is missing, unreadable, or does not fit the command's config."""


def checkpoint_path(cfg: DictConfig) -> Path | None:
    """``cfg.ckpt_path`` as an existing file; None when it is null (a required one must be set)."""
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise CheckpointError(
            "ckpt_path is not set: give the checkpoint to use, e.g. "
            "ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt"
        )
    if cfg.get("ckpt_path") is None:
        return None
    path = Path(str(cfg.ckpt_path))
    if not path.is_file() and not is_distributed_checkpoint(path):
        what = "is a directory, not a checkpoint file" if path.is_dir() else "does not exist"
        raise CheckpointError(f"ckpt_path={path} {what}")
    return path


def is_distributed_checkpoint(path: Path) -> bool:
    """A checkpoint of ``hardware=model_parallel*``: a directory of per-rank files (torch.distributed.
    checkpoint's ``.metadata`` and ``.distcp``) with Lightning's ``meta.pt``."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file()


def _distributed_contents(path: Path) -> dict[str, Any]:
    """Lightning's metadata of a distributed checkpoint, with its weights as shapes only
    (meta-device tensors): what the checks before a run read, without reading any rows."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    contents = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    contents["state_dict"] = {
        key[len("state_dict."):]: torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
        for key, entry in stored.items()
        if key.startswith("state_dict.") and isinstance(entry, TensorStorageMetadata)
    }
    return contents


def consolidate_checkpoint(path: Path, out: Path) -> Path:
    """A distributed checkpoint's weights and Lightning metadata as one single-process checkpoint
    file at ``out`` (every sharded table whole, in memory once): what a run with one process and no
    device mesh (``src/eval.py`` under ``hardware=cpu``) can load. No optimizer state."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    weights: dict[str, Any] = {}
    # no process group: one process reads every rank's files (torch's dcp_to_torch_save does the
    # same for the whole checkpoint; only the weights are read here)
    _load_state_dict(weights, storage_reader=FileSystemReader(str(path)), no_dist=True,
                     planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}))
    checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = weights["state_dict"]
    atomic_torch_save(checkpoint, out)
    return out


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, tensors memory-mapped where the file allows it (no copy of
    large item tables just to look at their shapes); a distributed checkpoint's weights as
    shapes only."""
    if is_distributed_checkpoint(path):
        return _distributed_contents(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        pass  # not a zip-format file: mmap cannot read it, a plain load says what it is
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"ckpt_path={path} is not a checkpoint written by recforge/Lightning: torch.load "
            f"cannot read it ({type(error).__name__})"
        ) from error


def run_config_for(ckpt_path: Path, run_config: str | None = None) -> DictConfig:
    """The training run's config: given, beside the checkpoint (<run>/.hydra), or inside it."""
    if run_config:
        if not Path(run_config).is_file():
            raise CheckpointError(f"run_config={run_config} does not exist")
        return OmegaConf.load(run_config)
    beside = ckpt_path.resolve().parent.parent / ".hydra" / "config.yaml"
    if beside.is_file():
        return OmegaConf.load(beside)
    stored = load_checkpoint(ckpt_path).get(RunConfigInCheckpoint.key)
    if stored is None:
        raise CheckpointError(
            f"ckpt_path={ckpt_path} holds no run config and no .hydra/config.yaml sits beside its "
            "run: pass run_config=<the training run's .hydra/config.yaml>"
        )
    return OmegaConf.create(stored)


def command_line_keys() -> list[str]:
    """The keys the command line sets (``model.hidden_size``, ``data`` for ``data=rsc15``)."""
    if not HydraConfig.initialized():
        return []
    return [item.split("=", 1)[0].lstrip("+~") for item in HydraConfig.get().overrides.task]


def with_run_experiment(cfg: DictConfig, run_cfg: DictConfig) -> DictConfig:
    """``cfg`` with the run's experiment sections, except what the command line sets.

    A group chosen on the command line (``data=rsc15``) replaces the run's section; a dotted key
    (``data.test_path=...``, ``evaluation.ties=median``) is applied over the run's section.
    """
    merged = cfg.copy()
    overridden = command_line_keys()
    with open_dict(merged):
        for key in EXPERIMENT_KEYS:
            if key in run_cfg and key not in overridden:
                merged[key] = run_cfg[key]
        for key in overridden:
            if key.split(".", 1)[0] in EXPERIMENT_KEYS and "." in key:
                OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    return merged


def epochs_done(checkpoint: dict[str, Any]) -> int:
    """Complete training epochs in a checkpoint (an end-of-epoch one counts its own epoch)."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["total"]["processed"])
    except (KeyError, TypeError):
        return int(checkpoint.get("epoch", -1)) + 1


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _experiment_values(cfg: DictConfig) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key in EXPERIMENT_KEYS:
        if key in cfg:
            try:
                section = OmegaConf.to_container(cfg[key], resolve=True)
            except Exception:  # an interpolation that only resolves inside the run's job
                section = OmegaConf.to_container(cfg[key], resolve=False)
            values.update(_flat(section, f"{key}."))
    return values


def check_weights_fit(
    module: torch.nn.Module, checkpoint: dict[str, Any], ckpt_path: Path, cfg: DictConfig,
    run_cfg: DictConfig | None,
) -> None:
    """Refuse, in one line, a checkpoint whose weights the built module cannot load."""
    # tensors only: a module's extra state (a generator's position, say) has no shape to compare
    theirs = {k: v for k, v in checkpoint.get("state_dict", {}).items() if isinstance(v, torch.Tensor)}
    mine = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    problems = []
    for name, value in mine.items():
        if name not in theirs:
            problems.append(f"{name} is missing from the checkpoint")
        elif tuple(theirs[name].shape) != tuple(value.shape):
            problems.append(
                f"{name} is {list(theirs[name].shape)} in the checkpoint, {list(value.shape)} here"
            )
    problems += [f"the checkpoint has {name}, which this model lacks" for name in theirs if name not in mine]
    if not problems:
        return
    differs = ""
    if run_cfg is not None:
        run, here = _experiment_values(run_cfg), _experiment_values(cfg)
        changed = [k for k in here if k in run and run[k] != here[k]]
        changed += [k for k in here if k not in run] + [k for k in run if k not in here]
        if changed:
            shown = [f"{k} ({run.get(k, 'unset')} in the run, {here.get(k, 'unset')} here)" for k in changed[:4]]
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            differs = f"; this config differs from the run's in {', '.join(shown)}{more}"
    raise CheckpointError(
        f"ckpt_path={ckpt_path} does not fit the model this config builds: {problems[0]}"
        f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}{differs}"
    )


def check_resumable(
    module: torch.nn.Module, ckpt_path: Path, cfg: DictConfig, run_cfg: DictConfig | None, fit: bool
) -> None:
    """Refuse a resume whose weights do not fit, or that has nothing left to train."""
    checkpoint = load_checkpoint(ckpt_path)
    check_weights_fit(module, checkpoint, ckpt_path, cfg, run_cfg)
    done, max_epochs = epochs_done(checkpoint), cfg.trainer.get("max_epochs")
    if fit and max_epochs not in (None, -1) and done >= max_epochs:
        raise CheckpointError(
            f"ckpt_path={ckpt_path} has trained {done} epoch(s) and trainer.max_epochs={max_epochs}: "
            "nothing left to train; set trainer.max_epochs to the total to reach (resume takes "
            "trainer settings from the command line, not from the run)"
        )

"""The composed config as a tree, printed at the start of a run and saved beside its outputs."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# Printed first, in this order; the other sections follow as composed.
FIRST = ("data", "model", "task", "loss", "optimizer", "evaluation", "trainer", "callbacks", "logger", "paths")


def _yaml(cfg: DictConfig, key: str) -> str:
    node = cfg._get_node(key)
    try:
        value = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else cfg[key]
    except Exception:  # an interpolation that cannot resolve here is shown as written
        value = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node._value()
    if isinstance(value, dict):
        return OmegaConf.to_yaml(OmegaConf.create(value)).rstrip() or "{}"
    return OmegaConf.to_yaml(OmegaConf.create({key: value})).rstrip()


def config_tree(cfg: DictConfig) -> str:
    """The tree as text: one branch per config section, its values as YAML."""
    from rich.console import Console
    from rich.syntax import Syntax
    from rich.tree import Tree

    keys = [k for k in FIRST if k in cfg] + [k for k in cfg if k not in FIRST and k != "hydra"]
    tree = Tree("CONFIG", guide_style="dim")
    scalars = []
    for key in keys:
        if isinstance(cfg._get_node(key), DictConfig):
            tree.add(str(key)).add(Syntax(_yaml(cfg, key), "yaml", theme="ansi_dark", background_color="default"))
        else:
            scalars.append(_yaml(cfg, key))
    if scalars:
        tree.add("run").add(Syntax("\n".join(scalars), "yaml", theme="ansi_dark", background_color="default"))
    console = Console(width=120, color_system=None)
    with console.capture() as captured:
        console.print(tree)
    return captured.get()


def print_config_tree(cfg: DictConfig, save_to: Path | None = None) -> None:
    """Print the tree (stdout) and, given ``save_to``, write it there as plain text."""
    text = config_tree(cfg)
    print(text, end="", flush=True)
    if save_to is not None:
        from recforge.utils.atomic import atomic_write_text

        atomic_write_text(save_to, text)

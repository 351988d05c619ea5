"""OmegaConf resolvers used by the configs (registered once, on import)."""
from __future__ import annotations

import os

from omegaconf import OmegaConf


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


def register() -> None:
    if not OmegaConf.has_resolver("recforge_wandb_offline"):
        OmegaConf.register_new_resolver("recforge_wandb_offline", wandb_offline)


register()

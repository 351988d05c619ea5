"""Lightning's ``ModelParallelStrategy`` with checkpoints that carry sharded tables (issue 19).

A :class:`recforge.distributed.sharded_table.RowShardedEmbedding` keeps its rows as a plain local
tensor (so that its gradient can be sparse) and shows the whole table as a DTensor in
``state_dict()``. Two things of ``ModelParallelStrategy`` assume DTensor parameters instead, and are
done here for such tables:

* saving: the optimizer's per-row state of a table (row-wise Adagrad's accumulator) is a plain
  tensor of the local rows, which torch.distributed.checkpoint would take for a replicated value
  and save from rank 0 only; it is saved as a ``Shard(0)`` DTensor of the whole table's rows, as
  the weight is, so that every rank's rows are kept;
* loading: Lightning refuses a module without DTensor parameters; here the weights and the
  optimizer state are read into this process's layout (the checkpoint may come from another
  number of ranks: each rank reads the rows it owns now).

A checkpoint is a directory, as under ``ModelParallelStrategy``: one ``.distcp`` file per rank, the
metadata, and Lightning's ``meta.pt`` (epoch, step, loops, callbacks).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from recforge.distributed.sharded_table import RowShardedEmbedding

__all__ = ["ShardedTablesStrategy"]

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint


def sharded_tables(module: torch.nn.Module) -> dict[str, RowShardedEmbedding]:
    """The sharded tables of ``module`` by their weight's name in it."""
    return {f"{name}.weight" if name else "weight": sub for name, sub in module.named_modules()
            if isinstance(sub, RowShardedEmbedding)}


def _per_row(value: Any, table: RowShardedEmbedding) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() >= 1 \
        and value.shape[0] == table.end - table.start


def tables_state_as_dtensors(state: dict[str, Any], tables: dict[str, RowShardedEmbedding]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``) whose per-row
    entries of sharded tables are ``Shard(0)`` DTensors of the whole table's rows."""
    per_param = dict(state.get("state", {}))
    for name, table in tables.items():
        if name in per_param:
            per_param[name] = {key: table.whole(value) if _per_row(value, table) else value
                               for key, value in per_param[name].items()}
    return {**state, "state": per_param}


def _local(state: dict[str, Any]) -> dict[str, Any]:
    per_param = {name: {key: value.to_local() if isinstance(value, DTensor) else value
                        for key, value in entries.items()}
                 for name, entries in state.get("state", {}).items()}
    return {**state, "state": per_param}


class ShardedTablesStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (same arguments) for models whose tables are
    :class:`RowShardedEmbedding`: distributed checkpoints that keep each rank's rows of the tables
    and of their optimizer state, loadable at another world size."""

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if not self._save_distributed_checkpoint:
            return state
        return tables_state_as_dtensors(state, sharded_tables(self.model))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        tables = sharded_tables(self.model)
        if not tables or not (path.is_dir() and (path / META_FILE).is_file()):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # the weights: every entry read in place into this process's layout (a table's DTensor
        # shares its storage with the local rows), then given to the module (which keeps its rows)
        weights = {"state_dict": self.model.state_dict()}
        dcp_load(weights, checkpoint_id=path)
        self.model.load_state_dict(weights["state_dict"], strict=self.lightning_module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            # the current state's layout (get_optimizer_state_dict first creates a step's state)
            target = {key: tables_state_as_dtensors(get_optimizer_state_dict(self.model, optimizer), tables)}
            dcp_load(target, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=_local(target[key]),
                                     options=StateDictOptions(strict=self.lightning_module.strict_loading))
        return torch.load(path / META_FILE, weights_only=weights_only)

"""One optimizer made of two: one rule for the dense parameters, another for the embedding tables.

DLRM trains its MLPs with one optimizer (SGD, Adam, Adagrad) and its tables, whose gradients are
sparse, with another (sparse SGD, row-wise Adagrad), as TorchRec's ``CombinedOptimizer`` does.
Lightning drives one optimizer per task here, so :class:`DenseSparseOptimizer` is that one: it
builds a child optimizer per kind of group and forwards ``step``, ``zero_grad`` and the state to
them. ``param_groups`` holds the children's own group dicts, so an LR scheduler (which edits
``param_groups[i]["lr"]``) reaches both.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

import torch
from torch import Tensor

from recforge.errors import UserInputError

__all__ = ["DenseSparseOptimizer"]

_KINDS = ("dense", "sparse")


class _JointState(MutableMapping):
    """``optimizer.state`` of the whole: each parameter's entry lives in its child's state, so code
    that walks or rewrites ``optimizer.state`` (Lightning moving it to a device) reaches the children."""

    def __init__(self, owner: DenseSparseOptimizer) -> None:
        self._owner = owner

    def _child(self, p: Tensor) -> torch.optim.Optimizer:
        child = self._owner._child_of.get(id(p))
        if child is None:
            raise KeyError(p)
        return child

    def __getitem__(self, p: Tensor) -> Any:
        return self._child(p).state[p]

    def __setitem__(self, p: Tensor, value: Any) -> None:
        self._child(p).state[p] = value

    def __delitem__(self, p: Tensor) -> None:
        del self._child(p).state[p]

    def __iter__(self) -> Iterator[Tensor]:
        for child in self._owner.optimizers.values():
            yield from child.state

    def __len__(self) -> int:
        return sum(len(child.state) for child in self._owner.optimizers.values())


class DenseSparseOptimizer(torch.optim.Optimizer):
    """Updates the groups flagged ``"sparse": True`` with ``sparse(...)`` and the others with ``dense(...)``.

    Args:
        params: parameter groups, e.g. ``[{"params": mlp}, {"params": tables, "sparse": True}]``
            (a plain iterable of parameters is one dense group).
        dense: factory ``(groups) -> Optimizer`` for the unflagged groups (``functools.partial``,
            what Hydra's ``_partial_: true`` builds), e.g. Adam or Adagrad.
        sparse: factory for the flagged groups; it must take sparse gradients (SGD, Adagrad,
            :class:`recforge.optim.rowwise_adagrad.RowWiseAdagrad`).

    ``param_groups[i]`` is the child's group dict built from the i-th group given (same order),
    each with its ``"sparse"`` flag; ``optimizers`` maps ``"dense"``/``"sparse"`` to the children
    (a kind without groups has none). ``state_dict()`` has the usual ``state``/``param_groups``
    layout, numbered over all groups in order.
    """

    def __init__(
        self,
        params: Iterable,
        dense: Callable[..., torch.optim.Optimizer],
        sparse: Callable[..., torch.optim.Optimizer],
    ) -> None:
        if isinstance(params, Tensor):
            raise TypeError("params must be an iterable of parameters or of parameter groups, got a tensor")
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [self._normalised(g) for g in groups]
        self._check_disjoint(groups)

        factories = {"dense": dense, "sparse": sparse}
        #: (kind, index in that child's param_groups) of each group, in the order given.
        self._layout: list[tuple[str, int]] = []
        by_kind: dict[str, list[dict]] = {kind: [] for kind in _KINDS}
        for group in groups:
            kind = "sparse" if group["sparse"] else "dense"
            self._layout.append((kind, len(by_kind[kind])))
            by_kind[kind].append(group)
        self.optimizers: dict[str, torch.optim.Optimizer] = {
            kind: factories[kind](by_kind[kind]) for kind in _KINDS if by_kind[kind]
        }

        # The base class registers the groups through add_param_group, which here would hand them
        # to a child a second time; its other set-up (hooks, step profiling) is wanted.
        self._initialising = True
        super().__init__(groups, defaults={})
        self._initialising = False
        self.state = _JointState(self)
        self._link()

    # ------------------------------------------------------------------ groups
    @staticmethod
    def _normalised(group: dict) -> dict:
        group = dict(group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        flag = group.setdefault("sparse", False)
        if not isinstance(flag, bool):
            raise ValueError(f"a parameter group's 'sparse' flag must be true or false, got {flag!r}")
        return group

    @staticmethod
    def _check_disjoint(groups: list[dict]) -> None:
        seen: set[int] = set()
        for group in groups:
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("some parameters appear in more than one parameter group")
                seen.add(id(p))

    def _link(self) -> None:
        """Point ``param_groups`` at the children's (current) group dicts."""
        self.param_groups = [self.optimizers[kind].param_groups[i] for kind, i in self._layout]
        self._child_of = {
            id(p): child for child in self.optimizers.values() for g in child.param_groups for p in g["params"]
        }

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_initialising", False):
            return
        group = self._normalised(param_group)
        self._check_disjoint([*self.param_groups, group])
        kind = "sparse" if group["sparse"] else "dense"
        if kind not in self.optimizers:
            raise ValueError(
                f"no {kind} optimizer was built (no {kind} group at construction) to take this group"
            )
        child = self.optimizers[kind]
        child.add_param_group(group)
        self._layout.append((kind, len(child.param_groups) - 1))
        self._link()

    # ------------------------------------------------------------------ updates
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for child in self.optimizers.values():
            child.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.optimizers.values():
            child.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        children = {kind: child.state_dict() for kind, child in self.optimizers.items()}
        state: dict[int, Any] = {}
        groups: list[dict] = []
        next_id = 0
        for kind, i in self._layout:
            group = dict(children[kind]["param_groups"][i])
            ids = list(range(next_id, next_id + len(group["params"])))
            next_id += len(ids)
            for local, global_id in zip(group["params"], ids):
                if local in children[kind]["state"]:
                    state[global_id] = children[kind]["state"][local]
            group["params"] = ids
            groups.append(group)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self._layout):
            raise ValueError(
                f"the state has {len(saved)} parameter groups, this optimizer {len(self._layout)}"
            )
        children: dict[str, dict] = {
            kind: {"state": {}, "param_groups": [None] * len(child.param_groups)}
            for kind, child in self.optimizers.items()
        }
        for (kind, i), group, current in zip(self._layout, saved, self.param_groups):
            if bool(group.get("sparse", False)) != (kind == "sparse"):
                raise ValueError("the state's dense and sparse parameter groups do not match this optimizer's")
            if len(group["params"]) != len(current["params"]):
                raise ValueError("the state's parameter groups differ in size from this optimizer's")
            children[kind]["param_groups"][i] = dict(group)
        # A child numbers its parameters 0, 1, ... across its own groups in order.
        for kind, child_state in children.items():
            next_id = 0
            for group in child_state["param_groups"]:
                local_ids = list(range(next_id, next_id + len(group["params"])))
                next_id += len(local_ids)
                for global_id, local in zip(group["params"], local_ids):
                    if global_id in state_dict["state"]:
                        child_state["state"][local] = state_dict["state"][global_id]
                group["params"] = local_ids
            self.optimizers[kind].load_state_dict(child_state)
        # A child's load_state_dict replaces its group dicts with new ones.
        self._link()

    def __getstate__(self) -> dict[str, Any]:
        # The base class pickles only defaults, state and param_groups: the children would be lost.
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._link()  # the lookup by parameter id points at the originals after a copy

    def __repr__(self) -> str:
        inner = ", ".join(f"{kind}={child!r}" for kind, child in self.optimizers.items())
        return f"{type(self).__name__}({inner})"

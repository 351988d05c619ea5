"""Which optimizers take sparse embedding gradients as they are, and the check that refuses the
others before the first step (torch's own error comes from deep inside ``step()``)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from recforge.config_checks import fitting_options
from recforge.errors import UserInputError

SPARSE_CAPABLE = frozenset({
    "torch.optim.sgd.SGD",
    "torch.optim.adagrad.Adagrad",
    "torch.optim.sparse_adam.SparseAdam",
    "recforge.optim.rowwise_adagrad.RowWiseAdagrad",
    "recforge.optim.dense_sparse.DenseSparseOptimizer",
    "recforge.optim.adagrad_momentum.IndexedAdagradM",
})


def takes_sparse_gradients(cls: type) -> bool:
    return f"{cls.__module__}.{cls.__qualname__}" in SPARSE_CAPABLE


def has_sparse_gradients(module: nn.Module) -> bool:
    """Whether any sub-module (an ``nn.Embedding(sparse=True)``, an EmbeddingBag) gives sparse gradients."""
    return any(getattr(m, "sparse", False) for m in module.modules())


def check_optimizer_takes_sparse(factory: Callable, model: nn.Module, conf_dir: Path) -> None:
    """Refuse, in one line, an optimizer class that cannot step the model's sparse gradients.

    The line lists the ``conf/optimizer`` options that can, and the model's switch that turns
    its sparse gradients off (``sparse_gradients_key``, declared by the model class).
    """
    if not has_sparse_gradients(model):
        return
    cls = getattr(factory, "func", factory)  # a functools.partial from ``_partial_: true``
    if not isinstance(cls, type) or takes_sparse_gradients(cls):
        return
    options = fitting_options(conf_dir, "optimizer", takes_sparse_gradients)
    key = getattr(type(model), "sparse_gradients_key", None)
    switch = f"set model.{key}=false" if key else "turn off the model's sparse gradients"
    raise UserInputError(
        f"optimizer {cls.__name__} cannot update the embedding tables' sparse gradients: use "
        f"optimizer={', '.join(options) or 'sgd'}, or {switch}"
    )

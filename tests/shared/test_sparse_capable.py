"""The optimizer check for sparse embedding gradients is the same for every family."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from recforge.config_checks import CONF_DIR
from recforge.errors import UserInputError
from recforge.optim.sparse_capable import SPARSE_CAPABLE, check_optimizer_takes_sparse, takes_sparse_gradients


class _Tables(nn.Module):
    sparse_gradients_key = "sparse_tables"

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4, sparse=sparse)


def test_the_allow_list_is_the_set_of_optimizers_that_step_a_sparse_gradient() -> None:
    # the oracle is torch itself: one sparse step of each optimizer class the configs name
    from hydra.utils import get_class
    import yaml

    targets = {yaml.safe_load(p.read_text()).get("_target_") for p in (CONF_DIR / "optimizer").glob("*.yaml")}
    for target in sorted(t for t in targets if t and t.startswith("torch.optim.")):
        cls = get_class(target)
        model = _Tables(sparse=True)
        model.table(torch.tensor([1, 2])).sum().backward()
        try:
            cls(model.parameters(), lr=0.1).step()
            stepped = True
        except RuntimeError:
            stepped = False
        assert takes_sparse_gradients(cls) == stepped, target


@pytest.mark.parametrize("model_name", ["gru4rec", "dlrm"])
def test_adam_on_sparse_tables_is_refused_in_one_line_for_every_family(model_name: str, make_cfg) -> None:
    from recforge.pipeline import build

    extra = ["data.generator.n_rows=2000"] if model_name == "dlrm" else []
    _, task = build(make_cfg(f"model={model_name}", "optimizer=adam", *extra))
    key = type(task.model).sparse_gradients_key
    with pytest.raises(UserInputError, match=rf"^optimizer Adam cannot update the embedding tables' sparse "
                                             rf"gradients: use optimizer=.*sgd.*, or set model.{key}=false$") as error:
        task.configure_optimizers()
    assert "\n" not in str(error.value)
    assert "adam" not in str(error.value).split("use optimizer=")[1].split(",")[0]


def test_dense_tables_or_a_capable_optimizer_pass() -> None:
    check_optimizer_takes_sparse(functools.partial(torch.optim.Adam, lr=1e-3), _Tables(sparse=False), CONF_DIR)
    check_optimizer_takes_sparse(functools.partial(torch.optim.Adagrad, lr=1e-3), _Tables(sparse=True), CONF_DIR)
    with pytest.raises(UserInputError, match=r"or set model.sparse_tables=false$"):
        check_optimizer_takes_sparse(functools.partial(torch.optim.AdamW), _Tables(sparse=True), CONF_DIR)
    assert "torch.optim.adam.Adam" not in SPARSE_CAPABLE

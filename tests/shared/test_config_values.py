"""recforge.config_values: config values read against their targets' signatures."""
from __future__ import annotations

from typing import Annotated, Literal

import pytest
from omegaconf import OmegaConf

from recforge.config_values import ConfigValueError, Range, check_config_values

PREFIX = __name__


class Parent:
    def __init__(self, size: Annotated[int, Range(ge=1)] = 1, rate: Annotated[float, Range(gt=0, le=1)] = 0.5,
                 mode: Literal["a", "b"] = "a", flag: bool = False, sizes: list[Annotated[int, Range(ge=0)]] | None = None,
                 thing: object = None) -> None:
        pass


class Child(Parent):
    """Forwards **kwargs: checked against Parent's parameters too."""

    def __init__(self, name: str = "x", **kwargs) -> None:
        super().__init__(**kwargs)


class Open:
    def __init__(self, **kwargs) -> None:
        pass


def _check(node: dict, **top) -> None:
    check_config_values(OmegaConf.create({**top, "part": node}))


def _target(cls) -> str:
    return f"{PREFIX}.{cls.__name__}"


@pytest.mark.parametrize(
    "values",
    [{}, {"size": 3, "rate": 1}, {"rate": 0.25}, {"mode": "b", "flag": True}, {"sizes": [0, 4]},
     {"sizes": None}, {"thing": {"anything": [1, "x"]}}, {"name": "y", "size": 2}],
)
def test_values_that_fit(values):
    _check({"_target_": _target(Child), **values})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"size": 0}, "part.size=0: expected an integer >= 1"),
        ({"size": True}, "part.size=true: expected an integer >= 1"),  # a bool is not an int
        ({"size": 2.0}, "part.size=2.0: expected an integer >= 1"),
        ({"rate": 0}, "part.rate=0: expected a number > 0 and <= 1"),
        ({"rate": "fast"}, "part.rate=fast: expected a number > 0 and <= 1"),
        ({"mode": "c"}, "part.mode=c: expected one of a, b"),
        ({"flag": "yes"}, "part.flag=yes: expected true or false"),
        ({"sizes": [1, -1]}, "part.sizes=[1, -1]: expected a list (each item an integer >= 0) or null"),
        ({"sizes": 3}, "part.sizes=3: expected a list (each item an integer >= 0) or null"),
        ({"name": 5}, "part.name=5: expected a string"),
        ({"colour": 1}, "part.colour: Child takes no parameter 'colour'; it takes: name, size, rate, mode, flag, sizes, thing"),
    ],
)
def test_values_that_do_not_fit_name_their_key(values, message):
    with pytest.raises(ConfigValueError) as error:
        _check({"_target_": _target(Child), **values})
    assert str(error.value) == message


def test_an_interpolated_value_is_named_by_its_source():
    with pytest.raises(ConfigValueError, match=r"^shared\.size=0: expected an integer >= 1$"):
        _check({"_target_": _target(Parent), "size": "${shared.size}"}, shared={"size": 0})


def test_open_signatures_and_nested_targets():
    _check({"_target_": _target(Open), "whatever": "goes"})
    # a nested node with its own _target_ is checked against its own target
    with pytest.raises(ConfigValueError, match=r"^part\.inner\.size=0: expected an integer >= 1$"):
        _check({"_target_": _target(Open), "inner": {"_target_": _target(Parent), "size": 0}})


@pytest.mark.parametrize("group", ["hardware", "logger", "callbacks", "launcher", "hparams_search", "debug", "experiment"])
def test_every_preset_passes(group, make_cfg):
    from conftest import CONF_DIR

    for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
        cfg = make_cfg(f"{group}={option}", run=f"{group}-{option}")
        check_config_values(cfg)

"""Check config values against the signatures of what they configure, before anything is built.

Every config node with a ``_target_`` is read against that target's parameters: their types and,
where a parameter is annotated ``Annotated[int, Range(ge=1)]``, their range. ``model.hidden_size=0``
or ``loss.bpreg=abc`` then fails at start in one line that names the key the user set and what
is allowed, not in a traceback from deep inside the build that names some derived value.
"""
from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recforge.errors import UserInputError

__all__ = ["ConfigValueError", "Range", "check_config_values", "check_optimizer_values", "checks_ranges"]


class ConfigValueError(UserInputError):
    """A config value its target cannot take."""


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric parameter: ``Annotated[float, Range(ge=0, lt=1)]``."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: Real) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        parts = [f"{op} {_num(bound)}" for op, bound in
                 ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)) if bound is not None]
        return " and ".join(parts)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# ---------------------------------------------------------------------------- types
_HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


def _expected(annotation: Any) -> str:
    """What an annotation allows, in words."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        ranges = [str(a) for a in args[1:] if isinstance(a, Range)]
        return " ".join([_expected(args[0]), *ranges])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_expected(a) for a in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(_shown(a) for a in args)
    if origin in (list, tuple, Sequence):
        return f"a list (each item {_expected(args[0])})" if args else "a list"
    if annotation is type(None):
        return "null"
    if typing.is_typeddict(annotation):
        return "a mapping with keys " + ", ".join(typing.get_type_hints(annotation))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        annotation, "a mapping" if origin in (dict, Mapping) or annotation in (dict, Mapping) else "a value"
    )


def _fits(value: Any, annotation: Any) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        ranges = [a for a in args[1:] if isinstance(a, Range)]
        return _fits(value, args[0]) and all(r.holds(value) for r in ranges)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        return not args or all(_fits(v, args[0]) for v in value)
    if origin in (dict, Mapping) or annotation in (dict, Mapping) or typing.is_typeddict(annotation):
        return isinstance(value, dict)
    return True  # a class, a callable, Any: built or checked by its own code


def _typed_dict(annotation: Any) -> type | None:
    """The TypedDict an annotation names (``X``, ``X | None``), or None."""
    candidates = [annotation, *typing.get_args(annotation)]
    return next((c for c in candidates if typing.is_typeddict(c)), None)


def _check_typed_dict(value: dict, schema: type, path: str) -> None:
    """A mapping parameter with named keys (``model.attention.kernel``): each key known, each
    value of its declared type, the error naming the nested key."""
    hints = typing.get_type_hints(schema, include_extras=True)
    for key, item in value.items():
        if key not in hints:
            raise ConfigValueError(f"{path}.{key}: {path} takes no key {key!r}; it takes: {', '.join(hints)}")
        if not _fits(item, hints[key]):
            raise ConfigValueError(f"{path}.{key}={_shown(item)}: expected {_expected(hints[key])}")


# ---------------------------------------------------------------------------- signatures
def _parameters(target: Callable) -> tuple[dict[str, Any], bool]:
    """(name -> annotation, takes arbitrary keywords) of what a config node's target accepts.

    A class whose ``__init__`` passes ``**kwargs`` up is read up its MRO, so a subclass that
    forwards to its parent's parameters is checked against them.
    """
    callables = [c.__init__ for c in inspect.getmro(target) if "__init__" in vars(c)] \
        if inspect.isclass(target) else [target]
    params: dict[str, Any] = {}
    for function in callables:
        signature = inspect.signature(function)
        hints = _hints(function)
        keywords = None
        for name, p in signature.parameters.items():
            if p.kind is p.VAR_KEYWORD:
                keywords = name
            elif p.kind is not p.VAR_POSITIONAL and name != "self":
                params.setdefault(name, hints.get(name, Any))
        if keywords is None:
            return params, False
        if not _passes_up(function, keywords):
            # the keywords go elsewhere (Lightning's PyTorchProfiler hands them to torch's
            # profiler): anything may be given
            return params, True
    return params, True


def _passes_up(function: Callable, keywords: str) -> bool:
    """Whether ``function`` hands its ``**keywords`` to a parent's ``__init__``."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return True
    return re.search(r"\.__init__\([^)]*\*\*" + re.escape(keywords) + r"\b", source) is not None


def _hints(function: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:  # an annotation that only resolves under TYPE_CHECKING: check the others
        hints = {}
        namespace = getattr(function, "__globals__", {})
        for name, annotation in getattr(function, "__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
            except Exception:
                hints[name] = Any
        return hints


# ---------------------------------------------------------------------------- the walk
def _targets(node: DictConfig, path: str) -> Iterator[tuple[str, DictConfig]]:
    if "_target_" in node:
        yield path, node
    for key in node:
        if key == "hydra" and not path:
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            yield from _targets(child, f"{path}.{key}" if path else str(key))


def _source_key(node: DictConfig, key: str, path: str) -> str:
    """The key a value comes from: ``data.batch_size`` for ``task.batch_size: ${data.batch_size}``,
    ``seed`` for ``task.seed: ${oc.select:seed,0}``."""
    raw = node._get_node(key)._value()
    match = re.fullmatch(r"\$\{(?:oc\.select:)?([\w.@-]+)(?:,[^{}]*)?\}", raw) if isinstance(raw, str) else None
    return match.group(1) if match else f"{path}.{key}"


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value) if value == "" or value != value.strip() else value
    return str(value)


def check_config_values(cfg: DictConfig) -> None:
    """Raise :class:`ConfigValueError` for the first value its target cannot take."""
    from hydra.utils import get_object

    import recforge.utils.resolvers  # noqa: F401 - values are resolved, and the configs use them

    for path, node in _targets(cfg, ""):
        try:
            target = get_object(node._target_)
        except Exception:  # Hydra names an unimportable target itself when it builds it
            continue
        params, open_ended = _parameters(target)
        name = getattr(target, "__qualname__", str(target))
        for key in node:
            if key in _HYDRA_KEYS or OmegaConf.is_missing(node, key):
                continue
            if key not in params:
                if not open_ended:
                    raise ConfigValueError(
                        f"{path}.{key}: {name} takes no parameter {key!r}; it takes: {', '.join(params)}"
                    )
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and "_target_" in child:
                continue  # built from its own node, checked there
            value = node[key]
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
            if _typed_dict(params[key]) is not None and isinstance(value, dict):
                _check_typed_dict(value, _typed_dict(params[key]), f"{path}.{key}")
            elif not _fits(value, params[key]):
                raise ConfigValueError(
                    f"{_source_key(node, key, path)}={_shown(value)}: expected {_expected(params[key])}"
                )


def _ranged(annotation: Any) -> bool:
    """Whether an annotation bounds its value: ``Annotated[int, Range(...)]``, optionally ``| None``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return any(isinstance(a, Range) for a in args[1:])
    return origin in (typing.Union, types.UnionType) and any(_ranged(a) for a in args)


def checks_ranges(path: str) -> Callable[[Callable], Callable]:
    """Decorator: a direct call (a test, a benchmark, a subclass) has its ``Range``-annotated
    arguments checked as a config's are, in the same words, ``path`` naming the config node."""

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            hints = _hints(function)  # here: the names an annotation uses exist once it is called
            for name, value in signature.bind(*args, **kwargs).arguments.items():
                if _ranged(hints.get(name)) and not _fits(value, hints[name]):
                    raise ConfigValueError(f"{path}.{name}={_shown(value)}: expected {_expected(hints[name])}")
            return function(*args, **kwargs)

        return checked

    return decorate


# ---------------------------------------------------------------------------- built to be checked
# The words torch's optimizers use for a setting in their refusals, where they do not use its name.
_SETTING_WORDS = {"learning rate": "lr", "epsilon": "eps", "beta": "betas"}


def check_optimizer_values(cfg: DictConfig) -> None:
    """Raise :class:`ConfigValueError` for an optimizer setting the optimizer refuses.

    torch's optimizers declare no bounds in their signatures; they check ``lr``, ``eps``, ``betas``
    and the rest as they are built, which is inside ``Trainer.fit``, after the data is read, and
    as a traceback. Each ``optimizer`` node that builds an optimizer (``_partial_: true``; the
    children of ``optimizer=rowwise_adagrad`` first, so the line names the child's key) is built
    here once over a stand-in parameter.
    """
    import torch
    from hydra.utils import instantiate

    root = cfg.get("optimizer")
    if not isinstance(root, DictConfig):
        return
    nodes = sorted(_targets(root, "optimizer"), key=lambda item: -item[0].count("."))
    for path, node in nodes:
        if not node.get("_partial_", False):
            continue
        try:
            factory = instantiate(node)
            factory(params=[torch.nn.Parameter(torch.zeros(1, 1))])  # a 1-row table or a 1x1 weight
        except ValueError as error:  # torch's word for a setting out of range (types: checked above)
            raise _refused_setting(path, node, str(error).splitlines()[0] if str(error) else "ValueError") from None
        except Exception:  # noqa: BLE001 - one the stand-in cannot stand in for: its real build says
            continue


def _refused_setting(path: str, node: DictConfig, message: str) -> ConfigValueError:
    """The refusal naming the node's key the optimizer's message is about, or the node."""
    named = [key for key in node if key not in _HYDRA_KEYS and re.search(rf"\b{re.escape(key)}\b", message)]
    named += [key for words, key in _SETTING_WORDS.items() if words in message.lower() and key in node]
    shown = f"{path}.{named[0]}={_shown(OmegaConf.to_container(node, resolve=True)[named[0]])}" if named else path
    return ConfigValueError(f"{shown}: {node._target_} refuses it: {message}")

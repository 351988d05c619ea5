"""A Triton twin behind a PyTorch reference: the one dispatch every kernel op goes through.

Every op module keeps one :class:`TritonTwin` and ends in one :meth:`TritonTwin.dispatch` call:
``kernel="pytorch"`` runs the reference; ``kernel="triton"`` runs the Triton code when
:meth:`TritonTwin.unusable_reason` is None and otherwise warns once per process and runs the
reference. Kernels stay importable without Triton: the Triton module is imported on first use.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Literal, TypedDict, TypeVar, get_args

import torch
from torch import Tensor

from recforge.errors import UserInputError

KernelImpl = Literal["pytorch", "triton"]
"""The values of every kernel switch (``loss.kernel``, ``model.attention.kernel``, ...)."""

KERNEL_IMPLS: tuple[str, ...] = get_args(KernelImpl)

Result = TypeVar("Result")

# A fallback warning names the line that called the op: the first frame outside these files
# (the op modules, and torch's wrappers such as the no_grad decorator around some ops).
_NOT_THE_CALLER = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


class KernelChoice(TypedDict, total=False):
    """A model part's kernel switch as a config mapping (``model.attention: {kernel: triton}``)."""

    kernel: KernelImpl


def check_kernel(kernel: object, name: str = "kernel") -> KernelImpl:
    """``kernel`` itself when it is one of :data:`KERNEL_IMPLS`; otherwise a one-line error that
    names ``name`` (the argument, or the config key a model part reads it from)."""
    if not isinstance(kernel, str) or kernel not in KERNEL_IMPLS:
        raise UserInputError(f"unknown {name} {kernel!r}; allowed values: {', '.join(KERNEL_IMPLS)}")
    return kernel


def kernel_of(part: str, choice: Mapping | None) -> KernelImpl:
    """The kernel of a model part's :class:`KernelChoice` (``{kernel: triton}`` -> ``"triton"``),
    PyTorch when unset; ``part`` is its config key (``model.attention``)."""
    choice = dict(choice or {})
    unknown = set(choice) - {"kernel"}
    if unknown:
        raise UserInputError(f"{part} takes only 'kernel', got {sorted(unknown)}")
    return check_kernel(choice.get("kernel", "pytorch"), f"{part}.kernel")


class TritonTwin:
    """The Triton side of one kernel module.

    ``module_name`` must expose ``KERNEL_DTYPES`` (the dtypes its kernels take) and
    ``INTERPRETED`` (whether its kernels were defined under ``TRITON_INTERPRET=1``).
    """

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        self._module = None  # None = not tried yet, False = the import failed
        self._import_error: str | None = None
        self.warned = False

    def module(self) -> ModuleType | None:
        if self._module is None:
            try:
                self._module = importlib.import_module(self.module_name)
            except Exception as exc:  # ImportError, or a broken Triton install failing on import
                self._module = False
                self._import_error = f"{type(exc).__name__}: {exc}"
        return self._module or None

    def available(self) -> bool:
        """Whether the Triton module imports (tests patch this to simulate a machine without it)."""
        return self.module() is not None

    def unusable_reason(self, *tensors: Tensor) -> str | None:
        """Why the kernels cannot take these tensors, or None when they can."""
        if not self.available():
            return f"Triton could not be imported ({self._import_error or 'unavailable'})"
        module = self.module()
        unsupported = {t.dtype for t in tensors} - set(module.KERNEL_DTYPES)
        if unsupported:
            names = ", ".join(sorted(str(d) for d in unsupported))
            return f"the kernel computes in float32 and does not take {names}"
        if tensors[0].device.type == "cuda":
            return None
        # The interpreter is chosen when a kernel is defined, so the module knows; the variable
        # is named in the message because that is what a user sets.
        if module.INTERPRETED:
            return None
        return f"tensors are on {tensors[0].device.type} and TRITON_INTERPRET=1 was not set"

    def dispatch(
        self,
        op: str,
        kernel: str,
        inputs: Sequence[Tensor],
        triton: Callable[[ModuleType], Result],
        reference: Callable[[], Result],
        layout_reason: Callable[[ModuleType], str | None] | None = None,
    ) -> Result:
        """Run ``op`` with the implementation ``kernel`` names.

        Args:
            op: the op's name, for messages.
            kernel: one of :data:`KERNEL_IMPLS` (anything else is refused in one line).
            inputs: the validated tensors whose dtypes and device decide whether Triton can run.
            triton: calls the Triton module (passed in) on the op's arguments.
            reference: calls the PyTorch reference on the op's arguments.
            layout_reason: why the Triton module cannot take these inputs beyond dtype and
                device (a width past its tile, a strided state), or None when it can.
        """
        check_kernel(kernel)
        if kernel == "pytorch":
            return reference()
        if torch.compiler.is_compiling():
            # dynamo cannot trace the lazy import and the checks: one graph break around all of it
            # instead of one per call it meets
            return _triton_outside_graphs(self, op, inputs, triton, reference, layout_reason)
        return self._triton_or_reference(op, inputs, triton, reference, layout_reason)

    def _triton_or_reference(self, op, inputs, triton, reference, layout_reason):
        reason = self.unusable_reason(*inputs)
        if reason is None and layout_reason is not None:
            reason = layout_reason(self.module())
        if reason is None:
            return triton(self.module())
        self.warn_fallback(op, reason)
        return reference()

    def warn_fallback(self, op: str, reason: str) -> None:
        """Warn, once per process and twin, that ``op`` runs its PyTorch reference instead."""
        if self.warned:
            return
        self.warned = True
        warnings.warn(
            f"{op}(kernel='triton'): {reason}; using the PyTorch implementation "
            "(this warning is shown once)",
            RuntimeWarning,
            stacklevel=_caller_stacklevel(),
        )


# a function, not a method: dynamo's graph break then reads "Skip calling `torch.compiler.disable()`d
# function" (as tests/dlrm/test_dlrm_model.py expects), not "Skip inlining"
@torch.compiler.disable
def _triton_outside_graphs(twin: TritonTwin, op, inputs, triton, reference, layout_reason):
    return twin._triton_or_reference(op, inputs, triton, reference, layout_reason)


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from here, of the line that called the op."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_CALLER):
        frame, level = frame.f_back, level + 1
    return level

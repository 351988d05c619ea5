"""A Triton twin behind a PyTorch reference: lazy import, usability check, one fallback warning.

Every kernel module keeps one :class:`TritonTwin`; its op calls the Triton code when
:meth:`TritonTwin.unusable_reason` is None and otherwise warns once per process and runs the
reference. Kernels stay importable without Triton: the Triton module is imported on first use.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Literal, TypedDict

from torch import Tensor

KernelImpl = Literal["pytorch", "triton"]
"""The values of every kernel switch (``loss.kernel``, ``optimizer.kernel``, ``evaluation.kernel``)."""


class KernelChoice(TypedDict, total=False):
    """A model part's kernel switch as a config mapping (``model.attention: {kernel: triton}``)."""

    kernel: KernelImpl


class TritonTwin:
    """The Triton side of one kernel module.

    ``module_name`` must expose ``KERNEL_DTYPES`` (the dtypes its kernels take) and
    ``interpreted()`` (whether its kernels were defined under ``TRITON_INTERPRET=1``).
    """

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        self._module = None  # None = not tried yet, False = the import failed
        self._import_error: str | None = None
        self.warned = False

    def module(self):
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
        if module.interpreted():
            return None
        return f"tensors are on {tensors[0].device.type} and TRITON_INTERPRET=1 was not set"

    def warn_fallback(self, op: str, reason: str, stacklevel: int) -> None:
        """Warn, once per process and twin, that ``op`` runs its PyTorch reference instead."""
        if self.warned:
            return
        self.warned = True
        warnings.warn(
            f"{op}(impl='triton'): {reason}; using the PyTorch implementation "
            "(this warning is shown once)",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )

"""Which kernels compute: `MLIGHT_KERNELS` = auto | native | torch (`mlight run --kernels`; what each means: README,
"The reference reading"), and the old `MLIGHT_NATIVE*` / `MLIGHT_AMX` = 0 switches, read one more release.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

from core.errors import UsageError

ENV = "MLIGHT_KERNELS"
CHOICES = ("auto", "native", "torch")
_warned: set[str] = set()


def mode() -> str:
    """The knob's value (read each call: cheap, and a test or the CLI may set it)."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise UsageError(f"{ENV}={value!r} is not a kernel choice", f"set it to one of {', '.join(CHOICES)}")
    return value


def reference() -> bool:
    """Whether the reference reading is asked for (torch's ops, GGUF files in float32)."""
    return mode() == "torch"


def switched_off(old: tuple[str, ...] = ("MLIGHT_NATIVE",)) -> str:
    """Why the C kernels that the old switch names `old` governed must not run ("" if they may)."""
    if reference():
        return f"{ENV}=torch"
    for var in old:
        if os.environ.get(var, "1") == "0":
            if var not in _warned:
                _warned.add(var)
                warnings.warn(f"{var}=0 is deprecated and goes in the next release: set {ENV}=torch "
                              "(torch's ops only) instead", FutureWarning, stacklevel=3)
            return f"{var}=0"
    return ""


@functools.lru_cache(maxsize=None)
def triton_module(name: str):
    """core.model.<name>, a Triton kernel's module, where triton is installed; else None (the torch forms run)."""
    module = importlib.import_module(f"core.model.{name}")
    return module if module.triton is not None else None


def set_mode(value: str) -> None:
    """Set the knob for this process (the CLI's --kernels) and forget kernels built under another value."""
    os.environ[ENV] = value
    forget_builds()


def forget_builds() -> None:
    """Drop the C kernels this process built or refused, so the next use decides again under the knob's value."""
    from core.model.cpu import native

    for kernel in native.Kernel.made:
        kernel.cache_clear()

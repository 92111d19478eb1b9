"""What zeroplus's DeepSpeed API says about a part of DeepSpeed's API it does not serve.

``NotSupportedError`` is a ``NotImplementedError`` that names the attribute, and also an
``AttributeError``: libraries probe DeepSpeed's features with ``hasattr`` (Accelerate does, for the
optimizer's ``overflow``), and a probe must read "absent", not raise. ``module_getattr`` gives a
served module the same answer for every public name it lacks (PEP 562).
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn


class NotSupportedError(NotImplementedError, AttributeError):
    """A DeepSpeed API name that zeroplus's DeepSpeed API does not serve yet."""


def not_supported(where: str, how: str = "") -> NotSupportedError:
    """The error for DeepSpeed's ``where`` (``"DeepSpeedEngine.offload_states"``), with what to do instead."""
    return NotSupportedError(f"{where} is part of DeepSpeed's API that zeroplus does not support yet"
                             f"{'; ' + how if how else ''} (zeroplus serves DeepSpeed's API: docs/deepspeed.md "
                             f"lists what is served)")


def refuse(where: str, how: str = "") -> NoReturn:
    raise not_supported(where, how)


def module_getattr(module_name: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers every public name the module lacks with ``NotSupportedError``."""
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        raise not_supported(f"{module_name}.{name}")
    return __getattr__

"""``deepspeed.runtime``: the submodules callers reach through it (``deepspeed.runtime.lr_schedules``,
``deepspeed.runtime.zero``, ``deepspeed.runtime.engine``)."""
from __future__ import annotations

from . import engine, lr_schedules, zero
from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.runtime")

__all__ = ["engine", "lr_schedules", "zero"]

"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules are zeroplus's (``zeroplus/optim/schedulers.py``).

``VALID_LR_SCHEDULES`` names them: Accelerate recognises a DeepSpeed schedule passed to ``prepare``
by its class name in this list. LRRangeTest is not built.
"""
from __future__ import annotations

from zeroplus.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.lr_schedules")
VALID_LR_SCHEDULES = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"]

__all__ = ["OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

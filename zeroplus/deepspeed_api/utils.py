"""``deepspeed.utils``: the logger, ``log_dist`` and the ZeRO-3 leaf-module marker.

``logger`` is zeroplus's ``zeroplus.deepspeed_api`` logger (the Trainer sets its level).
``set_z3_leaf_modules`` marks module classes whose parameters ZeRO-3 should gather as one; zeroplus
already gathers each unit's parameters together and makes every module that owns parameters part
of one unit, so it records nothing and returns the matching modules, as DeepSpeed does.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from zeroplus.logs import rank

from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.utils")
logger = logging.getLogger("zeroplus.deepspeed_api")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (all with -1 among them; rank 0 when none are given)."""
    ranks = ranks if ranks is not None else [0]
    if -1 in ranks or rank() in ranks:
        logger.log(level, "[Rank %d] %s", rank(), message)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any]) -> list[torch.nn.Module]:
    names = {c if isinstance(c, str) else c.__name__ for c in leaf_module_classes}
    return [m for m in model.modules() if type(m).__name__ in names]


__all__ = ["log_dist", "logger", "set_z3_leaf_modules"]

"""``deepspeed.zero`` (and ``deepspeed.runtime.zero``): ``Init`` (``partition_parameters.py``) and
``GatheredParameters`` are zeroplus's."""
from __future__ import annotations

from zeroplus.zero.gathered import GatheredParameters

from . import partition_parameters
from .partition_parameters import Init
from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.zero")

__all__ = ["GatheredParameters", "Init", "partition_parameters"]

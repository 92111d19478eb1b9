"""``deepspeed.runtime.zero.offload_config``: the enums ``engine.offload_states()`` takes.

``OffloadStateTypeEnum`` names the kinds of training state (``engine/state_offload.py`` maps each to
the engine's tensors); ``OffloadDeviceEnum`` the devices, of which ``offload_states`` takes ``cpu``.
"""
from __future__ import annotations

import enum

from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.zero.offload_config")


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]

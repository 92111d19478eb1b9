"""``deepspeed.accelerator.get_accelerator()``: DeepSpeed's accelerator interface over zeroplus's.

The names callers use (device names and counts, the communication backend, synchronize, memory
statistics, seeding), each answered by ``zeroplus.accelerator``; others raise ``NotSupportedError``.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

from zeroplus.accelerator import Accelerator
from zeroplus.accelerator import get_accelerator as zeroplus_accelerator

from .unsupported import module_getattr, not_supported

__getattr__ = module_getattr("deepspeed.accelerator")


class DeepSpeedAccelerator:
    def __init__(self, accel: Accelerator) -> None:
        self._accel = accel

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise not_supported(f"get_accelerator().{name}")

    def device_name(self, device_index: int | None = None) -> str:
        name = self._accel.name
        return name if device_index is None or name == "cpu" else f"{name}:{device_index}"

    def current_device_name(self) -> str:
        return str(self._accel.device())

    def current_device(self) -> Any:
        return self._accel.device().index or 0

    def device(self, device_index: int | None = None) -> torch.device:
        return self._accel.device(device_index)

    def set_device(self, device_index: int) -> None:
        self._accel.set_device(device_index)

    def device_count(self) -> int:
        return 1 if self._accel.name == "cpu" else getattr(self._accel, "module").device_count()

    def is_available(self) -> bool:
        return self._accel.is_available()

    def communication_backend_name(self) -> str:
        return self._accel.comm_backend

    def synchronize(self, device_index: int | None = None) -> None:
        self._accel.synchronize()

    def empty_cache(self) -> None:
        if self._accel.name != "cpu":
            getattr(self._accel, "module").empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._accel.memory_allocated()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._accel.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._accel.reset_peak_memory_stats()

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return self._accel.name != "cpu"

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return self._accel.pin_memory(tensor)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._accel.name

    def visible_devices_envs(self) -> list[str]:
        return {"cuda": ["CUDA_VISIBLE_DEVICES"], "npu": ["ASCEND_RT_VISIBLE_DEVICES"]}.get(self._accel.name, [])

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))


@functools.lru_cache(maxsize=1)
def get_accelerator() -> DeepSpeedAccelerator:
    return DeepSpeedAccelerator(zeroplus_accelerator())


__all__ = ["DeepSpeedAccelerator", "get_accelerator"]

"""Accelerator layer: one object that knows the device, the comm backend, streams and pinned memory.

``get_accelerator()`` picks npu (torch_npu present and a device visible), then cuda, then cpu;
``ZEROPLUS_ACCELERATOR=cpu|cuda|npu`` forces one. On CPU streams and events are no-ops and
"pinned" memory is ordinary memory (host and device are the same RAM), so no second copy exists.
torch_npu is imported only when present.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
from typing import Any

import torch

from . import flight_recorder, host_allocator, host_gemm_pool, host_kernel_cache
from .proc_status import status_bytes


class _NullStream:
    """Stands in for a stream on CPU: work runs in program order."""

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class _NullEvent:
    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class Accelerator:
    """Device-specific operations behind one interface. Subclasses override what differs."""

    name = "cpu"
    comm_backend = "gloo"
    # which memory techniques left unset run (zeroplus.techniques_by_default "auto"): on the CPU each runs where it
    # takes memory off (GPT 111M at 4 x 256: one rank 0.97x the plain module with both, 1.02x without; two ranks at
    # ZeRO-3 0.80x FSDP2's peak with them, 0.99x without; see note: techniques by default)
    techniques_by_default = "where_they_pay"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        return None

    def is_available(self) -> bool:
        return True

    def device_name(self) -> str:
        """The device's model name (the FLOPs profiler looks its peak up by it)."""
        return platform.processor() or platform.machine()

    def current_stream(self) -> Any:
        return _NullStream()

    def new_stream(self) -> Any:
        return _NullStream()

    def new_event(self, enable_timing: bool = False) -> Any:
        return _NullEvent()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        return None

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """On CPU, pinning buys nothing: host memory is device memory. Return the tensor as is."""
        return tensor

    @property
    def host_is_device(self) -> bool:
        return True

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in host memory (one copy, from any device), detached."""
        return tensor.detach().to("cpu", copy=True)

    def capacity_bytes(self, ranks_here: int) -> int:
        """The memory one of ``ranks_here`` ranks on this host trains in: the host's physical memory, or its
        control group's limit where lower, shared evenly."""
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with contextlib.suppress(OSError, ValueError):
            with open("/sys/fs/cgroup/memory.max") as f:
                total = min(total, int(f.read().split()[0]))  # ("max": no limit, a ValueError)
        return total // max(1, ranks_here)

    def max_memory_allocated(self) -> int:
        """Peak resident bytes of this process (VmHWM on Linux), the CPU stand-in for device peak."""
        return _peak_rss_bytes()

    def memory_allocated(self) -> int:
        return _current_rss_bytes()

    def settle_host_allocator(self, mode: str) -> str:
        """The budget here is resident memory: freed memory goes back to the system as it predicts
        (``host_allocator.py``; ``mode`` from ``ZEROPLUS_HOST_ALLOCATOR``) and the matrix-product kernel caches
        hold at most what it counts (``host_kernel_cache.py``), and torch's flight recorder keeps no ring of records
        (``flight_recorder.py``). Returns what holds of the allocator."""
        held = host_allocator.settle(mode)  # (first: it refuses a mode it does not know)
        host_kernel_cache.settle(mode)
        flight_recorder.settle(mode)
        return held

    def release_host_memory(self) -> None:
        """MKL's buffer pool (a cache: ``host_gemm_pool.release``) and the free memory glibc holds go back to the
        system, as the budget predicts (unless the process keeps it: ``host_allocator.release``)."""
        host_gemm_pool.release()
        host_allocator.release()

    def reset_peak_memory_stats(self) -> None:
        """Reset VmHWM so a phase's peak can be read on its own (Linux ``clear_refs``)."""
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


class _StreamAccelerator(Accelerator):
    """Shared code for CUDA and NPU, whose torch modules expose the same stream API."""

    module: Any = None
    # resize recompute and the lean loss cost a step time there (one H100, 2026-11-27: 20-30 ms and 6-10 ms of a
    # 67 ms step against the plain module's 20): they run where the run needs their memory
    techniques_by_default = "where_needed"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.name, self.module.current_device() if index is None else index)

    def set_device(self, local_rank: int) -> None:
        self.module.set_device(local_rank)

    def is_available(self) -> bool:
        return bool(self.module.is_available())

    def device_name(self) -> str:
        return str(self.module.get_device_name())

    def current_stream(self) -> Any:
        return self.module.current_stream()

    def new_stream(self) -> Any:
        return self.module.Stream()

    def new_event(self, enable_timing: bool = False) -> Any:
        return self.module.Event(enable_timing=enable_timing)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.module.stream(stream)

    def synchronize(self) -> None:
        self.module.synchronize()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    @property
    def host_is_device(self) -> bool:
        return False

    def capacity_bytes(self, ranks_here: int) -> int:
        """The device's own memory (each rank has one)."""
        return int(self.module.mem_get_info()[1])

    def max_memory_allocated(self) -> int:
        return int(self.module.max_memory_allocated())

    def memory_allocated(self) -> int:
        return int(self.module.memory_allocated())

    def settle_host_allocator(self, mode: str) -> str:
        """The budget here is the device allocator's: host memory is left as the process has it."""
        return "device"

    def release_host_memory(self) -> None:
        return None

    def reset_peak_memory_stats(self) -> None:
        self.module.reset_peak_memory_stats()


class CudaAccelerator(_StreamAccelerator):
    name = "cuda"
    comm_backend = "nccl"
    module = torch.cuda


class NpuAccelerator(_StreamAccelerator):
    name = "npu"
    comm_backend = "hccl"

    def __init__(self) -> None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        self.module = torch.npu  # type: ignore[attr-defined]


def _peak_rss_bytes() -> int:
    value = status_bytes("VmHWM")
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    value = status_bytes("VmRSS")
    return value if value is not None else _peak_rss_bytes()


def techniques_by_default(name: str) -> str:
    """``Accelerator.techniques_by_default`` of the accelerator called ``name`` (a budget may be predicted for a
    device this machine does not have)."""
    kinds = {kind.name: kind for kind in (Accelerator, CudaAccelerator, NpuAccelerator)}
    if name not in kinds:
        raise ValueError(f"accelerator must be one of {sorted(kinds)}, got {name!r}")
    return kinds[name].techniques_by_default


@functools.lru_cache(maxsize=1)
def get_accelerator() -> Accelerator:
    """The accelerator of this process, chosen once."""
    forced = os.environ.get("ZEROPLUS_ACCELERATOR", "").lower()
    if forced not in ("", "cpu", "cuda", "npu"):
        raise ValueError(f"ZEROPLUS_ACCELERATOR must be cpu, cuda or npu, got {forced!r}")
    if forced == "cpu":
        return Accelerator()
    if forced in ("", "npu"):
        try:
            accel = NpuAccelerator()
            if accel.is_available():
                return accel
        except ImportError:
            if forced == "npu":
                raise ValueError("ZEROPLUS_ACCELERATOR=npu but torch_npu is not installed") from None
    if forced in ("", "cuda") and torch.cuda.is_available():
        return CudaAccelerator()
    if forced:
        raise ValueError(f"ZEROPLUS_ACCELERATOR={forced} but no such device is available")
    return Accelerator()

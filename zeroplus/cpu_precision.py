"""Whether this CPU computes bf16 natively, and what emulating it costs.

x86 CPUs without ``avx512_bf16`` or AMX (``amx_bf16``), and ARM CPUs without the ``bf16`` feature,
run bf16 matrix products by converting to fp32 and back: on an AVX2-only CPU a bf16 matmul ran at
0.6 GFLOP/s against 88 in fp32. ``native_bf16()`` reads the CPU's flags (``/proc/cpuinfo``; True where
they cannot be read, so nothing is claimed); ``bf16_slowdown()`` times one 256x256 product in each
dtype (one warm-up, best of two; about 0.6 s where bf16 is emulated, on rank 0 once per process) so the
warning can say how slow it is here (512: smaller products are too short to show the difference).
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from .logs import log_rank0, rank

_NATIVE_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX-512 / AMX, ARM's feature name


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return True
    flags = {word for line in text.splitlines() if line.lower().startswith(("flags", "features"))
             for word in line.split(":", 1)[-1].split()}
    return not flags or bool(flags & _NATIVE_FLAGS)


@functools.lru_cache(maxsize=1)
def bf16_slowdown() -> float:
    """How many times longer a bf16 matmul takes than an fp32 one on this CPU."""
    def best(dtype: torch.dtype) -> float:
        a = torch.ones(512, 512, dtype=dtype)
        a @ a
        times = []
        for _ in range(2):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
        return min(times)
    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


@functools.lru_cache(maxsize=1)
def warn_if_bf16_is_emulated() -> bool:
    """Rank 0 warns once per process when bf16 compute is emulated on this CPU; True if it is."""
    if native_bf16():
        return False
    if rank() != 0:
        return True
    log_rank0("bf16 compute is emulated on this CPU (no avx512_bf16 or AMX): a bf16 matrix product takes %.0fx "
              "as long as an fp32 one here, so \"bf16\": {\"enabled\": false} trains faster on this machine "
              "(zeroplus train picks fp32 here unless --config says otherwise)", bf16_slowdown(),
              level=logging.WARNING)
    return True

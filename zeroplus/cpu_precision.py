"""Whether this CPU computes bf16 natively, and what emulating it costs.

x86 CPUs without ``avx512_bf16`` or AMX (``amx_bf16``), and ARM CPUs without the ``bf16`` feature,
run bf16 matrix products by converting to fp32 and back: on an AVX2-only CPU a bf16 matmul ran at
0.6 GFLOP/s against 88 in fp32. ``native_bf16()`` reads the CPU's flags (``/proc/cpuinfo``; True where
they cannot be read, so nothing is claimed); ``bf16_slowdown()`` times a 512x512 product in each dtype
(one warm-up, best of two; smaller products are too short to show the difference) in a child process,
once per machine, so the warning can say how slow it is here without allocating in the process that
trains.
See note: default precision (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import subprocess
import sys

import torch

from .cache_dir import cache_file, read_record, write_record
from .logs import log_rank0, rank

_NATIVE_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX-512 / AMX, ARM's feature name


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions that oneDNN may use: the flags, unless ``ONEDNN_MAX_CPU_ISA``
    (or ``DNNL_MAX_CPU_ISA``) caps oneDNN below them (a cap naming none of BF16, AMX, FP16 or AVX10)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and cap not in ("ALL", "DEFAULT") and not any(w in cap for w in ("BF16", "AMX", "FP16", "AVX10")):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return True
    flags = {word for line in text.splitlines() if line.lower().startswith(("flags", "features"))
             for word in line.split(":", 1)[-1].split()}
    return not flags or bool(flags & _NATIVE_FLAGS)


_MEASURE = """
import time, torch
def best(dtype):
    a = torch.ones(512, 512, dtype=dtype)
    a @ a
    times = []
    for _ in range(2):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return min(times)
print(best(torch.bfloat16) / max(best(torch.float32), 1e-9))
"""


def bf16_slowdown() -> float | None:
    """How many times longer a bf16 matmul takes than an fp32 one on this CPU; None if it cannot be measured.

    Measured once per machine in a child process (the products' 2 MiB are not this process's) and kept in
    the cache directory, keyed by host and torch version."""
    path = cache_file("bf16-slowdown", {"host": platform.node(), "machine": platform.machine(),
                                        "torch": torch.__version__})
    record = read_record(path)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        if record is not None:
            return float(record["slowdown"])
    try:
        done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        slowdown = float(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    write_record(path, {"slowdown": slowdown})
    return slowdown


@functools.lru_cache(maxsize=1)
def warn_if_bf16_is_emulated() -> bool:
    """Rank 0 warns once per process when bf16 compute is emulated on this CPU; True if it is."""
    if native_bf16():
        return False
    if rank() != 0:
        return True
    slowdown = bf16_slowdown()
    how_slow = f"takes {slowdown:.0f}x as long as" if slowdown is not None else "is many times slower than"
    log_rank0("bf16 compute is emulated on this CPU (no avx512_bf16 or AMX): a bf16 matrix product %s an fp32 "
              "one here, so \"bf16\": {\"enabled\": false} trains faster on this machine (zeroplus train picks "
              "fp32 here unless --config says otherwise)", how_slow, level=logging.WARNING)
    return True

"""MKL's buffer pool on CPU: what a process's fp32 matrix products keep after they return, measured for the budget.

On x86 CPUs torch's fp32 and fp64 matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, and the blocks of its CPU
attention kernel) are MKL's. Each call packs its operands into a buffer from MKL's own memory manager, which keeps
every buffer it allocated in a pool for later calls and returns none: a call takes a pooled buffer large enough or
allocates one more, so the pool grows to a chain of sizes set by the order of the run's shapes and stays. What the
pool costs is the part of its buffers the products wrote, which depends on the CPU's kernels: on a 2-core AMD EPYC
with torch 2.13's MKL (2026-12-05, AVX2) the buffers were 0.1 to 5.3 MiB and written whole, a GPT of d 768 and
vocabulary 16384 ending its first step with 12.4 MiB pooled; on a 2-core Intel Xeon with AVX-512 (2026-12-07) MKL
counted 56 MiB for eight such shapes and 1.4 MiB of it was resident. Nothing tensor-shaped shows it, and
``MKL_DISABLE_FAST_MM``, the switch that turns the pool off, is read when torch loads MKL, before ``import zeroplus``
can set it.

So it is measured, not modeled: the memory simulation records each distinct float product it runs in the order it
first runs them (``signature``: operation and operands' shapes, strides and dtypes), and ``pool_bytes`` empties the
pool (``release``: ``mkl_serv_free_buffers``, a cache, freed to the system), runs each of those once on empty
operands of the same layout, and empties it again, reading how much anonymous resident memory that gave back: the
pool's written pages. The run's products repeat those shapes in that order from an empty pool (``initialize``
releases the process's pool before its start is measured: ``CpuAccelerator.release_host_memory``), so the budget adds
that figure from the first forward on. ``tests/budget/test_host_gemm_pool.py`` holds that what the pool gives back
after training is the figure predicted.

Where torch carries no MKL (other CPUs, other builds), or on accelerators: 0, and nothing runs.
Memory: a replay's operands, one product at a time, no more than that product's in the run. Time: the distinct
products once per prediction (its further simulations of the same products read the figure kept).
See note: mkl buffer pool.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from .proc_status import status_bytes

logger = logging.getLogger("zeroplus")

aten = torch.ops.aten
# the operations whose float kernels are MKL's products on CPU (checked: each grows the pool)
POOLED = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                    aten._scaled_dot_product_flash_attention_for_cpu.default,
                    aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
_FLOATS = (torch.float32, torch.float64)  # MKL's sgemm and dgemm; 16-bit products are oneDNN's
_last: list[tuple[tuple, int]] = []  # the last replay: its signatures, and the pool's resident bytes after it


@functools.lru_cache(maxsize=None)
def _mkl() -> Any:
    """MKL's service calls inside torch's CPU library, or None where this torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        stat, free = lib.mkl_serv_mem_stat, lib.mkl_serv_free_buffers
    except (OSError, AttributeError):
        return None
    stat.restype, stat.argtypes = ctypes.c_longlong, [ctypes.POINTER(ctypes.c_int)]
    free.restype, free.argtypes = None, []
    return lib


def held_bytes() -> int:
    """What MKL's pool holds in this process now, by MKL's own count of its buffers (0 without MKL): more than
    it costs where the products write part of each buffer (see the module's docstring)."""
    lib = _mkl()
    return 0 if lib is None else int(lib.mkl_serv_mem_stat(ctypes.byref(ctypes.c_int(0))))


def release() -> int:
    """Empty MKL's pool (its buffers go back to the system; the products allocate again as they need) and return
    the resident bytes that gave back: 0 without MKL; MKL's own count where ``/proc`` gives no resident figure."""
    lib = _mkl()
    if lib is None:
        return 0
    counted, before = held_bytes(), status_bytes("RssAnon")
    lib.mkl_serv_free_buffers()
    after = status_bytes("RssAnon")
    return counted if before is None or after is None else max(0, before - after)


def signature(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A simulated call's key for ``pool_bytes`` (hashable: the operation, its arguments' structure, each tensor as
    its shape, strides and dtype), or None where it is not one of MKL's float products."""
    if func not in POOLED:
        return None
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dtype not in _FLOATS or any(t.device.type != "meta" for t in tensors):
        return None
    keyed = tuple(("tensor", tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t
                  for t in leaves)
    try:
        hash(keyed)
    except TypeError:
        return None
    return (func, spec, keyed)


def pool_bytes(signatures: list[tuple]) -> int:
    """The resident bytes MKL's pool holds once ``signatures`` (in the order the run first calls them) have each run
    once from an empty pool; 0 without MKL. Empties this process's pool before and after (``release``)."""
    key = tuple(signatures)
    if _mkl() is None or not signatures:
        return 0
    if _last and _last[0][0] == key:  # (the same prediction simulating again)
        return _last[0][1]
    release()
    with torch.no_grad(), _disable_current_modes():  # (no user's dispatch mode sees these: they are not the run's)
        for func, spec, keyed in signatures:
            leaves = [torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="cpu")
                      if isinstance(leaf, tuple) and leaf[:1] == ("tensor",) else leaf for leaf in keyed]
            args, kwargs = tree_unflatten(leaves, spec)
            try:
                func(*args, **kwargs)
            except RuntimeError as err:  # (none known: a product the simulation ran runs here too)
                logger.warning("memory budget: MKL's pool not measured for %s (%s); predicted without it", func, err)
            del leaves, args, kwargs
    _last[:] = [(key, release())]
    return _last[0][1]

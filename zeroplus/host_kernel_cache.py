"""A CPU process's matrix-product kernel caches: bounded, so the budget can count what they hold.

On CPU, a bf16 (or fp16) matrix product runs a oneDNN kernel generated for its shapes, and two caches keep it:
oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 entries unless set) and ideep's beside it
(``LRU_CACHE_CAPACITY``, 1024), whose entries hold oneDNN's evicted kernels alive. A model whose products keep the
same shapes fills a few entries once; one whose shapes change from step to step (routed experts: each expert's
batch is what the router sent it) adds entries every step until both caches are full, 0.3 to 0.9 MiB an entry by
the shapes (measured here: K x N 512 x 4 0.31, 512 x 1024 0.46, 4096 x 1024 0.86 MiB), so resident memory grows
by hundreds of MiB over a run (the Hugging Face Mixtral ``small`` alone in bf16 at 1 x 64: 722 -> 912 MiB in 24
steps) and no prediction of tensors can say where it stops.

``settle(mode)``, called through the CPU accelerator when zeroplus is imported (beside ``host_allocator``; the
variables are read at the first such product, so settled before the script runs one):

- ``"return"`` (the default, ``ZEROPLUS_HOST_ALLOCATOR``): oneDNN's capacity is set to ``CAPACITY`` and ideep's
  to ``IDEEP_CAPACITY`` (no larger than oneDNN's, it then keeps nothing oneDNN dropped), each unless the process
  set it. What a full cache holds is measured once per machine (``runtime_probe``'s ``kernel_cache``) and the budget
  adds it from the first routed product on (``budget/estimate.py``): a routed model fills the cache within its
  first steps. The price is kernels generated again where shapes vary (the Mixtral ``small`` alone at 1 x 64, 40
  steps, 2026-12-05: 0.70 s a step with oneDNN's at 128 and ideep's at 1, against 0.62 with the default capacities,
  memory flat instead of +120 MiB; ideep's alone at 64 took 100 MiB off at 0.63 s; a Llama of the same size: 0.51 s
  either way; oneDNN's at 64: 0.75 s, at 1: 0.92 s).
- ``"keep"``: both as the process has them (the budget then says the caches grow beyond it).

Accelerators other than the CPU: their matrix products are not oneDNN's; nothing is set.
Memory: bounded as above; time: once per process. See note: host kernel caches.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("zeroplus.engine")

ONEDNN_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_ENV = "LRU_CACHE_CAPACITY"
CAPACITY = 128  # oneDNN's entries: a routed bf16 model's cache full within its first steps (see the docstring)
IDEEP_CAPACITY = 16  # ideep's, below oneDNN's: it then holds only kernels oneDNN still has
DEFAULT_CAPACITY = 1024  # oneDNN's and ideep's own
_settled: list[int | None] = []  # oneDNN's capacity in force after the first settle(); None: unknown


def settle(mode: str) -> int | None:
    """Bound this process's kernel caches for ``mode`` (``host_allocator.MODES``), once; returns oneDNN's capacity
    in force (the process's own variable where it set one; None where that is not a whole number)."""
    if not _settled:
        _settled.append(_settle(mode))
    return _settled[0]


def _settle(mode: str) -> int | None:
    if mode == "keep":
        return _given(ONEDNN_ENV)
    for name, capacity in ((ONEDNN_ENV, CAPACITY), (IDEEP_ENV, IDEEP_CAPACITY)):
        if name in os.environ:
            logger.info("kernel caches: the process was started with %s=%s; zeroplus leaves it", name,
                        os.environ[name])
        else:
            os.environ[name] = str(capacity)
    return _given(ONEDNN_ENV)


def _given(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return DEFAULT_CAPACITY
    try:
        return max(0, int(value))
    except ValueError:
        return None


def capacity() -> int | None:
    """oneDNN's capacity this process settled (``settle``), or what its variable says where nothing was settled."""
    return _settled[0] if _settled else _given(ONEDNN_ENV)


def bounded() -> bool:
    """Whether the caches are bounded as ``runtime_probe`` measured them: oneDNN's at ``CAPACITY`` or below and
    ideep's no larger (else a routed model's cache grows beyond what the budget adds)."""
    onednn, ideep = capacity(), _given(IDEEP_ENV)
    return onednn is not None and ideep is not None and onednn <= CAPACITY and ideep <= max(onednn, 1)


def held_bytes(full: int) -> int:
    """What the caches hold when a routed model has filled them, from ``full`` (``runtime_probe``'s
    ``kernel_cache``: a cache of ``CAPACITY`` entries): in proportion to oneDNN's capacity in force."""
    onednn = capacity()
    return 0 if onednn is None else full * min(onednn, CAPACITY) // CAPACITY


def caveat() -> str | None:
    """The sentence a CPU prediction of a routed model in 16 bits carries where the caches are not bounded as
    measured, else None."""
    if bounded():
        return None
    return (f"experts' batch sizes change with the routing every step, and in bf16 on CPU oneDNN and ideep each keep "
            f"a kernel per shape: with {ONEDNN_ENV}={os.environ.get(ONEDNN_ENV, DEFAULT_CAPACITY)} and "
            f"{IDEEP_ENV}={os.environ.get(IDEEP_ENV, DEFAULT_CAPACITY)} resident memory grows step by step above this "
            f"prediction, 0.3 to 0.9 MiB a new shape, until the caches are full (zeroplus bounds them at {CAPACITY} "
            f"and {IDEEP_CAPACITY} and counts that, unless ZEROPLUS_HOST_ALLOCATOR=keep or the process sets them)")


__all__ = ["settle", "capacity", "bounded", "held_bytes", "caveat", "CAPACITY", "IDEEP_CAPACITY", "ONEDNN_ENV",
           "IDEEP_ENV"]

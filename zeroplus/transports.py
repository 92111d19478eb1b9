"""Which collectives a group runs: its transport, chosen once when an engine is assembled.

``zeroplus.transport``: ``native`` (the tensor collectives, one launch each, as NCCL and HCCL run them; gloo runs
them too, so the suite runs a GPU job's collectives with values), ``gloo`` (per-rank in-place broadcasts and
reduces, the row exchange of two ranks), ``pair`` (``gloo`` with two ranks of one host swapping through shared
memory: ``shm_pair.py``) or ``auto`` (native on a device backend; on gloo the pair where two ranks share an
x86-64 host, else gloo). ``comm.DataParallelGroup.use_transport`` and the estimate's ``VirtualGroup`` both choose
by ``requested_transport``, so the prediction simulates the collectives the run takes.
See note: transport (docs/design-notes.md). Memory: none.
"""
from __future__ import annotations

TRANSPORTS = ("auto", "native", "gloo", "pair")  # zeroplus.transport


def requested_transport(transport: str, gloo: bool, size: int, shared_pair: bool, where: str, backend: str) -> str:
    """What ``transport`` (``zeroplus.transport``) asks of a group of ``size`` ranks (``gloo``: its backend is gloo,
    else it runs ``backend``; ``where`` names it in errors), before the pair is known to map: ``native``, ``gloo``
    or ``pair``. ValueError for what cannot run: gloo's paths on another backend, ``pair`` against
    ``shared_pair`` false. ``DataParallelGroup`` and the estimate's ``VirtualGroup`` both choose by it."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {TRANSPORTS}")
    if transport in ("gloo", "pair") and size > 1 and not gloo:
        raise ValueError(f"transport {transport!r} builds collectives from gloo's per-rank broadcasts and reduces, "
                         f"but {where} runs {backend}: use 'native' or 'auto'")
    if transport == "pair" and not shared_pair:
        raise ValueError("transport 'pair' with zeroplus.shared_memory_pair false: set one or the other")
    if size == 1 or not gloo:
        return "native" if transport == "auto" else transport
    if transport == "auto":
        return "pair" if shared_pair and size == 2 else "gloo"
    return transport


def without_pair(transport: str, where: str, size: int) -> str:
    """The transport where the pair was asked for and cannot map: ``gloo`` for ``auto``; ValueError for ``pair``."""
    if transport == "pair":
        raise ValueError(f"transport 'pair' needs {where} to be two ranks of one x86-64 host that can share a /dev/shm "
                         f"mapping (and ZEROPLUS_SHM_PAIR not 0); this one has {size} ranks or could not map it")
    return "gloo"

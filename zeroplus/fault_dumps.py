"""What a rank writes down when it goes wrong, and where: a collective that failed or timed out, memory that ran
out.

A failed collective (``collective_faults.py``) and an out-of-memory error in the engine's forward, backward or
step each write one text file per rank before the error propagates, and the error names it (in the
``CollectiveError``'s message; as a note added to the out-of-memory error, whose type is kept). The file
holds what the rank was doing: the engine's phase (``forward``, ``backward``, ``step``, ``checkpoint save``,
``checkpoint load``: a process-wide string the engine sets as it enters each) and, at stage 3, the unit whose
parameters were last gathered for compute (set by the stage-3 hooks; where no hook runs, one rank's resident
stage 3, the innermost unit whose forward is on the error's stack, looked up only when a dump is written), the
collective (kind, group, sequence number, group size) or the memory (the ledger's live and peak bytes per
category, the device's allocated and peak bytes), and every thread's Python stack (``faulthandler``). With
``zeroplus.memory_history`` on a CUDA device the allocator's history is recorded from the start
(``torch.cuda.memory._record_memory_history``) and an out-of-memory error also dumps it beside the text file
(``.pickle``, for PyTorch's memory viz).

Where: ``$ZEROPLUS_DUMP_DIR``, else ``zeroplus.dump_dir``, else ``<temp dir>/zeroplus-dumps``; files are named
``KIND-rankR-pidP-TIME.txt``. Costs nothing until something fails, but the phase and unit names (one
assignment per phase and per hooked unit) and, when asked for, the allocator's history.
"""
from __future__ import annotations

import faulthandler
import os
import tempfile
import time
import weakref
from types import TracebackType
from typing import Any

import torch

from .ledger import Category

_PHASE = "outside the engine's calls"
_UNIT: str | None = None  # stage 3: the unit whose parameters were last gathered for compute
_DIR: str | None = None
_UNIT_MODULES: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()  # (no hook names them)


def set_dump_dir(path: str | None) -> None:
    global _DIR
    _DIR = path


def set_phase(phase: str) -> None:
    """The engine enters ``phase`` (a dump says it)."""
    global _PHASE, _UNIT
    _PHASE, _UNIT = phase, None


def set_unit(name: str) -> None:
    """Stage 3 is about to compute unit ``name`` (its gather waited for first)."""
    global _UNIT
    _UNIT = name


def name_units(units: dict[torch.nn.Module, str]) -> None:
    """Units no hook names (``set_unit``): a dump names the innermost of them whose forward is on the error's stack."""
    _UNIT_MODULES.update(units)


def _unit_on_stack(tb: TracebackType | None) -> str | None:
    """The innermost ``name_units`` module whose ``forward`` (or a method it called) is a frame of ``tb``."""
    found = None
    while tb is not None:  # (outermost frame first)
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and owner in _UNIT_MODULES:
            found = _UNIT_MODULES[owner]
        tb = tb.tb_next
    return found


def phase() -> str:
    return _PHASE


def dump_dir() -> str:
    return os.environ.get("ZEROPLUS_DUMP_DIR") or _DIR or os.path.join(tempfile.gettempdir(), "zeroplus-dumps")


def write(kind: str, rank: int, lines: list[str], err: BaseException | None = None) -> str | None:
    """Write ``lines``, the phase and every thread's stack to a new file; its path (None if it could not be
    written: the error still propagates, without it). ``err``: the error, whose stack may name the unit."""
    try:
        directory = dump_dir()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{kind}-rank{rank}-pid{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.txt")
        with open(path, "w") as f:
            f.write(f"zeroplus {kind} on rank {rank}, pid {os.getpid()}\n")
            f.write(f"engine phase: {_PHASE}\n")
            on_stack = _unit_on_stack(err.__traceback__) if err is not None and _UNIT is None else None
            if _UNIT is not None:
                f.write(f"unit: {_UNIT} (stage 3: the last unit whose parameters were gathered for compute)\n")
            elif on_stack is not None:
                f.write(f"unit: {on_stack} (its forward was running)\n")
            for line in lines:
                f.write(line + "\n")
            f.write("\nPython stacks (every thread, most recent call first):\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        return path
    except OSError:
        return None


def is_out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory error (CUDA, NPU), Python's, or the CPU allocator's."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def out_of_memory(err: BaseException, rank: int, ledger: Any, accelerator: Any) -> str | None:
    """Write the memory state for ``err`` and add a note naming the file to it; the path."""
    lines = [f"error: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}",
             "", f"{'ledger category':<20}{'live bytes':>16}{'peak bytes':>16}"]
    for category in Category:
        lines.append(f"{category.value:<20}{ledger.live_bytes(category):>16,}{ledger.peak_bytes(category):>16,}")
    lines.append(f"{'total':<20}{ledger.live_bytes():>16,}{ledger.peak_bytes():>16,}")
    lines.append(f"device: allocated {accelerator.memory_allocated():,} bytes, "
                 f"peak {accelerator.max_memory_allocated():,}")
    path = write("oom", rank, lines, err)
    snapshot = _cuda_snapshot(path) if path is not None and accelerator.name == "cuda" else None
    if path is not None:
        err.add_note(f"zeroplus: rank {rank}'s memory per category and stacks were written to {path}"
                     + (f"; the allocator's history to {snapshot}" if snapshot else ""))
    return path


def record_memory_history(accelerator: Any) -> bool:
    """Start recording the CUDA allocator's history (``zeroplus.memory_history``); False where there is none."""
    if accelerator.name != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    return True


def _cuda_snapshot(path: str) -> str | None:
    target = path[:-len(".txt")] + ".pickle"
    try:
        torch.cuda.memory._dump_snapshot(target)
    except Exception:  # noqa: BLE001 - no history recorded, or no room: the text file stands alone
        return None
    return target

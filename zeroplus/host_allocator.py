"""Where a CPU rank's freed memory goes: back to the system, as the budget predicts.

A CPU rank's budget is its resident memory above the start of ``initialize``. glibc, as a process leaves
it, keeps much of what is freed: after a block above its mmap threshold (128 KiB at start) is freed it
raises the threshold to that block's size, up to 32 MiB, so later blocks of that size come from the
heap, which it gives back only from its top: a freed block below a live one stays resident. What it keeps
counts in the peak; no prediction of tensors can know how much (see note: host allocator).

``settle(mode)``, called through the CPU accelerator when zeroplus is imported (``mode_from_env()``:
``ZEROPLUS_HOST_ALLOCATOR``, default ``return``), before the script builds its model:

- ``"return"`` (the default): ``mallopt`` fixes the mmap and trim thresholds at ``THRESHOLD`` (the
  values of ``runtime_overhead.ALLOCATOR_ENV``) and ``malloc_trim(0)`` returns what
  the process kept before, so every block the engine frees goes back and the predicted peak is the
  measured one. Settled at import, not in ``initialize``: a model whose initialisation frees a temporary
  per parameter (``nn.Parameter(torch.randn(o, i) / i ** 0.5)``) raises glibc's threshold as it is built,
  so its parameters sit in the heap; once ZeRO-3 frees their whole copies glibc hands those free blocks
  out again before it maps new ones, and what the step touches there stays resident (the 111M GPT written
  with its own classes, 2 ranks: 1022-1052 MiB measured against 915 predicted when settled at
  ``initialize``, 937 when settled before the model). ``release()``, when ``initialize`` starts and when
  the engine is assembled, returns the free memory glibc holds then: the start is measured without what
  the process freed before, and the whole parameters ZeRO-3 freed go back (a model built before ``import
  zeroplus`` has them in the heap). A process started with
  ``MALLOC_*`` variables (``ALLOCATOR_VARIABLES``) keeps its settings; zeroplus says so and leaves them.
- ``"keep"``: glibc as it is. Faster on CPU (no page faults on reused memory: the 111M GPT's step 1.24 s
  against 1.99 s), and the budget's figures then leave out what glibc keeps: ``caveat()`` says so beside
  every prediction.

Not glibc (musl, macOS): nothing to set, ``"unavailable"``. Accelerators other than the CPU budget their
device allocator, not resident memory: the accelerator does not call this.
Memory: none; time: once per process (later calls return the first outcome). See note: host allocator.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger("zeroplus.engine")

# bytes: the mmap and trim thresholds, fixed, below glibc's own start (128 KiB): a block under the threshold comes from
# the heap, where it stays resident once freed while a live block sits above it (see note: host allocator)
THRESHOLD = 32 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MODES = ("return", "keep")
ENV = "ZEROPLUS_HOST_ALLOCATOR"
# variables glibc reads at a process's start that decide what it keeps: a process started with one is the user's
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_settled: list[str] = []  # what the process's first settle() set (at import): later calls return it


def settle(mode: str) -> str:
    """Set this process's allocator for ``mode`` (``MODES``), once; returns what holds: ``"returning"``,
    ``"keeping"``, ``"user"`` (the process's ``MALLOC_*`` variables) or ``"unavailable"`` (not glibc)."""
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not one of {list(MODES)}")
    if not _settled:
        _settled.append(_settle(mode))
    return _settled[0]


def _settle(mode: str) -> str:
    if mode == "keep":
        return "keeping"
    given = [name for name in ALLOCATOR_VARIABLES if name in os.environ]
    if given:
        logger.info("host allocator: the process was started with %s; zeroplus leaves glibc as they set it (the "
                    "budget assumes freed memory is returned)", ", ".join(f"{n}={os.environ[n]}" for n in given))
        return "user"
    libc = _glibc()
    if libc is None:
        return "unavailable"
    set_ok = libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
    if not set_ok:
        logger.warning("host allocator: glibc refused mallopt(%d); freed memory may stay resident beyond the budget",
                       THRESHOLD)
        return "unavailable"
    libc.malloc_trim(0)
    return "returning"


def mode_from_env() -> str:
    """``ZEROPLUS_HOST_ALLOCATOR``, default ``return``."""
    return os.environ.get(ENV, "return").strip().lower() or "return"


def release() -> None:
    """Give back to the system the free memory glibc holds (``malloc_trim(0)``), unless the process keeps it
    (``"keep"``) or is not on glibc."""
    libc = _glibc() if _settled and _settled[0] in ("returning", "user") else None
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


GLIBC_MMAP_THRESHOLD = 128 * 1024  # glibc's own mmap threshold at a process's start (it then rises with freed blocks)


def caveat() -> str | None:
    """The sentence a CPU prediction carries where this process leaves freed memory with glibc, else None: with
    ``"keep"``, and where the process's own ``MALLOC_*`` variables leave an mmap threshold above ``THRESHOLD``
    (set, or glibc's own where only others are set), whose freed heap blocks under it stay resident while a live
    one sits above them."""
    if _settled == ["keeping"]:
        return (f"{ENV}=keep: what glibc keeps of freed memory stays resident and is in the measured peak (the "
                "111M GPT at 2 ranks: 1194 MiB kept against 951 returned)")
    if _settled == ["user"]:
        given = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        try:
            threshold = int(given) if given is not None else GLIBC_MMAP_THRESHOLD
        except ValueError:
            threshold = GLIBC_MMAP_THRESHOLD
        if threshold > THRESHOLD:
            said = (f"MALLOC_MMAP_THRESHOLD_={given}" if given is not None
                    else "glibc's own mmap threshold (rising with freed blocks up to 32 MiB)")
            return (f"the process's {said} serves blocks under {threshold // 1024} KiB from the heap, where a freed "
                    f"one stays resident while a live one sits above it: the measured peak can exceed this "
                    f"prediction by them (the 111M GPT with its own classes, bf16, 2 ranks, at 128 KiB: -5.2%); "
                    f"without MALLOC_* variables zeroplus sets {THRESHOLD // 1024} KiB (see note: host allocator)")
    return None


__all__ = ["settle", "release", "caveat", "mode_from_env", "MODES", "ENV", "THRESHOLD", "ALLOCATOR_VARIABLES"]

"""torch's flight recorder on CPU ranks: off by default, since its ring grows the memory a CPU rank's budget counts.

torch.distributed keeps, in each process, a ring of records of the last collectives (``TORCH_FR_BUFFER_SIZE``
entries; torch's older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``), each the collective's description and the stack that
issued it, for diagnosing hangs. The ring is made with the process's first process group, from the variable as it is
then, and is on unless the variable says 0. It lives in host memory and grows until it is full: on a CPU rank that is
the memory the budget counts, and nothing in the ledger sees it. The main job on 2 ranks (GPT small, 128 tokens,
2026-12-06) read its memory line 2.0% under the measured peak at step 25 and 7.1% under it at step 800 with the ring
on (glibc's in-use bytes +0.4 MiB every 100 steps), flat with it off; torch's gloo alone, 1000 small all-reduces:
+1 MiB.

``settle(mode)``, called through the CPU accelerator when zeroplus is imported (beside ``host_allocator`` and
``host_kernel_cache``): ``"return"`` (the default, ``ZEROPLUS_HOST_ALLOCATOR``) sets ``TORCH_FR_BUFFER_SIZE=0``
unless the process set either variable or a process group exists already (its ring is made: too late to change);
``"keep"`` leaves the process as it is. zeroplus's own report of a collective that does not complete names the
collective, its group and the rank that did not arrive (see note: who did not arrive). Where the ring records
(``recording``), the prediction says it leaves it out (``caveat``). GPUs and NPUs: the ring is host memory beside the
device's, which the budget does not count, and torch's default stands. See note: flight recorder.
"""
from __future__ import annotations

import logging
import os

import torch.distributed as dist

logger = logging.getLogger("zeroplus.engine")

ENV = "TORCH_FR_BUFFER_SIZE"
LEGACY_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"


def _asked() -> str | None:
    return os.environ.get(ENV, os.environ.get(LEGACY_ENV))


def settle(mode: str) -> None:
    """Turn the ring off for ``mode`` "return" where the process has not set it and no process group exists."""
    if mode == "keep":
        return
    made = dist.is_available() and dist.is_initialized()
    if _asked() is None and not made:
        os.environ[ENV] = "0"
    elif _asked() is not None:
        logger.info("flight recorder: the process was started with %s=%s; zeroplus leaves it", ENV, _asked())


def recording() -> bool:
    """Whether this process's collectives are recorded in the ring (the variable unset, or above 0)."""
    asked = _asked()
    if asked is None:
        return True
    try:
        return int(asked) > 0
    except ValueError:
        return True


def caveat(world_size: int) -> str | None:
    """The prediction's sentence on the ring, where ``world_size`` ranks run collectives and it records; else None."""
    if world_size < 2 or not recording():
        return None
    return (f"torch's flight recorder, on in this process ({ENV} {_asked() or 'unset'}, or a process group made "
            f"before zeroplus was imported): a ring of the last collectives' records, a KiB or more each, growing "
            f"until it is full; {ENV}=0 before the first process group leaves it out")

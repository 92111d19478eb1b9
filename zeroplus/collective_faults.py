"""What a failed or timed-out collective says: which collective, which group, and who did not arrive.

Every collective zeroplus issues runs with the process group's timeout (``zeroplus.collective_timeout``,
600 s by default, applied to the groups zeroplus creates; torch's own default is 30 minutes). When one
fails (a timeout, or a peer that died), the rank raises ``CollectiveError`` naming the collective, its
group, its sequence number in that group and this rank. To name the rank that did not arrive, the
failing ranks hold a roll call in the job's key-value store (the rendezvous store torch.distributed
already has; the process group itself is unusable after a gloo timeout): each posts where it is
stuck, waits up to ``ROLL_CALL_SECONDS`` for the others, and the ranks that never posted are the ones
that did not arrive (stalled elsewhere, or dead). Ranks stuck in different collectives (a divergent
program) are listed with theirs. Each failing rank also writes what it was doing (its phase, the
collective, every thread's stack) to a file the error names (``fault_dumps.py``). Costs nothing until a
collective fails.
See note: who did not arrive (docs/design-notes.md).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from . import fault_dumps

logger = logging.getLogger("zeroplus.comm")

ROLL_CALL_SECONDS = 3.0
_KEY = "zeroplus/stuck/"


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank (timeout or a peer gone); the message says where."""


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the roll call is skipped
        return None


def _roll_call(where: str) -> str:
    """Post where this rank is stuck; return who else is stuck where, and who never posted."""
    store = _store()
    if store is None or not dist.is_initialized():
        return "the rank that did not arrive could not be determined (no rendezvous store)"
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(f"{_KEY}{rank}", where)
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        posted: dict[int, str] = {}
        while True:
            for r in range(world):
                if r not in posted and store.check([f"{_KEY}{r}"]):
                    posted[r] = store.get(f"{_KEY}{r}").decode()
            if len(posted) == world or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception as err:  # noqa: BLE001 - the store itself is gone (rank 0 died)
        return f"the rank that did not arrive could not be determined (store: {err})"
    absent = [r for r in range(world) if r not in posted]
    elsewhere = {r: w for r, w in posted.items() if w != where}
    parts = []
    if absent:
        parts.append(f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} did not arrive (not "
                     f"waiting in any zeroplus collective: stalled in other code, or dead)")
    if elsewhere:
        parts.append("ranks waiting in other collectives (the ranks' programs diverged): "
                     + "; ".join(f"rank {r}: {w}" for r, w in sorted(elsewhere.items())))
    return "; ".join(parts) if parts else "every rank reached this collective (a network or backend failure)"


def collective_failed(kind: str, label: str, seq: int, rank: int, size: int, err: BaseException) -> CollectiveError:
    """The error to raise for ``err``, raised by collective ``kind`` (number ``seq``) in group ``label``."""
    where = f"{kind} #{seq} in the {label} group"
    timeout = current_timeout_seconds()
    who = _roll_call(where)
    backend = str(err).strip().splitlines()[0] if str(err).strip() else str(type(err))
    dump = fault_dumps.write("collective", rank, [f"collective: {where} ({size} ranks)", f"roll call: {who}",
                                                  f"backend: {backend}"])
    error = CollectiveError(
        f"zeroplus: {where} ({size} ranks) failed on rank {rank}"
        + (f" (collective timeout {timeout:g} s, config key 'zeroplus.collective_timeout')" if timeout else "")
        + f": {who}. Backend: {backend}"
        + (f". What this rank was doing (phase, collective, stacks): {dump}" if dump else ""))
    logger.error("%s", error)
    return error


_TIMEOUT_S: float | None = None


def set_timeout_seconds(seconds: float | None) -> None:
    """Remember the timeout of the process group zeroplus created (for messages)."""
    global _TIMEOUT_S
    _TIMEOUT_S = seconds


def current_timeout_seconds() -> float | None:
    return _TIMEOUT_S

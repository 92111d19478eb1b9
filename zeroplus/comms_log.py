"""The communication log (DeepSpeed's ``"comms_logger"``): per collective kind and group, the count, bytes,
time, algorithmic and bus bandwidth, and which rank the others wait for.

Config, as DeepSpeed's: ``"comms_logger": {"enabled": true, "verbose": false, "prof_all": true,
"prof_ops": ["all_reduce"]}``: ``prof_all`` logs every kind, else only those in ``prof_ops`` (zeroplus's kind
names or DeepSpeed's: ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``);
``verbose`` logs each collective as it completes. The log is an observer of the collectives
(``comm_observers.py``); it keeps one row per kind and group, not one entry per collective.

Per row: the link its group crosses (``intra_node`` where its ranks share a node, else ``inter_node``; nodes from
``zeroplus.node_size`` or the launch's ``LOCAL_WORLD_SIZE``), count, bytes (the textbook message: an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor), latency (issue to the wait that saw it done: an upper bound
where it overlapped compute), the time callers were blocked waiting, and bandwidth as nccl-tests and DeepSpeed define
it: ``algbw = bytes / latency``, ``busbw = algbw * factor`` with factor ``2 (n - 1) / n`` for an all-reduce,
``(n - 1) / n`` for an all-gather, a reduce-scatter and an all-to-all, 1 for a broadcast or a ring step.

The theory a data group's bytes per optimizer step follow (Ψ: the trained elements, padded to the group;
each element's bytes in the communication dtype): stages 1-2 reduce-scatter Ψ and all-gather Ψ (2Ψ); stage 3
all-gathers Ψ in forward and again in backward and reduce-scatters Ψ (3Ψ); stage 0 all-reduces Ψ, whose
bus traffic is 2Ψ. ``tests/engine/test_comms_log.py`` checks it.

The straggler: at each ``straggler(world)`` (every ``steps_per_print`` steps), every rank's time blocked in
collectives since the last call is gathered; the rank blocked least is the one the others waited for (it
arrived last). The summary names the rank that was it most often.
Memory: a few numbers per kind and group.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from . import comm_observers
from .comm_observers import Completed

logger = logging.getLogger("zeroplus.comms")

DEEPSPEED_NAMES = {"all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
                   "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
                   "all_to_all_single": "all_to_all", "all_reduce": "all_reduce", "broadcast": "broadcast",
                   "send": "ring", "recv": "ring", "isend": "ring", "irecv": "ring"}


def bus_factor(kind: str, size: int) -> float:
    """busbw / algbw for a collective of ``kind`` over ``size`` ranks (nccl-tests' convention)."""
    if kind == "all_reduce":
        return 2 * (size - 1) / size
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (size - 1) / size
    return 1.0


@dataclasses.dataclass
class Row:
    """One kind of collective in one group."""

    size: int
    link: str = ""  # intra_node / inter_node (``DataParallelGroup.place``)
    count: int = 0
    nbytes: int = 0
    latency: float = 0.0
    blocked: float = 0.0

    @property
    def algbw(self) -> float:
        """Bytes per second moved per collective, on average."""
        return self.nbytes / self.latency if self.latency > 0 else 0.0


class CommsLog:
    """What ``comms_logger`` records in this process (an observer of the collectives)."""

    def __init__(self, prof_all: bool = True, prof_ops: list[str] | None = None, verbose: bool = False) -> None:
        self.prof_all, self.verbose = prof_all, verbose
        self.prof_ops = {DEEPSPEED_NAMES.get(op, op) for op in prof_ops or []}
        self.rows: dict[tuple[str, str], Row] = {}
        self._blocked_since = 0.0
        self.stragglers: collections.Counter[int] = collections.Counter()

    def completed(self, event: Completed) -> None:
        if not self.prof_all and event.kind not in self.prof_ops:
            return
        row = self.rows.setdefault((event.kind, event.group), Row(event.size, event.link))
        row.count += 1
        row.nbytes += event.nbytes
        row.latency += event.latency
        row.blocked += event.blocked
        self._blocked_since += event.blocked
        if self.verbose:
            logger.info("comm %s (%s group of %d): %d bytes, %.3f ms, blocked %.3f ms", event.kind, event.group,
                        event.size, event.nbytes, event.latency * 1e3, event.blocked * 1e3)

    def bytes_by_kind(self, group: str = "data") -> dict[str, int]:
        return {kind: row.nbytes for (kind, g), row in self.rows.items() if g == group}

    def bytes_by_link(self) -> dict[str, int]:
        """Bytes over the links between nodes (``inter_node``: a group whose ranks span nodes) and within one
        (``intra_node``), every group and kind summed (``zeroplus.node_size``, else the launch's nodes)."""
        out = {"intra_node": 0, "inter_node": 0}
        for row in self.rows.values():
            if row.link:
                out[row.link] += row.nbytes
        return out

    def reset(self) -> None:
        self.rows.clear()
        self._blocked_since = 0.0
        self.stragglers.clear()

    def straggler(self, world: Any) -> int | None:
        """Every rank of ``world`` calls it: the rank blocked least since the last call (the one the others
        waited for), tallied; None when nobody waited."""
        blocked = world.all_gather_objects(self._blocked_since) if world.size > 1 else [self._blocked_since]
        self._blocked_since = 0.0
        if len(blocked) < 2 or max(blocked) <= 0:
            return None
        last = min(range(len(blocked)), key=lambda r: blocked[r])
        self.stragglers[last] += 1
        return last

    def summary(self) -> str:
        """The table ``log_summary()`` prints."""
        lines = [f"{'collective':<16}{'group':<10}{'link':<11}{'ranks':>6}{'count':>8}{'MB':>11}{'latency ms':>12}"
                 f"{'blocked ms':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
        for (kind, group), row in sorted(self.rows.items()):
            lines.append(f"{kind:<16}{group:<10}{row.link:<11}{row.size:>6}{row.count:>8}{row.nbytes / 2**20:>11.2f}"
                         f"{row.latency * 1e3:>12.1f}{row.blocked * 1e3:>12.1f}{row.algbw / 1e9:>12.3f}"
                         f"{row.algbw * bus_factor(kind, row.size) / 1e9:>12.3f}")
        links = self.bytes_by_link()
        if links["inter_node"] or links["intra_node"]:
            lines.append(f"bytes within a node {links['intra_node'] / 2**20:.2f} MB, across nodes "
                         f"{links['inter_node'] / 2**20:.2f} MB")
        if self.stragglers:
            rank, times = self.stragglers.most_common(1)[0]
            lines.append(f"straggler: rank {rank}, the one the others waited for at {times} of "
                         f"{sum(self.stragglers.values())} reports")
        return "\n".join(lines)


_PROCESS_LOG: CommsLog | None = None


def process_log(prof_all: bool = True, prof_ops: list[str] | None = None, verbose: bool = False) -> CommsLog:
    """This process's log, made and attached to the collectives at the first call (an engine whose config enables
    ``comms_logger``); later engines share it, as DeepSpeed's engines share ``deepspeed.comm``'s logger."""
    global _PROCESS_LOG
    if _PROCESS_LOG is None:
        _PROCESS_LOG = CommsLog(prof_all, prof_ops, verbose)
        comm_observers.attach(_PROCESS_LOG)
    return _PROCESS_LOG


def current() -> CommsLog | None:
    """The process's log, if an engine enabled one."""
    return _PROCESS_LOG

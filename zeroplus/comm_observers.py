"""Who watches the collectives: the communication log and the step timers see each one as it completes.

Every tensor collective of a ``DataParallelGroup`` is issued in ``_run`` and completes in ``Handle.wait``.
While an observer is attached (``attach``), ``_run`` notes the issue time and ``wait`` reports, once the
backend says the collective is done, a ``Completed``: its kind (``all_gather``, ``reduce_scatter``,
``all_reduce``, ``all_to_all``, ``broadcast``, ``ring``), the group's label, size and link, the message bytes
(the textbook message: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor, an
all-to-all's input, a broadcast's tensor, what a ring step sends), when it was issued, when the caller began
to wait and when the wait returned. With none attached, a collective costs one test of an empty list.
Observers are process-wide, like the process groups they watch (DeepSpeed's ``deepspeed.comm`` logger is
too): the engine attaches its own and detaches them in ``destroy()``.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Completed:
    """One collective, as the caller saw it end."""

    kind: str
    group: str     # the group's label: data, tensor, pipeline, expert, context, ...
    size: int      # ranks in the group
    nbytes: int    # the message (see the module docstring)
    issued: float  # time.perf_counter() at issue
    waited: float  # ... when the caller began to wait
    done: float    # ... when the wait returned
    link: str = ""  # "intra_node" or "inter_node": whether the group's ranks share a node (``place``); "": not placed

    @property
    def latency(self) -> float:
        """Issue to completion as seen by the caller: an upper bound of the collective's own time (it may have
        finished while the caller computed)."""
        return self.done - self.issued

    @property
    def blocked(self) -> float:
        """What the caller spent waiting for it."""
        return self.done - self.waited


class Observer(Protocol):
    def completed(self, event: Completed) -> None: ...


OBSERVERS: list[Observer] = []


def attach(observer: Observer) -> None:
    if observer not in OBSERVERS:
        OBSERVERS.append(observer)


def detach(observer: Observer) -> None:
    if observer in OBSERVERS:
        OBSERVERS.remove(observer)

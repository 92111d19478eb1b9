"""What the layers above ask of a data-parallel group, and the handle its collectives return.

``Collectives`` is the interface: ``comm.DataParallelGroup`` (a process group) and the estimator's
``VirtualGroup`` (one rank of any size simulated in one process, nothing moved: ``budget/virtual_group.py``)
provide it; ``ScalarSum`` is the one collective a per-parameter statistic needs. Every collective is issued
asynchronously and returns a ``Handle`` whose ``wait()`` runs at the last moment the result is needed: it turns
a backend error into the error raised (``CollectiveError``, ``collective_faults.py``), returns only once gloo's
worker has let go of the fresh aliases it was given (see note: gloo in place), tells the observers
(``comm_observers.py``) and then runs the completion callback once.
Memory: none of its own; a handle holds its work until waited.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import torch

from . import comm_observers
from .comm_observers import Completed
from .ledger import Ledger

RELEASE_WAIT_SECONDS = 5.0  # how long a wait spins for gloo's worker to let go of a finished work's tensors

logger = logging.getLogger("zeroplus.comm")


class Handle:
    """An in-flight collective; ``wait()`` blocks, then runs the completion callback once.
    ``failed(err)`` turns a backend error into the error raised (``CollectiveError``). ``held``: fresh
    aliases the backend's worker holds (gloo); ``wait()`` returns once it has released them. ``seen``: what the
    observers are told when it completes (``comm_observers.py``; None when none was attached at issue)."""

    def __init__(self, work: Any | None, on_done: Callable[[], None] | None = None,
                 failed: Callable[[BaseException], BaseException] | None = None,
                 held: tuple[torch.Tensor, ...] = (), seen: tuple[str, str, int, int, float, str] | None = None
                 ) -> None:
        self._work = work
        self._on_done = on_done
        self._failed = failed
        self._held = held
        self._seen = seen
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        waited = time.perf_counter() if self._seen is not None else 0.0
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as err:
                raise (self._failed(err) if self._failed is not None else err) from err
            self._work = None  # the work object references its tensors: drop them with it
        until_released(self._held)
        self._held = ()
        self.done = True
        if self._seen is not None:
            kind, group, size, nbytes, issued, link = self._seen
            event = Completed(kind, group, size, nbytes, issued, waited, time.perf_counter(), link)
            for observer in list(comm_observers.OBSERVERS):
                observer.completed(event)
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


def until_released(held: tuple[torch.Tensor, ...]) -> None:
    """Spin (yielding the GIL) until this thread's alias is the only owner of each tensor in ``held``."""
    deadline = None
    for t in held:
        while t._use_count() > 1:  # type: ignore[attr-defined]  # the C++ tensor's owners
            now = time.monotonic()
            deadline = deadline or now + RELEASE_WAIT_SECONDS
            if now > deadline:
                logger.debug("a finished collective's tensor is still held after %.0f s", RELEASE_WAIT_SECONDS)
                return
            time.sleep(0)


class ScalarSum(Protocol):
    """The one collective a per-parameter statistic needs (Lamb's trust ratios): a scalar summed over ranks.
    ``Collectives`` provides it, and so does a stand-in for one rank."""

    size: int

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor: ...


class AllGather(Protocol):
    """An all-gather over a group and its rank and size: ``Collectives`` provides it, and so does MiCS's two-level
    gather (``zero/two_level_gather.py``), which the parameters' gathers take where the config asks for it."""

    rank: int
    size: int

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle: ...


class Collectives(Protocol):
    """What the layers above ask of a data-parallel group: ``DataParallelGroup`` (a process group) and the
    estimator's ``VirtualGroup`` (one rank of any size simulated in one process, nothing moved:
    ``budget/virtual_group.py``) provide it. Semantic operations only: how bytes move is the group's transport
    (``transports.py``), chosen once by ``use_transport``; ``initialized``: a real process group stands behind it."""

    rank: int
    size: int
    initialized: bool
    group: Any

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, on_done: Callable[[], None] | None = None
                   ) -> Handle: ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       on_done: Callable[[], None] | None = None) -> Handle: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   on_done: Callable[[], None] | None = None) -> Handle: ...

    def all_gather_joined(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                          on_done: Callable[[], None] | None = None) -> Handle: ...

    def reduce_scatter_rows(self, rows: torch.Tensor, target: torch.Tensor, scale: float, accumulate: bool,
                            buffers: Ledger) -> Handle: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle: ...

    def use_transport(self, transport: str, ledger: Ledger, shared_pair: bool = True) -> str: ...

    def place(self, node_size: int) -> str: ...

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                     input_sizes: list[int]) -> None: ...

    def shift_ring(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def max_flag(self, flag: bool) -> bool: ...

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def all_gather_objects(self, obj: Any) -> list[Any]: ...

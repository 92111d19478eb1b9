"""A stand-in for a process group: one rank of a group of any size, simulated in one process.

The memory estimate partitions and trains the model on the meta device as rank ``rank`` of ``size``
would; its collectives allocate their outputs (and, on CPU, what gloo holds while they run) and move
nothing.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..collectives import Collectives, Handle
from ..ledger import Category, Ledger
from ..shm_pair import MAPPING_BYTES, possible_here
from ..transports import requested_transport, scaled_into, scatter_rows, without_pair


class VirtualGroup:
    """A data-parallel group of ``size`` ranks as seen from ``rank``; collectives move nothing.

    ``gloo_buffers``: hold what gloo holds while a collective runs (measured on CPU with 2 ranks:
    its own reduce-scatter copies its whole input, a temporary of that size until done; all-reduce
    works in place, and so do the all-gather and reduce-scatter ``comm.py`` builds from broadcasts
    and reduces, but for a few MiB), as a tensor on the input's device, so the estimator sees it:
    one at a time (gloo's worker runs collectives in order), from the moment the collective is
    issued until it is waited on or the next one is issued. NCCL and HCCL work in place: off.
    The transport is chosen as a real group chooses it (``use_transport``): with ``gloo_buffers`` (a
    simulated gloo group) ``auto`` is ``pair`` or ``gloo``, whose per-rank paths hold nothing; ``native`` runs
    gloo's own all-gather and reduce-scatter, which hold the copies above, and the rows' comm buffers
    (``transports.scatter_rows``, the same function the real native transport runs)."""

    initialized = False
    group = None

    def __init__(self, rank: int, size: int, gloo_buffers: bool = False) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a world of {size} ranks")
        self.rank, self.size, self.gloo_buffers = rank, size, gloo_buffers
        self.transport = "gloo" if gloo_buffers and size > 1 else "native"  # until use_transport: auto without the pair
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        self.running: Handle | None = None
        self.temporary: torch.Tensor | None = None
        self.pair: torch.Tensor | None = None

    def place(self, node_size: int) -> str:
        """Nothing is observed in a simulation: no link."""
        return ""

    def use_transport(self, transport: str, ledger: Ledger, shared_pair: bool = True) -> str:
        """``DataParallelGroup.use_transport`` for the simulated group: the pair's bytes in the ledger where this
        process could map one (a two-rank gloo job over two hosts would not); the same errors."""
        where = f"the simulated group (rank {self.rank} of {self.size})"
        chosen = requested_transport(transport, self.gloo_buffers and self.size > 1, self.size, shared_pair, where,
                                     "a device backend")
        if chosen == "pair" and not (self.size == 2 and possible_here()):
            chosen = without_pair(transport, where, self.size)
        if chosen == "pair" and self.pair is None:
            self.pair = ledger.track(torch.empty(MAPPING_BYTES, dtype=torch.uint8, device="meta"),
                                     Category.COMM_BUFFER)
        self.transport = chosen
        return chosen

    @property
    def per_rank(self) -> bool:
        """Whether the transport takes gloo's per-rank paths (broadcasts, reduces, the exchange): nothing held."""
        return self.transport in ("gloo", "pair") and self.size > 1

    def _held(self, like: torch.Tensor, on_done: Callable[[], None] | None) -> Handle:
        if not (self.gloo_buffers and self.size > 1):
            return Handle(None, on_done)
        self.running, self.temporary = None, None  # the previous collective is done
        self.temporary = torch.empty_like(like)
        self.running = handle = _Held(self, on_done)
        return handle

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, on_done: Callable[[], None] | None = None
                   ) -> Handle:
        if self.per_rank:
            return Handle(None, on_done)  # broadcasts in place
        return self._held(output, on_done)  # gloo's own all-gather holds a copy of its output (native)

    def all_gather_joined(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                          on_done: Callable[[], None] | None = None) -> Handle:
        """Several all-gathers issued together: the native transport joins them into one call, for which gloo holds
        every input and every output flattened at once (measured: 2 x 64 MiB outputs at 2 ranks, 322 MiB at the
        peak against 230-258 one at a time)."""
        if len(pairs) == 1:
            return self.all_gather(*pairs[0], on_done=on_done)
        if self.per_rank or not (self.gloo_buffers and self.size > 1):
            return Handle(None, on_done)  # broadcasts in place; a device backend's in place
        numel = sum(o.numel() + i.numel() for o, i in pairs)
        return self._held(torch.empty(numel, dtype=pairs[0][0].dtype, device=pairs[0][0].device), on_done)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       on_done: Callable[[], None] | None = None) -> Handle:
        return self._held(input, on_done)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, on_done: Callable[[], None] | None = None) -> Handle:
        return Handle(None, on_done)

    def reduce_scatter_rows(self, rows: torch.Tensor, target: torch.Tensor, scale: float, accumulate: bool,
                            buffers: Ledger) -> Handle:
        if self.per_rank or self.size == 1:  # in place: reduces, an exchange into ``target``; gloo holds nothing
            return Handle(None, scaled_into(target, rows[self.rank], scale, accumulate))
        return scatter_rows(self.reduce_scatter, rows, target, scale, accumulate, buffers)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        return Handle(None)

    def shift_ring(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        return [torch.empty_like(t) for t in tensors], Handle(None)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                     input_sizes: list[int]) -> None:
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        return None  # gloo broadcasts in place

    def max_flag(self, flag: bool) -> bool:
        return flag

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every simulated rank holds what this one does."""
        return [obj] * self.size

    def barrier(self) -> None:
        return None


class _Held(Handle):
    """A virtual collective whose backend temporary is freed when it is waited on, or when the
    group starts the next collective (gloo runs one at a time, in order)."""

    def __init__(self, group: VirtualGroup, on_done: Callable[[], None] | None) -> None:
        super().__init__(None, on_done)
        self.group = group

    def wait(self) -> None:
        if self.group.running is self:
            self.group.running, self.group.temporary = None, None
        super().wait()


if TYPE_CHECKING:  # mypy proves the simulation provides what a process group does
    _: type[Collectives] = VirtualGroup

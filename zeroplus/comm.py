"""Communication: the data-parallel group and async collectives that return handles (``collectives.py``).

Every collective is issued with ``async_op=True`` and returns a ``Handle`` whose ``wait()`` runs
at the last moment the result is needed. With world size 1 the collectives complete at once
without calling torch.distributed, so one code path serves 1 and N ranks. Bytes sent per
collective kind are counted for reports and benchmarks. A collective that fails or times out raises
``CollectiveError`` naming itself, its group and the rank that did not arrive
(``collective_faults.py``); the process group zeroplus creates gets ``zeroplus.collective_timeout``.

The group offers semantic operations (all-gather into, reduce-scatter into, the rows of a matrix
reduce-scattered into a shard, all-reduce, all-to-all, broadcast, scalars); which backend works carry the
all-gathers and reductions is its transport (``transports.py``: native tensor collectives, gloo's per-rank
broadcasts and reduces, or the shared-memory pair), chosen once when an engine is assembled (``use_transport``)
and never seen by the layers above. Every transport sends the textbook bytes (all-gather: its output;
reduce-scatter: its input), which ``bytes_sent`` counts by kind.

Gloo's worker threads hand each finished work's tensors back after the caller's ``wait()`` has
returned. If the caller's Python tensor is gone by then, the worker must take the GIL to free it; at
interpreter exit that GIL request ends the worker thread mid-destructor and the process aborts
("terminate called without an active exception", seen in about one run in 200). So every gloo
collective gets fresh aliases of its tensors (``detach()``: same storage, its own tensor object),
and ``Handle.wait()`` returns only once the backend has let go of them (``collectives.until_released``: a few
microseconds), so the last reference to every tensor is this thread's.
See note: gloo in place; see note: gloo broadcasts and reduces; see note: gloo exchange; see note: transport
(docs/design-notes.md).
"""
from __future__ import annotations

import collections
import datetime
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from . import comm_observers
from .accelerator import get_accelerator
from .collective_faults import collective_failed, current_timeout_seconds, set_timeout_seconds
from .collectives import Collectives, Handle
from .ledger import Category, Ledger
from .shm_pair import MAPPING_BYTES, MIN_BYTES, SharedPair, open_pair
from .transports import NATIVE, Native, Pair, PerRank, Works, native_on, requested_transport, scaled_into, without_pair

DEFAULT_TIMEOUT_SECONDS = 600.0

logger = logging.getLogger(__name__)


def init_distributed_if_launched(timeout_seconds: float | None = None) -> None:
    """Initialise torch.distributed when a launcher set RANK/WORLD_SIZE and nobody has yet, with
    ``timeout_seconds`` (default ``DEFAULT_TIMEOUT_SECONDS``) for every collective."""
    if not dist.is_available() or dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        accel = get_accelerator()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        accel.set_device(local_rank)
        seconds = DEFAULT_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds
        dist.init_process_group(backend=accel.comm_backend, timeout=datetime.timedelta(seconds=seconds))
        set_timeout_seconds(seconds)


def _timeout_seconds() -> float:
    return current_timeout_seconds() or DEFAULT_TIMEOUT_SECONDS


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``tensor``'s storage that nothing else references."""
    return tensor.detach()


class DataParallelGroup:
    """A process group with rank, size and counted async collectives (sum reductions), carried by its transport."""

    def __init__(self, group: Any | None = None, label: str = "data") -> None:
        """``label``: the group's kind in messages (data, tensor, pipeline, expert, ...)."""
        self.initialized = dist.is_available() and dist.is_initialized()
        self.group = group
        self.label = label
        self.rank = dist.get_rank(group) if self.initialized else 0
        self.size = dist.get_world_size(group) if self.initialized else 1
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        self.issued = 0  # collectives issued in this group, for messages
        backend = str(dist.get_backend(group)) if self.initialized and self.size > 1 else ""
        self.gloo = backend == "gloo"  # the backend's worker holds aliases of a collective's tensors (launch)
        # the transport (use_transport; until an engine chooses one, auto without the pair)
        self.carrier: Native = PerRank() if self.gloo else NATIVE
        self.pair: SharedPair | None = None  # two gloo ranks of one host: large swaps through shared memory
        self.link = ""  # intra_node / inter_node (``place``), what the observers are told of each collective

    @property
    def transport(self) -> str:
        """The transport's name: ``native``, ``gloo`` or ``pair`` (``transports.py``)."""
        return self.carrier.name

    def use_transport(self, transport: str, ledger: Ledger, shared_pair: bool = True) -> str:
        """Collective: how this group's all-gathers and reductions move bytes from now on (``transports.py``);
        returns the transport chosen (``auto`` resolved). ``shared_pair``: whether ``pair`` (or ``auto``) may map
        the shared pair (``shm_pair.py``, 4 MiB in ``ledger``). A group of one rank moves nothing: ``native``.
        ValueError, the same on every rank, for ``gloo`` or ``pair`` on another backend, and for ``pair`` where
        the group is not two ranks of one x86-64 host that can share a mapping. Engines share a process's groups:
        the last one built decides; a mapping made stays."""
        where = f"the {self.label} group (rank {self.rank} of {self.size})"
        backend = str(dist.get_backend(self.group)) if self.initialized and self.size > 1 else ""
        chosen = requested_transport(transport, self.gloo, self.size, shared_pair, where, backend)
        if chosen == "pair":
            if self.pair is None and self.size == 2:
                self.pair = open_pair(self, ledger, _timeout_seconds)
            elif self.pair is not None:  # a later engine over the same group counts it too
                ledger.track(self.pair.tensor.detach(), Category.COMM_BUFFER)
            if self.pair is None:
                chosen = without_pair(transport, where, self.size)
        if chosen == "native":
            self.carrier = native_on(backend) if self.size > 1 else NATIVE
        elif chosen == "pair" and self.pair is not None:
            self.carrier = Pair(self.pair, MIN_BYTES)
        else:
            self.carrier = PerRank()
        return chosen

    def place(self, node_size: int) -> str:
        """Which link this group's collectives cross, with ``node_size`` consecutive global ranks a node:
        ``intra_node`` where every member is on one node, else ``inter_node``; kept as ``link`` for the observers
        (the comms log's split of bytes) and returned."""
        world = dist.get_world_size() if self.initialized else 1
        members = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(world))
        if self.size == 1:
            members = [dist.get_rank() if self.initialized else 0]
        self.link = "intra_node" if len({m // node_size for m in members}) == 1 else "inter_node"
        return self.link

    @property
    def pair_bytes(self) -> int:
        """What the shared pair maps while this group uses it (the ledger's comm buffers count it throughout)."""
        return MAPPING_BYTES if isinstance(self.carrier, Pair) else 0

    def _count(self, kind: str, *tensors: torch.Tensor) -> int:
        """Count the message's bytes (the textbook message of ``kind``); return them."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes_sent[kind] += nbytes
        return nbytes

    def launch(self, kind: str, call: Callable[..., Any], tensors: tuple[torch.Tensor, ...] = (),
               on_done: Callable[[], None] | None = None, nbytes: int = 0) -> Handle:
        """Issue one async backend work, ``call(*tensors)`` (fresh aliases of them on gloo, see the module
        docstring) of ``nbytes`` (the message, for the observers); its ``Handle``. A backend error becomes a
        ``CollectiveError`` that names the collective (now or at ``wait()``). The transports launch through it."""
        seen = (kind, self.label, self.size, nbytes, time.perf_counter(), self.link) if comm_observers.OBSERVERS \
            else None
        self.issued += 1
        seq = self.issued

        def failed(err: BaseException) -> BaseException:
            return collective_failed(kind, self.label, seq, self.rank, self.size, err)
        held = tuple(_alias(t) for t in tensors) if self.gloo else ()
        try:
            work = call(*(held or tensors))
        except RuntimeError as err:
            raise failed(err) from err
        return Handle(work, on_done, failed, held, seen)

    def _run_blocking(self, kind: str, call: Callable[[], Any]) -> None:
        """One blocking collective on Python objects (torch.distributed's object collectives, barrier)."""
        self.issued += 1
        try:
            call()
        except RuntimeError as err:
            raise collective_failed(kind, self.label, self.issued, self.rank, self.size, err) from err

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, on_done: Callable[[], None] | None = None) -> Handle:
        if self.size == 1:
            return Handle(None, on_done)
        return self.carrier.all_reduce(self, tensor, op, on_done, self._count("all_reduce", tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       on_done: Callable[[], None] | None = None) -> Handle:
        """Sum ``input`` (``size * output.numel()`` elements) over ranks; rank r gets chunk r."""
        if self.size == 1:
            output.copy_(input)
            return Handle(None, on_done)
        return self.carrier.reduce_scatter(self, output, input, on_done, self._count("reduce_scatter", input))

    def reduce_scatter_rows(self, rows: torch.Tensor, target: torch.Tensor, scale: float, accumulate: bool,
                            buffers: Ledger) -> Handle:
        """A reduce-scatter of the ``(size, c)`` matrix ``rows`` (any strides; scratch afterwards): when the handle
        is waited on, the sum over ranks of row ``rank``, times ``scale``, is in ``target`` (``c`` elements), or
        added into it (``accumulate``). Comm buffers the transport needs come from ``buffers``."""
        if self.size == 1:
            return Handle(None, scaled_into(target, rows[0], scale, accumulate))
        nbytes = self._count("reduce_scatter", rows)
        return self.carrier.reduce_scatter_rows(self, rows, target, scale, accumulate, buffers, nbytes)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   on_done: Callable[[], None] | None = None) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` (rank order)."""
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None, on_done)
        return self.carrier.all_gather(self, output, input, on_done, self._count("all_gather", output))

    def all_gather_joined(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                          on_done: Callable[[], None] | None = None) -> Handle:
        """``all_gather(output, input)`` for each pair, issued together: one launch where the transport joins them
        (the native one on NCCL and gloo: see ``transports.Native``), one handle either way."""
        if self.size == 1 or len(pairs) == 1:
            return Handle(Works([self.all_gather(o, i) for o, i in pairs]), on_done)
        nbytes = self._count("all_gather", *(o for o, _ in pairs))
        return self.carrier.all_gather_joined(self, pairs, on_done, nbytes)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """Chunk i of ``input`` (dim 0 in ``size`` equal parts) to rank i; chunk r of ``output`` from rank r."""
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None)
        nbytes = self._count("all_to_all", input)
        return self.launch("all_to_all", lambda o, i: dist.all_to_all_single(o, i, group=self.group, async_op=True),
                         (output, input), None, nbytes)

    def shift_ring(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        """Send ``tensors`` to the next rank of the group and receive the previous rank's (same shapes) into
        new tensors, asynchronously: ``(incoming, handle)``; wait on the handle before reading them."""
        incoming = [torch.empty_like(t) for t in tensors]
        if self.size == 1:
            for inc, t in zip(incoming, tensors):
                inc.copy_(t)
            return incoming, Handle(None)
        after, before = self.global_rank((self.rank + 1) % self.size), self.global_rank((self.rank - 1) % self.size)
        nbytes = self._count("ring", *tensors)
        n = len(tensors)

        def issue(*ts: torch.Tensor) -> Any:
            return Works([w for out, inc in zip(ts[:n], ts[n:]) for w in (
                dist.isend(out, after, group=self.group), dist.irecv(inc, before, group=self.group))])
        return incoming, self.launch("ring", issue, tuple(t.contiguous() for t in tensors) + tuple(incoming), None,
                                   nbytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Group rank ``src``'s ``tensor`` on every rank, in place (blocking)."""
        if self.size == 1:
            return
        nbytes = self._count("broadcast", tensor)
        src = self.global_rank(src)
        self.launch("broadcast", lambda t: dist.broadcast(t, src=src, group=self.group, async_op=True), (tensor,), None,
                  nbytes).wait()

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                     input_sizes: list[int]) -> None:
        """``input_sizes[i]`` elements of ``input`` to rank i, ``output_sizes[r]`` from rank r (blocking)."""
        if self.size == 1:
            output.copy_(input)
            return
        nbytes = self._count("all_to_all", input)
        handle = self.launch("all_to_all", lambda o, i: dist.all_to_all_single(
            o, i, output_sizes, input_sizes, group=self.group, async_op=True), (output, input), None, nbytes)
        handle.wait()

    def max_flag(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (used for fp16 overflow)."""
        if self.size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=get_accelerator().device())
        self.launch("all_reduce", lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                  (t,), None, 4).wait()
        return bool(t.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.launch("all_reduce", lambda x: dist.all_reduce(x, group=self.group, async_op=True), (value,), None,
                      value.numel() * value.element_size()).wait()
        return value

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small Python objects: paths, names)."""
        if self.size == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group else 0
        self._run_blocking("broadcast_object", lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (small Python objects)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        self._run_blocking("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self) -> None:
        if self.size > 1:
            self._run_blocking("barrier", lambda: dist.barrier(group=self.group))


if TYPE_CHECKING:  # mypy proves the process group provides the interface the layers above ask for
    _: type[Collectives] = DataParallelGroup

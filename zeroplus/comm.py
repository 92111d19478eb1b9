"""Communication: the data-parallel group and async collectives that return handles (``collectives.py``).

Every collective is issued with ``async_op=True`` and returns a ``Handle`` whose ``wait()`` runs
at the last moment the result is needed. With world size 1 the collectives complete at once
without calling torch.distributed, so one code path serves 1 and N ranks. Bytes sent per
collective kind are counted for reports and benchmarks. A collective that fails or times out raises
``CollectiveError`` naming itself, its group and the rank that did not arrive
(``collective_faults.py``); the process group zeroplus creates gets ``zeroplus.collective_timeout``.

On gloo (CPU tensors) the all-gather and the reduce-scatter are built from in-place broadcasts and
reduces, one per rank, which gloo runs faster and without temporaries. Measured on 2 ranks, 95 MiB
(medians of 5): gloo's all-gather 0.16 s, holding a copy of its whole output while it runs; two
in-place broadcasts 0.035 s, nothing held; gloo's reduce-scatter 0.13 s, holding a copy of its whole
input; two in-place reduces 0.065 s and 4 MiB held; an in-place all-reduce 0.056 s (it sends twice
the bytes of either). Both send the bytes of the native collective: the communication volume stays
the textbook one (all-gather: its output; reduce-scatter: its input). ``per_rank`` tells the gradient
reducer to take the in-place reduce path (``grad_reducer.py``). NCCL and HCCL keep the native
collectives, which work in place.

Which of these a group runs is its transport, chosen once when an engine is assembled (``use_transport``;
the names and the choice: ``transports.py``).

Gloo's worker threads hand each finished work's tensors back after the caller's ``wait()`` has
returned. If the caller's Python tensor is gone by then, the worker must take the GIL to free it; at
interpreter exit that GIL request ends the worker thread mid-destructor and the process aborts
("terminate called without an active exception", seen in about one run in 200). So every gloo
collective gets fresh aliases of its tensors (``detach()``: same storage, its own tensor object),
and ``Handle.wait()`` returns only once the backend has let go of them (``collectives.until_released``: a few
microseconds), so the last reference to every tensor is this thread's.
Two ranks reduce gradients by one point-to-point exchange instead (``exchange_rows``), and two ranks of one host
(the ``pair`` transport) swap large all-gathers, exchanges and sums through shared memory instead of TCP
(``shm_pair.py``).
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
from .transports import requested_transport, without_pair

DEFAULT_TIMEOUT_SECONDS = 600.0
# One tag for every exchange: gloo matches a pair's sends and receives of one tag in the order they were posted, and
# every rank posts a group's exchanges in the same order (a new tag per exchange would add keys to gloo's per-tag
# tables all run long); apart from the default tag 0 of other point-to-point messages (``shift_ring``).
EXCHANGE_TAG = 83

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


class _Works:
    """Several backend works waited on as one, in the order issued."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DataParallelGroup:
    """A process group with rank, size and counted async collectives (sum reductions)."""

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
        self.gloo = backend == "gloo"  # the backend's worker holds aliases of a collective's tensors (_run)
        # the transport (use_transport; until an engine chooses one, auto without the pair)
        self.transport = "gloo" if self.gloo else "native"
        self.per_rank = self.gloo  # all-gathers and gradient reductions by in-place broadcasts and reduces
        self.pair: SharedPair | None = None  # two gloo ranks of one host: large swaps through shared memory
        self.pair_on = False  # ... while the transport is "pair"

    def use_transport(self, transport: str, ledger: Ledger, shared_pair: bool = True) -> str:
        """Collective: how this group's all-gathers and reductions move bytes from now on (the module docstring);
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
        self.transport = chosen
        self.per_rank = chosen in ("gloo", "pair") and self.size > 1
        self.pair_on = chosen == "pair"
        return chosen

    @property
    def pair_bytes(self) -> int:
        """What the shared pair maps while this group uses it (the ledger's comm buffers count it throughout)."""
        return MAPPING_BYTES if self.pair is not None and self.pair_on else 0

    def _pair_for(self, send: torch.Tensor, recv: torch.Tensor) -> SharedPair | None:
        """The shared pair if this swap goes through it (CPU, contiguous, as many bytes each way, large), else None."""
        nbytes = send.numel() * send.element_size()
        paired = (self.pair_on and send.device.type == "cpu" and recv.device.type == "cpu" and send.is_contiguous()
                  and recv.is_contiguous() and nbytes >= MIN_BYTES and recv.numel() * recv.element_size() == nbytes)
        return self.pair if paired else None

    def _count(self, kind: str, *tensors: torch.Tensor) -> int:
        """Count the message's bytes (the textbook message of ``kind``); return them."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes_sent[kind] += nbytes
        return nbytes

    def _run(self, kind: str, call: Callable[..., Any], tensors: tuple[torch.Tensor, ...] = (),
             on_done: Callable[[], None] | None = None, nbytes: int = 0) -> Handle:
        """Issue one async collective, ``call(*tensors)`` (fresh aliases of them on gloo, see the module
        docstring) of ``nbytes`` (the message, for the observers); its ``Handle``. A backend error becomes a
        ``CollectiveError`` that names the collective (now or at ``wait()``)."""
        seen = (kind, self.label, self.size, nbytes, time.perf_counter()) if comm_observers.OBSERVERS else None
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
        nbytes = self._count("all_reduce", tensor)
        pair = self._pair_for(tensor, tensor) if op is None or op == dist.ReduceOp.SUM else None
        if pair is not None:
            return self._run("all_reduce", lambda t: pair.swap(t, t, add=True), (tensor,), on_done, nbytes)
        op = dist.ReduceOp.SUM if op is None else op
        return self._run("all_reduce", lambda t: dist.all_reduce(t, op=op, group=self.group, async_op=True),
                         (tensor,), on_done, nbytes)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       on_done: Callable[[], None] | None = None) -> Handle:
        """Sum ``input`` (``size * output.numel()`` elements) over ranks; rank r gets chunk r."""
        if self.size == 1:
            output.copy_(input)
            return Handle(None, on_done)
        nbytes = self._count("reduce_scatter", input)
        return self._run("reduce_scatter", lambda o, i: _reduce_scatter(o, i, group=self.group, async_op=True),
                         (output, input), on_done, nbytes)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   on_done: Callable[[], None] | None = None) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` (rank order)."""
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None, on_done)
        nbytes = self._count("all_gather", output)
        if self.per_rank and output.device.type == "cpu" and output.is_contiguous() and input.is_contiguous():
            flat = output.view(-1)
            n = input.numel()
            own = flat[self.rank * n:(self.rank + 1) * n]
            if input.data_ptr() != own.data_ptr():
                with torch.no_grad():
                    own.copy_(input.view(-1))
            chunks = tuple(flat[i * n:(i + 1) * n] for i in range(self.size))
            pair = self._pair_for(own, chunks[1 - self.rank])
            if pair is not None:
                return self._run("all_gather", pair.swap, (own, chunks[1 - self.rank]), on_done, nbytes)
            return self._run("all_gather", self._broadcast_each, chunks, on_done, nbytes)
        return self._run("all_gather", lambda o, i: _all_gather(o, i, group=self.group, async_op=True),
                         (output, input), on_done, nbytes)

    def reduce_to_each(self, pieces: list[torch.Tensor], on_done: Callable[[], None] | None = None) -> Handle:
        """A reduce-scatter in place: ``pieces[i]`` (the same shape on every rank) summed over ranks
        lands in rank i's ``pieces[i]``; the other pieces are scratch afterwards. One in-place
        ``reduce`` per rank: on gloo this holds no copy of its input and runs about as fast as an
        all-reduce of all the pieces, which sends twice the bytes (``grad_reducer.py``)."""
        if self.size == 1:
            return Handle(None, on_done)
        nbytes = self._count("reduce_scatter", *pieces)
        pair = self._pair_for(pieces[1 - self.rank], pieces[self.rank]) if self.size == 2 else None
        if pair is not None:  # the peer's piece goes to it, its piece for this rank is added into this rank's
            return self._run("reduce_scatter", lambda s, r: pair.swap(s, r, add=True),
                             (pieces[1 - self.rank], pieces[self.rank]), on_done, nbytes)
        return self._run("reduce_scatter", lambda *ps: _Works([
            dist.reduce(piece, dst=self._global(i), group=self.group, async_op=True) for i, piece in enumerate(ps)]),
            tuple(pieces), on_done, nbytes)

    def exchange_rows(self, rows: list[torch.Tensor], into: list[torch.Tensor],
                      on_done: Callable[[], None] | None = None) -> Handle:
        """Every pair of ranks at once, point to point: ``rows[i]`` (the same shape on every rank) goes to
        group rank i and ``into[i]`` receives rank i's row for this rank; this rank's own entries are neither
        sent nor written. Counted as the reduce-scatter it serves (the bytes of all ``rows``). With two
        ranks on gloo it is one exchange of halves, about twice as fast as the per-rank reduces.
        See note: gloo exchange."""
        if self.size == 1:
            return Handle(None, on_done)
        nbytes = self._count("reduce_scatter", *rows)
        others = [i for i in range(self.size) if i != self.rank]
        n = len(others)
        pair = self._pair_for(rows[others[0]], into[others[0]]) if n == 1 else None
        if pair is not None:
            return self._run("reduce_scatter", pair.swap, (rows[others[0]], into[others[0]]), on_done, nbytes)

        def issue(*ts: torch.Tensor) -> Any:
            return _Works([w for k, i in enumerate(others) for w in (
                dist.isend(ts[k], self._global(i), group=self.group, tag=EXCHANGE_TAG),
                dist.irecv(ts[n + k], self._global(i), group=self.group, tag=EXCHANGE_TAG))])
        return self._run("reduce_scatter", issue, tuple(rows[i] for i in others) + tuple(into[i] for i in others),
                         on_done, nbytes)

    def _broadcast_each(self, *chunks: torch.Tensor) -> Any:
        """All-gather on gloo: one in-place broadcast of each rank's chunk (this rank's already in place)."""
        return _Works([dist.broadcast(chunk, src=self._global(i), group=self.group, async_op=True)
                       for i, chunk in enumerate(chunks)])

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """Chunk i of ``input`` (dim 0 in ``size`` equal parts) to rank i; chunk r of ``output`` from rank r."""
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None)
        nbytes = self._count("all_to_all", input)
        return self._run("all_to_all", lambda o, i: dist.all_to_all_single(o, i, group=self.group, async_op=True),
                         (output, input), None, nbytes)

    def shift_ring(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        """Send ``tensors`` to the next rank of the group and receive the previous rank's (same shapes) into
        new tensors, asynchronously: ``(incoming, handle)``; wait on the handle before reading them."""
        incoming = [torch.empty_like(t) for t in tensors]
        if self.size == 1:
            for inc, t in zip(incoming, tensors):
                inc.copy_(t)
            return incoming, Handle(None)
        after, before = self._global((self.rank + 1) % self.size), self._global((self.rank - 1) % self.size)
        nbytes = self._count("ring", *tensors)
        n = len(tensors)

        def issue(*ts: torch.Tensor) -> Any:
            return _Works([w for out, inc in zip(ts[:n], ts[n:]) for w in (
                dist.isend(out, after, group=self.group), dist.irecv(inc, before, group=self.group))])
        return incoming, self._run("ring", issue, tuple(t.contiguous() for t in tensors) + tuple(incoming), None,
                                   nbytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Group rank ``src``'s ``tensor`` on every rank, in place (blocking)."""
        if self.size == 1:
            return
        nbytes = self._count("broadcast", tensor)
        src = self._global(src)
        self._run("broadcast", lambda t: dist.broadcast(t, src=src, group=self.group, async_op=True), (tensor,), None,
                  nbytes).wait()

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                     input_sizes: list[int]) -> None:
        """``input_sizes[i]`` elements of ``input`` to rank i, ``output_sizes[r]`` from rank r (blocking)."""
        if self.size == 1:
            output.copy_(input)
            return
        nbytes = self._count("all_to_all", input)
        handle = self._run("all_to_all", lambda o, i: dist.all_to_all_single(
            o, i, output_sizes, input_sizes, group=self.group, async_op=True), (output, input), None, nbytes)
        handle.wait()

    def max_flag(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (used for fp16 overflow)."""
        if self.size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=get_accelerator().device())
        self._run("all_reduce", lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                  (t,), None, 4).wait()
        return bool(t.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self._run("all_reduce", lambda x: dist.all_reduce(x, group=self.group, async_op=True), (value,), None,
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

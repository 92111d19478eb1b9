"""Which collectives a group runs: its transport, chosen once when an engine is assembled, and the transports.

``zeroplus.transport``: ``native`` (the tensor collectives, one launch each, as NCCL and HCCL run them; gloo runs
them too, so the suite runs a GPU job's collectives with values), ``gloo`` (per-rank in-place broadcasts and
reduces, the row exchange of two ranks), ``pair`` (``gloo`` with two ranks of one host swapping through shared
memory: ``shm_pair.py``) or ``auto`` (native on a device backend; on gloo the pair where two ranks share an
x86-64 host, else gloo). ``comm.DataParallelGroup.use_transport`` and the estimate's ``VirtualGroup`` both choose
by ``requested_transport``, so the prediction simulates the collectives the run takes.

A transport is private to its group (``comm.DataParallelGroup``): the layers above ask the group for semantic
operations only (all-gather into, several all-gathers together, reduce-scatter into, the rows of a matrix
reduce-scattered into a shard, all-reduce, ...) and never learn which transport, backend or host carries them.
``Native`` issues the tensor collectives, several all-gathers as one call where the backend joins them (see note:
joined gathers). ``PerRank`` (``gloo``) builds the all-gather from one in-place broadcast per rank and the rows'
reduce-scatter from one in-place reduce per rank onto its owner, or at two ranks writing a fresh shard from one
point-to-point exchange: gloo's own all-gather and reduce-scatter copy their whole buffer and run 2-4x longer
(see note: gloo broadcasts and reduces; see note: gloo exchange). ``Pair`` is ``PerRank`` with two ranks of one
host swapping large buffers through the shared mapping (see note: shared-memory pair).

Every transport lands the same bits: a sum of two commutes, and a landing (``scaled_into``) scales the same sum
once. See note: transport (docs/design-notes.md). Memory: the native rows' comm buffers (category
``comm_buffer``, from the caller's ledger: a non-contiguous matrix's copy, the sum when it is added into a shard);
the per-rank transports none.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.distributed as dist

from .collectives import Handle
from .ledger import Category, Ledger

if TYPE_CHECKING:
    from .shm_pair import SharedPair

TRANSPORTS = ("auto", "native", "gloo", "pair")  # zeroplus.transport
# One tag for every exchange: gloo matches a pair's sends and receives of one tag in the order they were posted, and
# every rank posts a group's exchanges in the same order (a new tag per exchange would add keys to gloo's per-tag
# tables all run long); apart from the default tag 0 of other point-to-point messages (``shift_ring``).
EXCHANGE_TAG = 83

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_joined(group: Any, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
    """Every ``inputs[k]`` of every rank into ``outputs[k]``, as one backend call (the process group's coalesced
    all-gather: on NCCL one group of collectives, one launch); its work."""
    pg: Any = group if group is not None else dist.group.WORLD
    return pg.allgather_into_tensor_coalesced(outputs, inputs)

Done = Callable[[], None] | None
# (output, input, on_done) -> Handle: a group's reduce-scatter of ``input`` into ``output`` (``scatter_rows``)
ReduceScatter = Callable[[torch.Tensor, torch.Tensor, Done], Handle]


def requested_transport(transport: str, gloo: bool, size: int, shared_pair: bool, where: str, backend: str) -> str:
    """What ``transport`` (``zeroplus.transport``) asks of a group of ``size`` ranks (``gloo``: its backend is gloo,
    else it runs ``backend``; ``where`` names it in errors), before the pair is known to map: ``native``, ``gloo``
    or ``pair``. ValueError for what cannot run: gloo's paths on another backend, ``pair`` against
    ``shared_pair`` false. ``DataParallelGroup`` and the estimate's ``VirtualGroup`` both choose by it."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {TRANSPORTS}")
    if transport in ("gloo", "pair") and size > 1 and not gloo:
        raise ValueError(f"transport {transport!r} builds collectives from gloo's per-rank broadcasts and reduces, "
                         f"but {where} runs {backend}: use 'native' or 'auto'")
    if transport == "pair" and not shared_pair:
        raise ValueError("transport 'pair' with zeroplus.shared_memory_pair false: set one or the other")
    if size == 1 or not gloo:
        return "native" if transport == "auto" else transport
    if transport == "auto":
        return "pair" if shared_pair and size == 2 else "gloo"
    return transport


def without_pair(transport: str, where: str, size: int) -> str:
    """The transport where the pair was asked for and cannot map: ``gloo`` for ``auto``; ValueError for ``pair``."""
    if transport == "pair":
        raise ValueError(f"transport 'pair' needs {where} to be two ranks of one x86-64 host that can share a /dev/shm "
                         f"mapping (and ZEROPLUS_SHM_PAIR not 0); this one has {size} ranks or could not map it")
    return "gloo"


def scaled_into(target: torch.Tensor, source: torch.Tensor, scale: float, accumulate: bool) -> Callable[[], None]:
    """Run when a reduction lands: ``target += scale * source`` (``accumulate``) or ``target = scale * source``."""
    def land() -> None:
        if accumulate:
            target.add_(source, alpha=scale)
        else:
            torch.mul(source, scale, out=target)
    return land


def scatter_rows(reduce_scatter: ReduceScatter, rows: torch.Tensor, target: torch.Tensor, scale: float,
                 accumulate: bool, buffers: Ledger) -> Handle:
    """The rows' reduce-scatter by one tensor collective (``reduce_scatter``, the group's): the matrix as its
    input (copied into a comm buffer when it is not contiguous), this rank's summed row written into ``target`` and
    scaled in place, or into a comm buffer and added, scaled, into ``target`` (``accumulate``)."""
    n, c = rows.shape
    if rows.is_contiguous():
        inp = rows.reshape(-1)
    else:
        inp = buffers.empty(n * c, rows.dtype, Category.COMM_BUFFER, rows.device)
        inp.view(n, c).copy_(rows)
    if accumulate:
        out = buffers.empty(c, rows.dtype, Category.COMM_BUFFER, rows.device)
        return reduce_scatter(out, inp, scaled_into(target, out, scale, True))

    def scaled() -> None:
        target.mul_(scale)
    return reduce_scatter(target, inp, scaled)


class Launcher(Protocol):
    """What a transport asks of its group (``comm.DataParallelGroup``): who it is, and how one backend work is
    launched (counted, observed, its tensors held safely, a failure named: ``launch``)."""

    rank: int
    size: int
    group: Any

    def launch(self, kind: str, call: Callable[..., Any], tensors: tuple[torch.Tensor, ...] = (),
               on_done: Done = None, nbytes: int = 0) -> Handle: ...

    def global_rank(self, group_rank: int) -> int: ...


class Works:
    """Several backend works waited on as one, in the order issued."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class Native:
    """The tensor collectives, one launch each: what NCCL and HCCL run, and gloo too. ``join``: several all-gathers
    of one group and dtype issued together go as one backend call (``allgather_into_tensor_coalesced``: one NCCL
    group, one launch), where the backend has it (``JOINING_BACKENDS``); else one launch each."""

    name = "native"

    def __init__(self, join: bool = False) -> None:
        self.join = join

    def all_reduce(self, g: Launcher, tensor: torch.Tensor, op: Any, on_done: Done, nbytes: int) -> Handle:
        op = dist.ReduceOp.SUM if op is None else op
        return g.launch("all_reduce", lambda t: dist.all_reduce(t, op=op, group=g.group, async_op=True), (tensor,),
                        on_done, nbytes)

    def reduce_scatter(self, g: Launcher, output: torch.Tensor, input: torch.Tensor, on_done: Done,
                       nbytes: int) -> Handle:
        return g.launch("reduce_scatter", lambda o, i: _reduce_scatter(o, i, group=g.group, async_op=True),
                        (output, input), on_done, nbytes)

    def all_gather(self, g: Launcher, output: torch.Tensor, input: torch.Tensor, on_done: Done, nbytes: int) -> Handle:
        return g.launch("all_gather", lambda o, i: _all_gather(o, i, group=g.group, async_op=True), (output, input),
                        on_done, nbytes)

    def all_gather_joined(self, g: Launcher, pairs: list[tuple[torch.Tensor, torch.Tensor]], on_done: Done,
                          nbytes: int) -> Handle:
        """Each ``(output, input)`` of ``pairs`` (more than one: ``DataParallelGroup.all_gather_joined``) an
        all-gather, issued together: one launch where the transport joins them (``join``), else one each under one
        handle."""
        if not self.join:
            return Handle(Works([self.all_gather(g, o, i, None, o.numel() * o.element_size()) for o, i in pairs]),
                          on_done)
        n = len(pairs)
        tensors = tuple(o for o, _ in pairs) + tuple(i for _, i in pairs)
        return g.launch("all_gather", lambda *ts: _all_gather_joined(g.group, list(ts[:n]), list(ts[n:])), tensors,
                        on_done, nbytes)

    def reduce_scatter_rows(self, g: Launcher, rows: torch.Tensor, target: torch.Tensor, scale: float,
                            accumulate: bool, buffers: Ledger, nbytes: int) -> Handle:
        return scatter_rows(lambda o, i, done: self.reduce_scatter(g, o, i, done, nbytes), rows, target, scale,
                            accumulate, buffers)


class PerRank(Native):
    """gloo's in-place paths: an all-gather of CPU tensors is one broadcast per rank, the rows' reduce-scatter one
    reduce per rank onto its owner, or (two ranks writing a fresh shard) one exchange of rows. Nothing copied beyond
    what gloo holds for a few MiB; the bytes of the native collective."""

    name = "gloo"

    def __init__(self) -> None:
        super().__init__(join=False)

    def all_gather(self, g: Launcher, output: torch.Tensor, input: torch.Tensor, on_done: Done, nbytes: int) -> Handle:
        if not (output.device.type == "cpu" and output.is_contiguous() and input.is_contiguous()):
            return super().all_gather(g, output, input, on_done, nbytes)
        flat, n = output.view(-1), input.numel()
        own = flat[g.rank * n:(g.rank + 1) * n]
        if input.data_ptr() != own.data_ptr():
            with torch.no_grad():
                own.copy_(input.view(-1))
        return self.gather_chunks(g, tuple(flat[i * n:(i + 1) * n] for i in range(g.size)), on_done, nbytes)

    def gather_chunks(self, g: Launcher, chunks: tuple[torch.Tensor, ...], on_done: Done, nbytes: int) -> Handle:
        """Every rank's chunk into ``chunks`` (this rank's in place already): one in-place broadcast each."""
        def broadcast_each(*cs: torch.Tensor) -> Works:
            return Works([dist.broadcast(c, src=g.global_rank(i), group=g.group, async_op=True)
                           for i, c in enumerate(cs)])
        return g.launch("all_gather", broadcast_each, chunks, on_done, nbytes)

    def reduce_scatter_rows(self, g: Launcher, rows: torch.Tensor, target: torch.Tensor, scale: float,
                            accumulate: bool, buffers: Ledger, nbytes: int) -> Handle:
        if g.size == 2 and not accumulate:
            return self.exchange(g, rows, target, scale, nbytes)
        return self.reduce_each(g, rows, target, scale, accumulate, nbytes)

    def reduce_each(self, g: Launcher, rows: torch.Tensor, target: torch.Tensor, scale: float, accumulate: bool,
                    nbytes: int) -> Handle:
        """Row i summed in place onto rank i (one ``reduce`` each; the other rows are scratch afterwards), then
        this rank's row landed, scaled, in ``target``."""
        land = scaled_into(target, rows[g.rank], scale, accumulate)

        def reduces(*ps: torch.Tensor) -> Works:
            return Works([dist.reduce(p, dst=g.global_rank(i), group=g.group, async_op=True)
                           for i, p in enumerate(ps)])
        return g.launch("reduce_scatter", reduces, tuple(rows.unbind(0)), land, nbytes)

    def exchange(self, g: Launcher, rows: torch.Tensor, target: torch.Tensor, scale: float, nbytes: int) -> Handle:
        """Two ranks: each sends the other its row of the other's part and receives the other's row of its own
        straight into ``target``, then adds its own row and scales: ``(theirs + mine) * scale``, bit for bit the
        reduce's sum of two. No buffer, half the time of two reduces (see note: gloo exchange)."""
        peer = 1 - g.rank
        mine = rows[g.rank]

        def land() -> None:
            target.add_(mine).mul_(scale)

        def swap(send: torch.Tensor, recv: torch.Tensor) -> Works:
            return Works([dist.isend(send, g.global_rank(peer), group=g.group, tag=EXCHANGE_TAG),
                           dist.irecv(recv, g.global_rank(peer), group=g.group, tag=EXCHANGE_TAG)])
        return g.launch("reduce_scatter", self.swapper(rows[peer], target, swap), (rows[peer], target), land, nbytes)

    def swapper(self, send: torch.Tensor, recv: torch.Tensor, otherwise: Callable[..., Any]) -> Callable[..., Any]:
        """How a two-rank swap of ``send`` for the peer's bytes into ``recv`` runs: ``otherwise`` on gloo."""
        return otherwise


class Pair(PerRank):
    """``PerRank`` with two ranks of one host swapping large contiguous CPU buffers through a shared mapping
    (``shm_pair.py``): all-gathers, row exchanges, sums and reduces of two; small ones stay on gloo."""

    name = "pair"

    def __init__(self, pair: SharedPair, min_bytes: int) -> None:
        super().__init__()
        self.pair = pair
        self.min_bytes = min_bytes

    def _fits(self, send: torch.Tensor, recv: torch.Tensor) -> bool:
        """Whether this swap goes through the pair (CPU, contiguous, as many bytes each way, large)."""
        nbytes = send.numel() * send.element_size()
        return (send.device.type == "cpu" and recv.device.type == "cpu" and send.is_contiguous()
                and recv.is_contiguous() and nbytes >= self.min_bytes
                and recv.numel() * recv.element_size() == nbytes)

    def swapper(self, send: torch.Tensor, recv: torch.Tensor, otherwise: Callable[..., Any]) -> Callable[..., Any]:
        return self.pair.swap if self._fits(send, recv) else otherwise

    def all_reduce(self, g: Launcher, tensor: torch.Tensor, op: Any, on_done: Done, nbytes: int) -> Handle:
        if (op is None or op == dist.ReduceOp.SUM) and self._fits(tensor, tensor):
            return g.launch("all_reduce", lambda t: self.pair.swap(t, t, add=True), (tensor,), on_done, nbytes)
        return super().all_reduce(g, tensor, op, on_done, nbytes)

    def gather_chunks(self, g: Launcher, chunks: tuple[torch.Tensor, ...], on_done: Done, nbytes: int) -> Handle:
        own, theirs = chunks[g.rank], chunks[1 - g.rank]
        if self._fits(own, theirs):
            return g.launch("all_gather", self.pair.swap, (own, theirs), on_done, nbytes)
        return super().gather_chunks(g, chunks, on_done, nbytes)

    def reduce_each(self, g: Launcher, rows: torch.Tensor, target: torch.Tensor, scale: float, accumulate: bool,
                    nbytes: int) -> Handle:
        send, recv = rows[1 - g.rank], rows[g.rank]
        if not self._fits(send, recv):
            return super().reduce_each(g, rows, target, scale, accumulate, nbytes)
        # the peer's row goes to it; its row for this rank is added into this rank's
        return g.launch("reduce_scatter", lambda s, r: self.pair.swap(s, r, add=True), (send, recv),
                        scaled_into(target, recv, scale, accumulate), nbytes)


JOINING_BACKENDS = ("nccl", "gloo")  # whose process groups run allgather_into_tensor_coalesced as one call
NATIVE = Native()  # one launch each: a group of one rank, or a backend that does not join


def native_on(backend: str) -> Native:
    """The native transport of a group of ranks on ``backend``: joined gathers where it runs them as one call."""
    return Native(join=backend in JOINING_BACKENDS)

"""Bucketed, asynchronous gradient reduction for flat groups.

Stage 0 all-reduces the flat gradient in place, in contiguous buckets of ``reduce_bucket_size``
elements; nothing is copied. Stages 1-3 reduce-scatter: the flat gradient seen as an
``(N, S)`` matrix has rank r's shard in row r, so a bucket is a block of columns
``[c0, c1)``. When one bucket covers the whole group the flat gradient is the collective's
input as is; otherwise each bucket's columns are copied into a contiguous ``N * (c1 - c0)``
comm buffer (category ``comm_buffer``), so buckets smaller than one parameter are fine. The
reduced ``c1 - c0`` elements are added, divided by D, into the fp32 gradient shard when the
handle is waited on. When gradients are reduced once per step (stage 1, or no accumulation at
stages 2-3) the collective writes straight into a gradient shard in the compute dtype (c * S),
divided by D in place, and there is no fp32 accumulator. With ``reduce_scatter: false`` each
bucket is all-reduced and the owned part kept. N is the group's own partition size and D the
data-parallel size: they differ for experts' groups (N = D / E, ``partition.py``).

On the per-rank transports (``gloo`` and ``pair``, the default on CPU: ``comm.py``) stages 1-3 reduce each
bucket of columns in place onto its owner, one ``reduce`` per rank (``comm.reduce_to_each``), and keep the
owned row: gloo's reduce-scatter copies its whole input
and runs twice as long (``comm.py``), so this path has no comm buffer and no backend temporary
beyond a few MiB, and sends the bytes of a reduce-scatter. With two ranks and one reduction per step
the ranks instead exchange rows point to point, each receiving the other's row straight into its new
gradient shard (``comm.exchange_rows``): no buffer, half the time of the reduces.

With one rank there is nothing to reduce: at stages 1-3 the flat gradient becomes the reduced
gradient as it is (``_keep_whole``).

Memory in flight: at most one group's flat gradient (c * P) plus the comm buffers of the
buckets not yet waited on. Communication: c * P bytes per group per reduction.
See note: gradient shards; see note: one rank (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..collectives import Collectives
from ..config import ZeroStage
from ..ledger import Category, Ledger
from .flat_group import FlatParamGroup

_Landing = Callable[[torch.Tensor, torch.Tensor, float], Callable[[], None]]  # (target, source, scale) -> completion


class GradReducer:
    def __init__(self, stage: ZeroStage, dp: Collectives, bucket_numel: int, use_reduce_scatter: bool,
                 overlap: bool, ledger: Ledger, accumulate_fp32: bool) -> None:
        self.stage = stage
        self.accumulate_fp32 = accumulate_fp32
        self.dp = dp
        self.bucket_numel = max(1, int(bucket_numel))
        self.use_reduce_scatter = use_reduce_scatter
        self.overlap = overlap
        self.ledger = ledger

    def reduce(self, group: FlatParamGroup) -> None:
        """Start reducing ``group``'s flat gradient; results land when ``group.gradient.wait()`` runs."""
        if self.dp.size == 1 and group.gradient.kept_whole() is not None:
            return  # one rank: the kept gradients stay where autograd put them (see note: one-rank gradients)
        grad = group.gradient.ensure_flat()
        if self.stage.partitions and group.dp.size == self.dp.size == 1:
            self._keep_whole(group, grad)
        elif not self.stage.partitions:
            for a in range(0, group.padded_numel, self.bucket_numel):
                group.gradient.issued(group.dp.all_reduce(grad[a:a + self.bucket_numel]))
        elif not self.use_reduce_scatter:
            self._all_reduce_keep_shard(group, grad)
        elif group.dp.per_rank:
            self._reduce_in_place(group, grad)
        else:
            self._reduce_scatter(group, grad)
        if self.stage.partitions:
            group.gradient.drop_flat()
        if not self.overlap:
            group.gradient.wait()

    def _keep_whole(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """One rank in all (data and partition groups of size 1) owns everything: the flat gradient becomes
        the reduced one, no copy and no division (or is added into it when accumulating)."""
        if self._adds_into_shard(group):
            group.gradient.ensure_reduced().add_(grad)
        else:
            group.gradient.adopt_reduced(grad)

    def _column_buckets(self, grad: torch.Tensor, s: int, cols: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(c0, c1, input)`` per bucket: columns ``[c0, c1)`` of the ``(N, S)`` gradient, made
        contiguous in a comm buffer, or the gradient itself when one bucket covers it."""
        n = grad.numel() // s
        if cols >= s:
            yield 0, s, grad
            return
        matrix = grad.view(n, s)
        for c0, c1 in _spans(s, cols):
            inp = self.ledger.empty(n * (c1 - c0), grad.dtype, Category.COMM_BUFFER, grad.device)
            inp.view(n, c1 - c0).copy_(matrix[:, c0:c1])
            yield c0, c1, inp

    def _reduce_scatter(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """Accumulate: each bucket's reduced columns are added, divided by D, into the fp32 shard (or into
        the shard an earlier reduction of this backward wrote, ``partition.py``'s per-use groups)."""
        n, s = group.dp.size, group.shard_numel
        scale = 1.0 / self.dp.size
        cols = max(1, self.bucket_numel // n)
        if not self._adds_into_shard(group):
            self._reduce_scatter_direct(group, grad, cols)
            return
        master_grad = group.gradient.ensure_reduced()
        for c0, c1, inp in self._column_buckets(grad, s, cols):
            out = self.ledger.empty(c1 - c0, grad.dtype, Category.COMM_BUFFER, grad.device)
            target = master_grad[c0:c1]
            group.gradient.issued(group.dp.reduce_scatter(out, inp, on_done=_adder(target, out, scale)))

    def _reduce_scatter_direct(self, group: FlatParamGroup, grad: torch.Tensor, cols: int) -> None:
        """One reduction per step: the collective writes straight into the gradient shard
        (compute dtype), which is then divided by N; no comm buffer for the output."""
        s = group.shard_numel
        shard = group.gradient.new_reduced(grad.dtype)
        scale = 1.0 / self.dp.size
        for c0, c1, inp in self._column_buckets(grad, s, cols):
            part = shard[c0:c1]
            group.gradient.issued(group.dp.reduce_scatter(part, inp, on_done=_scaler(part, scale)))

    def _all_reduce_keep_shard(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """All-reduce contiguous buckets of the flat gradient in place and keep the owned range
        (``reduce_scatter: false``)."""
        target, land = self._landing(group, grad.dtype)
        lo, scale = group.owned_start, 1.0 / self.dp.size
        for a in range(0, group.padded_numel, self.bucket_numel):
            b = min(group.padded_numel, a + self.bucket_numel)
            s, e = max(a, lo), min(b, lo + group.owned_numel)
            keep = land(target[s - lo:e - lo], grad[s:e], scale) if s < e else None
            group.gradient.issued(group.dp.all_reduce(grad[a:b], on_done=keep))

    def _reduce_in_place(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """Gloo: each bucket of columns reduced in place onto its owner, one ``reduce`` per rank
        (``comm.reduce_to_each``), and the owned row kept. No comm buffer; the bytes of a reduce-scatter.
        Two ranks writing a new shard exchange rows instead (``_exchange``)."""
        if group.dp.size == 2 and not self._adds_into_shard(group):
            self._exchange(group, grad)
        else:
            self._reduce_each(group, grad)

    def _reduce_each(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """One in-place ``reduce`` of each bucket of columns per rank onto its owner."""
        target, land = self._landing(group, grad.dtype)
        n, s, r = group.dp.size, group.shard_numel, group.dp.rank
        rows = grad.view(n, s)
        cols = max(1, self.bucket_numel // n)
        for c0, c1 in _spans(s, cols):
            keep = land(target[c0:c1], rows[r, c0:c1], 1.0 / self.dp.size)
            group.gradient.issued(group.dp.reduce_to_each([rows[i, c0:c1] for i in range(n)], on_done=keep))

    def _exchange(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """Gloo, two ranks, one reduction per step: each rank sends the other its row of each bucket of
        columns and receives the other's row of its own straight into the new gradient shard, then adds
        its own row and divides by D: ``(theirs + mine) / D``, bit for bit the reduce's sum of two. No
        buffer at all, and half the time of two reduces (see note: gloo exchange)."""
        s, r = group.shard_numel, group.dp.rank
        rows = grad.view(2, s)
        shard = group.gradient.new_reduced(grad.dtype)
        cols = max(1, self.bucket_numel // 2)
        for c0, c1 in _spans(s, cols):
            part = shard[c0:c1]
            pieces = [rows[i, c0:c1] for i in range(2)]
            into = [part, part]  # (this rank's entry is neither sent nor written)
            group.gradient.issued(group.dp.exchange_rows(pieces, into, on_done=_summer(part, rows[r, c0:c1],
                                                                                       1.0 / self.dp.size)))

    def _adds_into_shard(self, group: FlatParamGroup) -> bool:
        """Whether this reduction adds into a reduced shard (the fp32 accumulator, or the shard an earlier
        reduction of this backward wrote) rather than writing a new one."""
        return self.accumulate_fp32 or group.gradient.reduced is not None

    def _landing(self, group: FlatParamGroup, dtype: torch.dtype) -> tuple[torch.Tensor, _Landing]:
        """Where one reduction's owned elements land and how: added, divided by D, into the existing shard
        (``_adds_into_shard``), else copied, divided, into a new compute-dtype shard."""
        if self._adds_into_shard(group):
            return group.gradient.ensure_reduced(), _adder
        return group.gradient.new_reduced(dtype), _copier


def _adder(target: torch.Tensor, source: torch.Tensor, scale: float) -> Callable[[], None]:
    """``target += scale * source``, run when a reduction lands."""
    def add() -> None:
        target.add_(source, alpha=scale)
    return add


def _copier(target: torch.Tensor, source: torch.Tensor, scale: float) -> Callable[[], None]:
    """``target = scale * source``, run when a reduction lands."""
    def copy() -> None:
        torch.mul(source, scale, out=target)
    return copy


def _summer(target: torch.Tensor, mine: torch.Tensor, scale: float) -> Callable[[], None]:
    """``target = (target + mine) * scale``, run when the other rank's row has landed in ``target``."""
    def add() -> None:
        target.add_(mine).mul_(scale)
    return add


def _scaler(target: torch.Tensor, scale: float) -> Callable[[], None]:
    """``target *= scale``, run when a reduction lands."""
    def mul() -> None:
        target.mul_(scale)
    return mul


def _spans(s: int, cols: int) -> Iterator[tuple[int, int]]:
    """``(c0, c1)``: the buckets of ``cols`` columns (the last one shorter) over a shard of ``s`` elements."""
    for c0 in range(0, s, cols):
        yield c0, min(s, c0 + cols)

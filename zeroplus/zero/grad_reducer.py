"""Bucketed, asynchronous gradient reduction for flat groups: two strategies, chosen by the stage.

All-reduce (stage 0, and ``reduce_scatter: false``): the flat gradient is all-reduced in place in contiguous
buckets of ``reduce_bucket_size`` elements; stage 0 keeps it all, stages 1-3 keep the owned range, divided by D.

Reduce-scatter (stages 1-3): the flat gradient seen as an ``(N, S)`` matrix has rank r's shard in row r, so a
bucket is a block of columns ``[c0, c1)``, handed to the group as a matrix (``reduce_scatter_rows``); buckets may
be smaller than one parameter. The reduced ``c1 - c0`` elements, divided by D, are written into a new gradient
shard in the compute dtype when gradients are reduced once per step (stage 1, or no accumulation at stages 2-3),
else added into the fp32 gradient shard (or the shard an earlier reduction of this backward wrote). How the
bytes move (one tensor collective, gloo's per-rank reduces or row exchange, the shared-memory pair) and which
comm buffers that takes is the group's transport (``transports.py``), never asked here; under qgZ
(``zero_quantized_gradients``) each bucket goes as int8 codes in two all-to-alls (``quantized_comm.py``). With one
rank in all there is nothing to reduce: the flat gradient becomes the reduced gradient as it is (``_keep_whole``),
under either strategy.

N is the group's own partition size and D the data-parallel size: they differ for experts' groups (N = D / E,
``partition.py``). Memory in flight: at most one group's flat gradient (c * P) plus the comm buffers of the
buckets not yet waited on. Communication: c * P bytes per group per reduction.
See note: gradient shards; see note: one rank; see note: transport (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..collectives import Collectives
from ..config import ZeroStage
from ..ledger import Ledger
from ..transports import scaled_into
from . import quantized_comm
from .flat_group import FlatParamGroup


class GradReducer:
    def __init__(self, stage: ZeroStage, dp: Collectives, bucket_numel: int, use_reduce_scatter: bool,
                 overlap: bool, ledger: Ledger, accumulate_fp32: bool, quantize: bool = False,
                 nodes: tuple[Collectives, Collectives] | None = None, bits: int = 8, replicas: int = 1) -> None:
        """``quantize`` (qgZ): the reduce-scatter's buckets go as codes of ``bits`` (8 or 4: ``quantized_comm.py``);
        ``nodes``: this rank's node and the ranks at its place in every node, for qgZ's two levels over ``dp`` (None:
        one level). ``replicas``: under MiCS, the shard groups ``dp`` is one of; a group partitioned over ``dp`` is
        divided by its size here and averaged over the replicas before the step (``sharded_step.py``), one
        partitioned over another group (experts' expert-data group, which the replicas do not average) by D, the
        size times the replicas."""
        self.stage = stage
        self.quantize, self.bits = quantize, bits
        self.nodes = nodes
        self.accumulate_fp32 = accumulate_fp32
        self.dp = dp
        self.replicas = replicas
        self.bucket_numel = max(1, int(bucket_numel))
        self.use_reduce_scatter = use_reduce_scatter
        self.overlap = overlap
        self.ledger = ledger
        self._one_rank = dp.size == 1  # (decided here: nothing to reduce over)

    def reduce(self, group: FlatParamGroup) -> None:
        """Start reducing ``group``'s flat gradient; results land when ``group.gradient.wait()`` runs."""
        if self._one_rank and group.gradient.kept_whole() is not None:
            return  # one rank: the kept gradients stay where autograd put them (see note: one-rank gradients)
        grad = group.gradient.ensure_flat()
        if self.stage.partitions and self._one_rank and group.dp.size == 1:
            self._keep_whole(group, grad, self._adds_into_shard(group))
        elif self.stage.partitions and self.use_reduce_scatter:
            self._reduce_scatter(group, grad)
        else:
            self._all_reduce(group, grad)
        if self.stage.partitions:
            group.gradient.drop_flat()
        if not self.overlap:
            group.gradient.wait()

    def _scale(self, group: FlatParamGroup) -> float:
        """What ``group``'s reduced gradient is multiplied by: 1 / D in all (``replicas``)."""
        return 1.0 / (self.dp.size if group.dp is self.dp else self.dp.size * self.replicas)

    def _all_reduce(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """All-reduce contiguous buckets of the flat gradient in place; at stages 1-3 keep the owned range, divided
        by D (``reduce_scatter: false``)."""
        accumulate = self._adds_into_shard(group)
        target = self._shard(group, grad.dtype, accumulate) if self.stage.partitions else None
        lo, scale = group.owned_start, self._scale(group)
        for a in range(0, group.padded_numel, self.bucket_numel):
            b = min(group.padded_numel, a + self.bucket_numel)
            s, e = max(a, lo), min(b, lo + group.owned_numel)
            land = None
            if target is not None and s < e:
                land = scaled_into(target[s - lo:e - lo], grad[s:e], scale, accumulate)
            group.gradient.issued(group.dp.all_reduce(grad[a:b], on_done=land))

    def _reduce_scatter(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """Each bucket of columns reduce-scattered by the group, this rank's row landing, divided by D, in the new
        gradient shard or added into the existing one (``_adds_into_shard``)."""
        accumulate = self._adds_into_shard(group)
        n, s = group.dp.size, group.shard_numel
        target = self._shard(group, grad.dtype, accumulate)
        matrix, scale = grad.view(n, s), self._scale(group)
        for c0, c1 in _spans(s, max(1, self.bucket_numel // n)):
            if self.quantize:
                nodes = self.nodes if group.dp is self.dp else None  # (experts' groups: one level)
                group.gradient.issued(quantized_comm.reduce_scatter_rows(group.dp, matrix[:, c0:c1], target[c0:c1],
                                                                         scale, accumulate, self.ledger, nodes,
                                                                         self.bits))
                continue
            group.gradient.issued(group.dp.reduce_scatter_rows(matrix[:, c0:c1], target[c0:c1], scale, accumulate,
                                                               self.ledger))

    def _keep_whole(self, group: FlatParamGroup, grad: torch.Tensor, accumulate: bool) -> None:
        """One rank in all (data and partition groups of size 1) owns everything: the flat gradient becomes
        the reduced one, no copy and no division (or is added into it when accumulating)."""
        if accumulate:
            group.gradient.ensure_reduced().add_(grad)
        else:
            group.gradient.adopt_reduced(grad)

    @staticmethod
    def _shard(group: FlatParamGroup, dtype: torch.dtype, accumulate: bool) -> torch.Tensor:
        """Where the owned elements land: the existing reduced shard (``accumulate``), else a new one in ``dtype``."""
        return group.gradient.ensure_reduced() if accumulate else group.gradient.new_reduced(dtype)

    def _adds_into_shard(self, group: FlatParamGroup) -> bool:
        """Whether this reduction adds into a reduced shard (the fp32 accumulator, or the shard an earlier
        reduction of this backward wrote) rather than writing a new one."""
        return self.accumulate_fp32 or group.gradient.reduced is not None


def _spans(s: int, cols: int) -> Iterator[tuple[int, int]]:
    """``(c0, c1)``: the buckets of ``cols`` columns (the last one shorter) over a shard of ``s`` elements."""
    for c0 in range(0, s, cols):
        yield c0, min(s, c0 + cols)

"""The process topology: which ranks share a tensor-, context-, data-, pipeline-, expert- or expert-data-parallel group.

    world = data x context x tensor x pipeline,   rank = t + T * (c + C * (d + D * p))   (Megatron's order)

with ``t < T`` (tensor), ``c < C`` (context), ``d < D`` (data), ``p < P`` (pipeline). Expert parallelism
is carved out of the data dimension: ``d = e + E * x`` with ``e < E`` (the expert-parallel rank,
fastest, so an expert group's all-to-all stays among neighbouring ranks) and ``x < D / E`` (the
expert-data-parallel rank). With ``experts_span_tensor`` (the expert-data mode) it is carved out of
data x tensor instead: ``t + T * d = e + E * x`` with ``x < D T / E``, so tensor parallelism stays in
attention and the tensor ranks enlarge the expert group (``E`` a multiple of ``T``, dividing ``D T``);
each tensor rank routes 1/T of its tokens (``parallel/moe.py``).

- tensor group: the T ranks of one (c, d, p): they hold one copy of the model between them, each a
  slice of every tensor-parallel weight.
- data group: the D ranks of one (t, c, p): they see different micro-batches; ZeRO partitions dense
  parameters, gradients and optimizer states over it (over the zero group when C > 1).
- context group: the C ranks of one (t, d, p): they see the same sequences, each 1/C of every sequence's
  tokens, and hold the same weights (``zeroplus/parallel/context.py``).
- zero group: the D x C ranks of one (t, p) (the data group when C = 1): ZeRO partitions parameters,
  gradients and optimizer states over it and averages gradients over it, since every context rank's
  loss is the mean over its own tokens.
- pipeline group: the P ranks of one (t, c, d): the stages of one copy of the model.
- expert group: the E ranks of one (t, x, p): experts are split among them, tokens travel by all-to-all
  (expert-data mode: the E consecutive ranks of one (x, p), whole tensor groups).
- expert-data group: the D / E ranks of one (t, e, p): they hold the same experts; ZeRO partitions expert
  parameters over it (expert-data mode: the D T / E ranks of one (e, p)).
- model-parallel group: the T x P ranks of one (c, d): everything one copy of the model is split over
  (the gradient norm sums over it after the zero group).

Context parallelism is supported beside data parallelism (any ZeRO stage); with tensor, pipeline or
expert parallelism it is refused, with the numbers.

Memory: none (rank arithmetic). Communication: creating the groups is one ``new_group`` per group on
every rank, in the same order.
See note: context groups (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import ZeroStage

KINDS = ("tensor", "data", "pipeline", "expert", "expert_data", "model", "context", "zero", "shard", "replica",
         "secondary", "node", "across")


@dataclasses.dataclass(frozen=True)
class Coordinates:
    tensor: int
    data: int
    pipeline: int
    expert: int
    expert_data: int
    context: int = 0


@dataclasses.dataclass(frozen=True)
class Topology:
    """Sizes of each parallel dimension for ``world_size`` ranks; ``data`` is what remains."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1
    experts_span_tensor: bool = False  # the expert-data mode: expert groups drawn from data x tensor
    # MiCS / HSDP (``zero_optimization.mics_shard_size``): ZeRO shards within groups of this many consecutive ranks of
    # the zero group ("shard") and replicates across them ("replica": the ranks at one place in each); 0: the whole
    # zero group is one shard group
    shard: int = 0
    # hpZ (``zero_optimization.zero_hpz_partition_size``): ZeRO-3 keeps a second copy of each gathered unit's values,
    # split over groups of this many consecutive ranks of the zero group ("secondary"), for the gathers until the next
    # step; 0: none
    secondary: int = 0
    # two-level collectives over several nodes (qgZ's reduce-scatter, ``zero_optimization.zero_quantized_gradients``;
    # MiCS's gather, ``mics_hierarchical_params_gather``): each shard group (the zero group without MiCS) as nodes of
    # this many consecutive ranks ("node") and the ranks at one place in each ("across"); 0: one level
    node: int = 0

    def __post_init__(self) -> None:
        for key in ("world_size", "tensor", "pipeline", "expert", "context"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel size {key} must be a positive integer, got {value!r}")
        split = self.tensor * self.context * self.pipeline
        if self.world_size % split:
            names, sizes = ("tensor x context x pipeline", f"{self.tensor} x {self.context} x {self.pipeline}") \
                if self.context > 1 else ("tensor x pipeline", f"{self.tensor} x {self.pipeline}")
            raise ValueError(f"world size {self.world_size} is not divisible by {names} = {sizes} = {split}: "
                             f"world = data x {names}")
        others = {k: getattr(self, k) for k in ("tensor", "pipeline", "expert") if getattr(self, k) > 1}
        if self.context > 1 and others:
            raise ValueError(f"context size {self.context} with {', '.join(f'{k} size {v}' for k, v in others.items())}"
                             f" is not supported yet: context parallelism runs beside data parallelism only")
        if self.shard:
            self._check_tiling("mics_shard_size", self.shard, "the ranks ZeRO shards over", "MiCS shards")
        if self.secondary:
            self._check_tiling("zero_hpz_partition_size", self.secondary, "the ranks of a node's secondary copy",
                               "hpZ runs")
        if self.node:
            part = self.shard or self.data * self.context
            if not 1 < self.node < part or part % self.node:
                raise ValueError(f"nodes of {self.node} ranks must tile the {part} ranks ZeRO shards over in at "
                                 f"least 2 nodes for two-level collectives")
        if self.experts_span_tensor:
            self._check_span()
        elif self.data % self.expert:
            raise ValueError(f"expert-parallel size {self.expert} does not divide the data-parallel size {self.data} "
                             f"(world {self.world_size} / tensor {self.tensor} / pipeline {self.pipeline}): expert "
                             f"groups are carved out of the data-parallel ranks")

    def _check_tiling(self, key: str, size: int, ranks: str, mechanism: str) -> None:
        """MiCS's shard groups or hpZ's secondary groups (``zero_optimization.<key>`` is ``size``): groups of at least 2
        consecutive ranks tiling the zero group (of one tensor rank and pipeline stage: sizes count its data x context
        ranks), not beside the expert-data mode (``experts_span_tensor``), hpZ not beside pipelines (stage 3), and not
        both. Beside experts they lay out the dense parameters; the experts' stay partitioned over their expert-data
        groups."""
        zero = self.data * self.context
        where = f"zero_optimization.{key} {size!r}"
        if not isinstance(size, int) or size < 2 or zero % size:
            raise ValueError(f"{where}: {ranks}, at least 2, dividing the data-parallel size {zero} (groups of "
                             f"consecutive ranks)")
        others: dict[str, object] = {}
        if self.pipeline > 1 and key == "zero_hpz_partition_size":
            others["pipeline size"] = self.pipeline
        if self.experts_span_tensor:
            others["experts_span_tensor"] = True
        if self.shard and self.secondary and key == "zero_hpz_partition_size":
            others["mics_shard_size"] = self.shard
        if others:
            raise ValueError(f"{where} with {', '.join(f'{k} {v}' for k, v in others.items())} is not "
                             f"supported yet: {mechanism} beside data, tensor, context and expert parallelism only "
                             f"(MiCS beside pipelines too)")

    @property
    def replicas(self) -> int:
        """How many shard groups replicate each shard (1: no MiCS)."""
        return self.data * self.context // self.shard if self.shard else 1

    def _check_span(self) -> None:
        """The expert-data mode's sizes: whole tensor groups in each expert group, expert groups tiling data x
        tensor; context parallelism is refused beside it."""
        T, D, E = self.tensor, self.data, self.expert
        where = (f"zeroplus.parallel.experts_span_tensor draws expert groups from data x tensor = {D} x {T} "
                 f"= {D * T} ranks")
        if self.context > 1:
            raise ValueError(f"{where}; context size {self.context} is not supported beside it")
        if E % T or (D * T) % E:
            raise ValueError(f"{where}: expert size {E} must be a multiple of tensor size {T} and divide {D * T}")

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.context * self.pipeline)

    @property
    def expert_data(self) -> int:
        return self.data * (self.tensor if self.experts_span_tensor else 1) // self.expert

    def _expert_flat(self, t: int, d: int) -> int:
        """The index experts are carved from: the data rank, or (expert-data mode) ``t + T * d``."""
        return t + self.tensor * d if self.experts_span_tensor else d

    def _at_flat(self, f: int, p: int, c: int) -> int:
        """The global rank of expert-data-mode index ``f = t + T * d`` at pipeline ``p``, context ``c``."""
        return self.rank_of(f % self.tensor, f // self.tensor, p, c)

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        t, rest = rank % self.tensor, rank // self.tensor
        c, rest = rest % self.context, rest // self.context
        d, p = rest % self.data, rest // self.data
        f = self._expert_flat(t, d)
        return Coordinates(t, d, p, f % self.expert, f // self.expert, c)

    def rank_of(self, tensor: int = 0, data: int = 0, pipeline: int = 0, context: int = 0) -> int:
        return tensor + self.tensor * (context + self.context * (data + self.data * pipeline))

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``: lists of global ranks, each in its own rank order, the same on every rank."""
        T, D, P, E, X, C = self.tensor, self.data, self.pipeline, self.expert, self.expert_data, self.context
        at = self.rank_of
        if kind == "tensor":
            return [[at(t, d, p, c) for t in range(T)] for p in range(P) for d in range(D) for c in range(C)]
        if kind == "data":
            return [[at(t, d, p, c) for d in range(D)] for p in range(P) for c in range(C) for t in range(T)]
        if kind == "context":
            return [[at(t, d, p, c) for c in range(C)] for p in range(P) for d in range(D) for t in range(T)]
        if kind == "zero":
            return [[at(t, d, p, c) for d in range(D) for c in range(C)] for p in range(P) for t in range(T)]
        if kind == "pipeline":
            return [[at(t, d, p, c) for p in range(P)] for d in range(D) for c in range(C) for t in range(T)]
        if kind == "expert" and self.experts_span_tensor:
            return [[self._at_flat(e + E * x, p, c) for e in range(E)] for p in range(P) for x in range(X)
                    for c in range(C)]
        if kind == "expert_data" and self.experts_span_tensor:
            return [[self._at_flat(e + E * x, p, c) for x in range(X)] for p in range(P) for e in range(E)
                    for c in range(C)]
        if kind == "expert":
            return [[at(t, e + E * x, p, c) for e in range(E)]
                    for p in range(P) for x in range(X) for c in range(C) for t in range(T)]
        if kind == "expert_data":
            return [[at(t, e + E * x, p, c) for x in range(X)]
                    for p in range(P) for e in range(E) for c in range(C) for t in range(T)]
        if kind == "model":
            return [[at(t, d, p, c) for p in range(P) for t in range(T)] for d in range(D) for c in range(C)]
        if kind in ("shard", "replica"):
            size = self.shard or D * C
            zero = self.groups("zero")
            if kind == "shard":
                return [z[i:i + size] for z in zero for i in range(0, len(z), size)]
            return [z[j::size] for z in zero for j in range(size)]
        if kind in ("secondary", "node"):
            size = (self.secondary if kind == "secondary" else self.node) or 1
            return [z[i:i + size] for z in self.groups("zero") for i in range(0, len(z), size)]
        if kind == "across":  # (within each shard group)
            size = self.node or self.shard or D * C
            return [s[j::size] for s in self.groups("shard") for j in range(size)]
        raise ValueError(f"unknown group kind {kind!r}; one of {KINDS}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        return next(g for g in self.groups(kind) if rank in g)

    def to_dict(self) -> dict[str, int]:
        out = {"world_size": self.world_size, "tensor": self.tensor, "pipeline": self.pipeline,
               "expert": self.expert, "data": self.data}
        return out | ({"context": self.context} if self.context > 1 else {}) | \
            ({"experts_span_tensor": True} if self.experts_span_tensor else {}) | \
            {key: value for key in ("shard", "secondary", "node") if (value := getattr(self, key))}

    def describe(self) -> str:
        parts = [f"data {self.data}"] + ([f"context {self.context}"] if self.context > 1 else []) + \
            [f"tensor {self.tensor}", f"pipeline {self.pipeline}"]
        if self.expert > 1:
            over = " over data x tensor" if self.experts_span_tensor else ""
            parts.append(f"expert {self.expert}{over} (expert-data {self.expert_data})")
        sharded = f"; ZeRO shards over {self.shard} ranks, {self.replicas} replicas (MiCS)" if self.shard else ""
        if self.secondary:
            sharded += f"; ZeRO-3 keeps a secondary copy over {self.secondary} ranks (hpZ)"
        if self.node:
            sharded += f"; two-level collectives over nodes of {self.node} ranks"
        return f"{self.world_size} ranks = " + " x ".join(parts) + sharded


def check_supported(topology: Topology, zero_stage: int) -> None:
    """Combinations the engine refuses at initialisation, with the numbers."""
    if topology.pipeline > 1 and ZeroStage(zero_stage).shards_parameters:
        raise ValueError(f"ZeRO stage {zero_stage} with pipeline parallelism (pipeline size {topology.pipeline}) is "
                         f"not supported: a stage-3 gather per micro-batch per stage would repeat every parameter "
                         f"gather {topology.pipeline}-fold; use zero_optimization.stage 0, 1 or 2")


def describe_groups(topology: Topology) -> dict[str, Any]:
    return {kind: topology.groups(kind) for kind in KINDS}


__all__ = ["Coordinates", "KINDS", "Topology", "check_supported", "describe_groups"]

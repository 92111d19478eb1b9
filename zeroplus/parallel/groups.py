"""The process groups of a ``Topology``, created once per process and asked for by kind.

    groups = zeroplus.init_parallel({"zeroplus": {"parallel": {"tensor": 2}}})   # or a Topology
    groups.tensor.size, groups.data.rank, groups.coordinates.pipeline

Build a tensor-parallel model after this call (its layers ask ``parallel_groups()`` for the tensor
group); ``zeroplus.initialize`` then partitions over ``groups.data`` (and expert parameters over
``groups.expert_data``). Every rank creates every group in the same order (torch.distributed's rule);
groups of one rank are local objects with no process group behind them.
See note: model parallelism (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Callable, Iterator

import torch.distributed as dist

from ..comm import DataParallelGroup, init_distributed_if_launched
from ..config import parse_config
from ..transports import NATIVE
from .topology import KINDS, Coordinates, Topology

_CURRENT: ParallelGroups | None = None


class SingleRank(DataParallelGroup):
    """A group of this rank alone: every collective completes at once."""

    def __init__(self) -> None:
        super().__init__(None)
        self.rank, self.size = 0, 1
        # nothing moves: no backend, the native transport (its collectives complete at once)
        self.gloo, self.carrier = False, NATIVE


class ParallelGroups:
    def __init__(self, topology: Topology, rank: int, virtual: Callable[[int, int], Any] | None = None,
                 timeout_seconds: float | None = None, context_mode: str = "ulysses", ulysses_size: int = 1) -> None:
        """``virtual``: ``(rank in group, group size) -> group`` makes stand-ins instead of process groups
        (the memory estimate's ``VirtualGroup``: one rank of a topology simulated in one process).
        ``timeout_seconds``: the collective timeout of the groups created here."""
        self.topology = topology
        self.context_mode = context_mode  # how attention sees a sequence split over the context group
        # (context_mode, ulysses_size) as init_parallel compares them; one layout without context parallelism
        self.context_layout = (context_mode, ulysses_size) if topology.context > 1 else ("ulysses", 1)
        self.global_rank = rank
        self.coordinates: Coordinates = topology.coordinates(rank)
        self.world_group = None if virtual else _world_group()  # the default group these were made in
        self.ranks: dict[str, list[int]] = {}
        made: dict[str, Any] = {}
        if virtual is not None:
            for kind in KINDS:
                members = topology.group_of(kind, rank)
                made[kind], self.ranks[kind] = virtual(members.index(rank), len(members)), members
        for kind in KINDS if virtual is None else ():
            if ((kind == "zero" and topology.context == 1) or (kind in ("shard", "replica") and not topology.shard)
                    or (kind == "secondary" and not topology.secondary)
                    or (kind in ("node", "across") and not topology.node)):
                continue  # the data group itself, the zero group, or one rank (below)
            for members in topology.groups(kind):
                if len(members) == 1:
                    continue
                # the whole world: the default group; others: one new group per member list, on every rank
                timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
                handle = None if len(members) == topology.world_size else dist.new_group(members, timeout=timeout)
                if rank in members:
                    made[kind] = DataParallelGroup(handle, kind)
                    self.ranks[kind] = members
            made.setdefault(kind, SingleRank())
            self.ranks.setdefault(kind, [rank])
        if virtual is None and topology.context == 1:
            made["zero"], self.ranks["zero"] = made["data"], self.ranks["data"]
        if virtual is None and not topology.shard:
            made["shard"], self.ranks["shard"] = made["zero"], self.ranks["zero"]
            made["replica"], self.ranks["replica"] = SingleRank(), [rank]
        for kind in ("secondary", "node", "across") if virtual is None else ():
            if kind not in made:
                made[kind], self.ranks[kind] = SingleRank(), [rank]
        self.tensor, self.data, self.pipeline = made["tensor"], made["data"], made["pipeline"]
        self.expert, self.expert_data, self.model = made["expert"], made["expert_data"], made["model"]
        self.context = made["context"]  # the ranks sharing each sequence (zeroplus/parallel/context.py)
        self.zero = made["zero"]  # ZeRO's group: data x context
        # what ZeRO partitions over: the zero group, or under MiCS its shard group, whose shards the replica group
        # (one rank of each shard group) holds alike and averages the gradients of (zero/sharded_step.py)
        self.shard, self.replica = made["shard"], made["replica"]
        # hpZ: the ranks a stage-3 unit's secondary copy is split over (one rank when off; zero/flat_group.py)
        self.secondary = made["secondary"]
        # qgZ over several nodes: this rank's node and the ranks at its place in every node (one rank each when off)
        self.node, self.across = made["node"], made["across"]
        # the context ranks' two parts: the heads' all-to-all (Ulysses) and the K/V ring
        single = SingleRank()
        self.context_ulysses, self.context_ring = self.context, single
        if context_mode == "ring":
            self.context_ulysses, self.context_ring = single, self.context
        elif context_mode == "hybrid" and topology.context > 1:
            self.context_ulysses, self.context_ring = self._hybrid(topology, rank, ulysses_size, virtual,
                                                                   timeout_seconds)

    def _hybrid(self, topology: Topology, rank: int, u: int, virtual: Callable[[int, int], Any] | None,
                timeout_seconds: float | None) -> tuple[Any, Any]:
        """Each context group of C = U x R ranks (in context order) cut into R Ulysses groups of U consecutive
        ranks and U rings of R ranks, one from each; this rank's two. Every rank creates every group."""
        mine: dict[str, Any] = {}
        for members in topology.groups("context"):
            parts = {"ulysses": [members[i:i + u] for i in range(0, len(members), u)],
                     "ring": [members[i::u] for i in range(u)]}
            for kind, groups in parts.items():
                for group in groups:
                    if virtual is not None:
                        if rank in group:
                            mine[kind] = virtual(group.index(rank), len(group))
                        continue
                    timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
                    handle = dist.new_group(group, timeout=timeout)
                    if rank in group:
                        mine[kind] = DataParallelGroup(handle, f"context_{kind}")
        return mine["ulysses"], mine["ring"]

    def describe(self) -> str:
        c = self.coordinates
        return (f"{self.topology.describe()}; rank {self.global_rank} is tensor {c.tensor}, data {c.data}, "
                f"pipeline {c.pipeline}" + (f", expert {c.expert}" if self.topology.expert > 1 else "")
                + (f", context {c.context}" if self.topology.context > 1 else ""))


def _timeout(spec: Any) -> float | None:
    return spec.zeroplus.collective_timeout if hasattr(spec, "zeroplus") else None


def _context_mode(spec: Any) -> str:
    return spec.zeroplus.parallel.context_mode if hasattr(spec, "zeroplus") else "ulysses"


def _ulysses_size(spec: Any) -> int:
    return spec.zeroplus.parallel.ulysses_size if hasattr(spec, "zeroplus") else 1


def _context_layout(spec: Any, topology: Topology) -> tuple[str, int] | None:
    """(context_mode, ulysses_size) a config asks for; one layout without context parallelism; None for a
    ``Topology``, which names sizes only (any layout of them will do)."""
    if topology.context == 1:
        return "ulysses", 1
    if isinstance(spec, Topology):
        return None
    return _context_mode(spec), _ulysses_size(spec)


def _sizes(spec: Any) -> tuple[int, int, int, int]:
    if isinstance(spec, Topology):
        return spec.tensor, spec.pipeline, spec.expert, spec.context
    parallel = spec.zeroplus.parallel
    return parallel.tensor, parallel.pipeline, parallel.expert, parallel.context


def shard_size(spec: Any, world: int) -> int:
    """MiCS's shard size for a parsed config or a ``Topology`` over ``world`` ranks (``zero_optimization.
    mics_shard_size``): 0 where off (DeepSpeed's -1, or every rank ZeRO partitions over)."""
    if isinstance(spec, Topology):
        return spec.shard
    asked = spec.zero_optimization.mics_shard_size if spec is not None else -1
    asked = -1 if asked == "auto" else asked  # (the planner's, once it has chosen: groups made again)
    tensor, pipeline, _, _ = _sizes(spec) if spec is not None else (1, 1, 1, 1)
    return 0 if asked in (-1, world // (tensor * pipeline)) else asked


def secondary_size(spec: Any, world: int) -> int:
    """hpZ's secondary partition size for a parsed config or a ``Topology`` over ``world`` ranks (``zero_optimization.
    zero_hpz_partition_size``): 0 where off (DeepSpeed's 1, or every rank ZeRO partitions over)."""
    if isinstance(spec, Topology):
        return spec.secondary
    asked = spec.zero_optimization.zero_hpz_partition_size if spec is not None else 1
    asked = 1 if asked == "auto" else asked  # (the planner's, once it has chosen: groups made again)
    tensor, pipeline, _, _ = _sizes(spec) if spec is not None else (1, 1, 1, 1)
    return 0 if asked in (1, world // (tensor * pipeline)) else asked


def ranks_per_node(spec: Any) -> int:
    """Ranks per node: ``zeroplus.node_size``, else the launch's ``LOCAL_WORLD_SIZE`` (torchrun's ranks on this host),
    else every rank on one node. Node n holds global ranks ``n * size .. (n + 1) * size - 1``, as torchrun numbers
    them."""
    asked = spec.zeroplus.node_size if spec is not None and hasattr(spec, "zeroplus") else None
    if asked is not None:
        return asked
    launched = os.environ.get("LOCAL_WORLD_SIZE", "")
    if launched.isdigit() and int(launched) > 0:
        return int(launched)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def node_split(spec: Any, world: int) -> int:
    """Two-level collectives for a parsed config or a ``Topology`` over ``world`` ranks: a node's ranks of one zero
    group (``node_ranks``) where the ranks ZeRO shards over (MiCS's shard group, else the zero group) span whole nodes,
    more than one, and something runs in two levels there: qgZ's reduce-scatter (``zero_optimization.
    zero_quantized_gradients``) or MiCS's gather (``mics_hierarchical_params_gather`` with ``mics_shard_size`` set,
    as in DeepSpeed, the whole zero group included); else 0 (one level)."""
    if isinstance(spec, Topology):
        return spec.node
    if spec is None:
        return 0
    zero_cfg = spec.zero_optimization
    tensor, pipeline, _, _ = _sizes(spec)
    part = shard_size(spec, world) or world // (tensor * pipeline)
    gathers = zero_cfg.mics_hierarchical_params_gather and zero_cfg.mics_shard_size not in (-1, "auto")
    if not (zero_cfg.zero_quantized_gradients is True or gathers):  # ('auto': off until the planner says)
        return 0
    return tiling_nodes(spec, part)


def tiling_nodes(spec: Any, ranks: int, tensor: int | None = None) -> int:
    """A node's ranks of one zero group (``node_ranks``) where they cut ``ranks`` (the ranks ZeRO shards over, of one
    zero group) into more than one whole node, else 0: what MiCS, hpZ and the two-level collectives are laid over."""
    size = node_ranks(spec, tensor)
    return size if 1 < size < ranks and ranks % size == 0 else 0


def node_ranks(spec: Any, tensor: int | None = None) -> int:
    """How many ranks of one zero group a node holds: ``ranks_per_node`` L over the tensor size T (the config's, or
    ``tensor``: a layout the planner weighs), since tensor ranks are the fastest and a zero group's ranks (data x
    context, context the faster) are the next (node n holds the zero ranks ``n L / T .. (n + 1) L / T - 1`` of every
    tensor rank); 0 where T does not divide L (tensor groups across nodes) and beside pipeline parallelism (MiCS, hpZ
    and the two-level collectives do not run there: ``Topology._check_tiling``)."""
    given, pipeline, _, _ = _sizes(spec)
    tensor = given if tensor is None else tensor
    size = ranks_per_node(spec)
    return size // tensor if pipeline == 1 and size % tensor == 0 else 0


def _span(spec: Any) -> bool:
    """The expert-data mode (``Topology.experts_span_tensor``)."""
    if isinstance(spec, Topology):
        return spec.experts_span_tensor
    return spec.zeroplus.parallel.experts_span_tensor if hasattr(spec, "zeroplus") else False


def init_parallel(spec: Any = None, replace: bool = False) -> ParallelGroups:
    """Create (or return the existing) process groups for a parsed config, a config dict or path, or a
    ``Topology``. With no process group launched: one rank, every size 1 (anything else is an error). Groups of
    another layout exist: an error, or with ``replace`` new groups for this one (DeepSpeed's API: each
    ``deepspeed.initialize`` makes its config's groups, a config without parallel sizes plain data parallelism;
    an engine made before keeps its own)."""
    global _CURRENT
    if spec is not None and not isinstance(spec, Topology) and not hasattr(spec, "zeroplus"):
        spec = parse_config(spec)[0]
    init_distributed_if_launched(_timeout(spec))
    launched = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if launched else (1, 0)
    sizes = _sizes(spec) if spec is not None else (1, 1, 1, 1)
    shard, secondary, node = shard_size(spec, world), secondary_size(spec, world), node_split(spec, world)
    try:
        topology = Topology(world, *sizes, experts_span_tensor=spec is not None and _span(spec), shard=shard,
                            secondary=secondary, node=node)
    except ValueError as err:
        raise ValueError(f"rank {rank}: {err}") from None
    if _CURRENT is not None and _CURRENT.world_group is _world_group():
        old = _CURRENT.topology
        hierarchical = shard or secondary or node or old.shard or old.secondary or old.node
        if sizes == (1, 1, 1, 1) and not hierarchical and not replace:
            return _CURRENT  # a config without parallel sizes runs in the groups already made
        if _CURRENT.topology == topology:
            made, asked = _CURRENT.context_layout, _context_layout(spec, topology)
            if asked is not None and made != asked and not replace:  # the same sizes, another attention layout
                raise ValueError(f"rank {rank}: process groups exist for {topology.describe()} with context_mode "
                                 f"{made[0]!r} (ulysses_size {made[1]}), and the config asks for {asked[0]!r} "
                                 f"(ulysses_size {asked[1]}); call zeroplus.parallel.reset_parallel() first")
            if asked is None or made == asked:
                return _CURRENT
        if not replace:
            raise ValueError(f"rank {rank}: process groups exist for {_CURRENT.topology.describe()}, and the config "
                             f"asks for {topology.describe()}; call zeroplus.parallel.reset_parallel() first")
    _CURRENT = ParallelGroups(topology, rank, timeout_seconds=_timeout(spec), context_mode=_context_mode(spec),
                              ulysses_size=_ulysses_size(spec))
    return _CURRENT


@contextlib.contextmanager
def using(groups: ParallelGroups) -> Iterator[ParallelGroups]:
    """``parallel_groups()`` answers ``groups`` inside the block (the estimate builds one rank's split
    model with virtual groups this way), and what it answered before after it."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, groups
    try:
        yield groups
    finally:
        _CURRENT = previous


def _world_group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def parallel_groups() -> ParallelGroups:
    """The groups ``init_parallel`` made; one rank's groups (all of size 1) if it was not called."""
    return _CURRENT if _CURRENT is not None else init_parallel(None)


def current_groups() -> ParallelGroups | None:
    """The groups made so far, or None (unlike ``parallel_groups``, makes none)."""
    return _CURRENT


def reset_parallel() -> None:
    """Forget the groups (after ``destroy_process_group``, or to change the topology)."""
    global _CURRENT
    _CURRENT = None


__all__ = ["ParallelGroups", "init_parallel", "parallel_groups", "reset_parallel"]

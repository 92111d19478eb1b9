"""One parameter partitioned at construction (``zeroplus.Init``): this rank's chunk, and how to get it whole.

A parameter of ``numel`` elements over a group of N ranks is flattened, padded to ``N * chunk``
(``chunk = ceil(numel / N)``) and cut into N chunks; rank r keeps chunk r (``InitShard.values``,
``chunk`` elements in the parameter's dtype, on the device). The parameter itself keeps its shape,
dtype and device but no memory: its data becomes one NaN element expanded to the shape, so shape
queries work, writes fail loudly and a forward through it before ``initialize`` gives NaN, never
plausible numbers.

Memory per rank: ``chunk`` elements per parameter, plus, while one parameter is gathered
(``gather``), its whole ``numel`` and one padded all-gather buffer of ``N * chunk``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ..collectives import Collectives

SHARD_ATTR = "_zeroplus_init_shard"


@dataclasses.dataclass
class InitShard:
    """This rank's chunk of one parameter, and the group it is partitioned over."""

    values: torch.Tensor     # chunk elements, flat
    shape: torch.Size
    numel: int
    group: Collectives
    gathered: bool = False   # the parameter holds its whole values now
    blank: bool = False      # no values yet (a meta-device parameter): gathering allocates instead


def shard_of(param: torch.Tensor) -> InitShard | None:
    return getattr(param, SHARD_ATTR, None)


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,), fill, dtype=dtype, device=device).expand(shape)


def partition(param: torch.nn.Parameter, group: Collectives, device: torch.device,
              dtype: torch.dtype | None = None) -> None:
    """Keep this rank's chunk of ``param``'s values (the group's first rank's: every rank takes them, as
    ``initialize`` does) and release the rest. ``dtype``: cast the kept chunk."""
    with torch.no_grad():
        whole = param.data.to(device)
        group.broadcast(whole)
        flat = whole.reshape(-1)
        chunk = math.ceil(flat.numel() / group.size) if flat.numel() else 0
        start = min(group.rank * chunk, flat.numel())
        end = min(start + chunk, flat.numel())
        values = torch.zeros(chunk, dtype=dtype or flat.dtype, device=device)
        values[:end - start].copy_(flat[start:end])
        shard = InitShard(values, param.shape, flat.numel(), group)
        param.data = _placeholder(param.shape, values.dtype, device)
    setattr(param, SHARD_ATTR, shard)


def blank(shape: torch.Size, dtype: torch.dtype, device: torch.device, group: Collectives,
          requires_grad: bool) -> torch.nn.Parameter:
    """A partitioned parameter with no values yet (for a meta-device one): its first gather allocates it
    whole, uninitialised, for its initialisation to write."""
    numel = math.prod(shape)
    chunk = math.ceil(numel / group.size) if numel else 0
    param = torch.nn.Parameter(_placeholder(shape, dtype, device), requires_grad=requires_grad)
    setattr(param, SHARD_ATTR, InitShard(torch.zeros(chunk, dtype=dtype, device=device), shape, numel, group,
                                         blank=True))
    return param


def gather(param: torch.nn.Parameter) -> torch.Tensor:
    """The whole values of a partitioned parameter (a new tensor; a collective over its group)."""
    shard = shard_of(param)
    assert shard is not None, "gather() of a parameter zeroplus.Init did not partition"
    if shard.blank:
        shard.blank = False
        return torch.empty(shard.shape, dtype=shard.values.dtype, device=shard.values.device)
    chunk = shard.values.numel()
    padded = torch.empty(chunk * shard.group.size, dtype=shard.values.dtype, device=shard.values.device)
    shard.group.all_gather(padded, shard.values).wait()
    return padded[:shard.numel].view(shard.shape)


def materialize(param: torch.nn.Parameter, keep_values: bool = True) -> None:
    """Give ``param`` its whole values (``gather``) until ``repartition``; ``keep_values=False``: whole but
    uninitialised, for an operation that overwrites all of it (no collective, no gather buffer)."""
    shard = shard_of(param)
    if shard is None or shard.gathered:
        return
    if keep_values:
        param.data = gather(param)
    else:
        shard.blank = False
        param.data = torch.empty(shard.shape, dtype=shard.values.dtype, device=shard.values.device)
    shard.gathered = True


def repartition(param: torch.nn.Parameter, modifier_rank: int | None) -> None:
    """Release the whole values of a materialized parameter. ``modifier_rank``: the rank whose values
    every rank keeps (broadcast first: they were changed); None: the chunks are unchanged."""
    shard = shard_of(param)
    if shard is None or not shard.gathered:
        return
    with torch.no_grad():
        if modifier_rank is not None:
            whole = param.data.contiguous()
            shard.group.broadcast(whole, src=modifier_rank)
            flat = whole.reshape(-1)
            chunk = shard.values.numel()
            start = min(shard.group.rank * chunk, shard.numel)
            end = min(start + chunk, shard.numel)
            shard.values.zero_()
            shard.values[:end - start].copy_(flat[start:end])
        param.data = _placeholder(shard.shape, shard.values.dtype, shard.values.device)
    shard.gathered = False


def adopt(param: torch.nn.Parameter) -> torch.Tensor:
    """For ``initialize``: the whole values of a partitioned parameter (gathered), and forget the shard."""
    shard = shard_of(param)
    assert shard is not None
    values = param.data if shard.gathered else gather(param)
    delattr(param, SHARD_ATTR)
    return values


def partition_tree(model: torch.nn.Module, group: Collectives, device: torch.device,
                   dtype: torch.dtype | None = None) -> None:
    """Partition every parameter of ``model`` not partitioned yet, module by module (``zeroplus.Init`` does
    it as each module's ``__init__`` returns; the memory estimate does it to a meta model built whole)."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if shard_of(param) is None:
                partition(param, group, device, dtype)


def chunked_over(params: list[torch.nn.Parameter], group: Collectives) -> bool:
    """Whether every parameter holds ``zeroplus.Init`` chunks cut for ``group``'s ranks (same size, rank and
    members), so a flat group over them can be built from the chunks (``redistribute``)."""
    for p in params:
        shard = shard_of(p)
        if shard is None or shard.gathered or shard.blank:
            return False
        own = shard.group
        if (own.size, own.rank) != (group.size, group.rank) or members(own) != members(group):
            return False
    return True


def members(group: Collectives) -> list[int] | None:
    """The global ranks of a ``DataParallelGroup`` (None for the estimator's virtual group)."""
    if not getattr(group, "initialized", False):
        return None
    return dist.get_process_group_ranks(group.group if group.group is not None else dist.group.WORLD)


def redistribute(params: list[torch.nn.Parameter], offsets: list[int], numels: list[int], padded_numel: int,
                 group: Collectives, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of a flat group (``padded_numel / N`` elements from ``rank * that``, in ``dtype``)
    built from every rank's ``Init`` chunks of its parameters in one all-to-all: each element moves once,
    nothing is gathered whole. Memory: at most two of (the chunks, what this rank sends, what it receives,
    its part) at once, each about one shard of the group: the chunks are released once copied into what is
    sent, which is released once sent."""
    n_ranks, rank = group.size, group.rank
    part = padded_numel // n_ranks

    def pieces(source: int, dest: int) -> list[tuple[int, int, int]]:
        """(parameter index, flat start, flat end) that rank ``source``'s chunks hold of rank ``dest``'s part."""
        out = []
        for i, (off, n) in enumerate(zip(offsets, numels)):
            chunk = math.ceil(n / n_ranks) if n else 0
            lo, hi = off + min(source * chunk, n), off + min((source + 1) * chunk, n)
            lo, hi = max(lo, dest * part), min(hi, (dest + 1) * part)
            if lo < hi:
                out.append((i, lo, hi))
        return out

    sends, send_sizes = [], []
    for dest in range(n_ranks):
        mine = pieces(rank, dest)
        for i, lo, hi in mine:
            start = lo - offsets[i] - rank * (math.ceil(numels[i] / n_ranks))
            sends.append(shard_of(params[i]).values[start:start + hi - lo].to(dtype))  # type: ignore[union-attr]
        send_sizes.append(sum(hi - lo for _, lo, hi in mine))
    incoming = [pieces(source, rank) for source in range(n_ranks)]
    recv_sizes = [sum(hi - lo for _, lo, hi in got) for got in incoming]
    device = params[0].device
    send = torch.cat(sends) if sends else torch.empty(0, dtype=dtype, device=device)
    del sends
    for p in params:  # the chunks are in ``send`` now: release them before anything else is allocated
        delattr(p, SHARD_ATTR)
    received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    group.all_to_all_v(received, send, recv_sizes, send_sizes)
    del send
    owned = torch.zeros(part, dtype=dtype, device=device)
    cursor = 0
    for got in incoming:
        for _, lo, hi in got:
            owned[lo - rank * part:hi - rank * part].copy_(received[cursor:cursor + hi - lo])
            cursor += hi - lo
    return owned

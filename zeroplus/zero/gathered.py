"""``zeroplus.GatheredParameters(params, modifier_rank=None)``: partitioned parameters whole while inside.

Two kinds of parameters are gathered: those ``zeroplus.Init`` partitioned (each rank's chunk of each
parameter, ``init_shards.py``), and those an engine partitions (views of a flat group's buffer,
``flat_group.py``): at ZeRO-3 the units holding them are gathered (``Unit.wait_gather``) and released
on exit; at stages 0-2 they are whole already. On exit with ``modifier_rank=r`` every rank takes rank
r's values: an ``Init`` parameter's chunks are cut from them; an engine's parameter is broadcast and
written into the fp32 master's owned part (the master is what the next step and the next gather read),
so the change outlives the context. With ``modifier_rank=None`` the context is read only: a parameter
changed in place inside it is an error on exit (its change would be lost on some ranks), as is a
nested context with another modifier rank, and parameters of more than one engine in one context.

Memory: the gathered parameters (or units) whole while inside, as the engine's own gathers.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from . import init_shards
from .construction import Init
from .flat_group import FLAT_ATTR, FlatParamGroup
from .init_shards import shard_of

_NONE = object()


class GatheredParameters:
    """See the module docstring; ``fwd_module`` is accepted for DeepSpeed's signature and unused."""

    _modifiers: dict[int, int | None] = {}  # parameters gathered by an active context -> its modifier_rank

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: torch.nn.Module | None = None, enabled: bool = True) -> None:
        self.params: list[torch.nn.Parameter] = [params] if isinstance(params, torch.nn.Parameter) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._mine: list[tuple[torch.nn.Parameter, int]] = []
        self._units: list[Any] = []

    def _claim(self, p: torch.nn.Parameter) -> bool:
        """Register ``p`` as gathered by this context; False if an enclosing one already has it."""
        outer = GatheredParameters._modifiers.get(id(p), _NONE)
        if outer is not _NONE:
            if outer != self.modifier_rank:
                raise ValueError(f"zeroplus.GatheredParameters: a parameter of shape {tuple(p.shape)} is already "
                                 f"gathered with modifier_rank={outer}; a nested context asks "
                                 f"modifier_rank={self.modifier_rank}")
            return False
        GatheredParameters._modifiers[id(p)] = self.modifier_rank
        self._mine.append((p, p._version))
        return True

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        engines = {id(getattr(p, FLAT_ATTR).owner) for p in self.params if hasattr(p, FLAT_ATTR)}
        if len(engines) > 1:
            raise ValueError(f"zeroplus.GatheredParameters: the parameters belong to {len(engines)} different "
                             f"engines; gather each engine's parameters in a context of its own")
        for p in self.params:
            group = getattr(p, FLAT_ATTR, None)
            if group is not None:
                if not self._claim(p):
                    continue
                group.wait_pending()
                unit = group.unit
                if group.stage.shards_parameters and unit is not None and unit not in self._units:
                    if group.gathered:  # gathered by the engine (a prefetch may be in flight): let it land, and
                        unit.wait_gather()  # (qwZ) gather exactly what holds int8 codes
                    else:
                        unit.wait_gather()
                        self._units.append(unit)
            elif shard_of(p) is not None:
                if not self._claim(p):
                    continue
                init_shards.materialize(p)
                if Init._active is not None:
                    Init._active.mode.pinned.add(id(p))
        return self

    def __exit__(self, *exc: Any) -> None:
        changed = [tuple(p.shape) for p, version in self._mine if p._version != version]
        try:
            for p, _ in self._mine:
                group = getattr(p, FLAT_ATTR, None)
                if group is not None:
                    if self.modifier_rank is not None and exc[0] is None:
                        _take_from(p, group, self.modifier_rank)
                    continue
                if Init._active is not None:
                    Init._active.mode.pinned.discard(id(p))
                    Init._active.mode.window.pop(id(p), None)
                init_shards.repartition(p, self.modifier_rank)
            for unit in self._units:
                unit.release()
        finally:
            for p, _ in self._mine:
                GatheredParameters._modifiers.pop(id(p), None)
            self._mine.clear()
            self._units.clear()
        if changed and self.modifier_rank is None and exc[0] is None:
            raise ValueError(f"zeroplus.GatheredParameters(modifier_rank=None) is read only, and parameters of "
                             f"shapes {changed} were changed in place inside it: give modifier_rank (the rank "
                             f"whose values every rank keeps) to change them")


def _take_from(param: torch.nn.Parameter, group: FlatParamGroup, rank: int) -> None:
    """Every rank takes rank ``rank``'s values of an engine's parameter, in its flat buffer and master."""
    index = next(i for i, q in enumerate(group.params) if q is param)
    off, n = group.offsets[index], group.numels[index]
    with torch.no_grad():
        flat = group._full_data[off:off + n]
        group.dp.broadcast(flat, src=rank)
        group.write_param(index, flat.to(torch.float32))

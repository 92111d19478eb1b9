"""The slices a Hugging Face model's own plans cut (AutoTP over the tensor group, ``autotp.py``; AutoEP over the expert
group, ``autoep.py``), recorded as they are cut, so whole-model names still address them:

- ``Cut(dim, packed)``: along ``dim``, each of ``packed`` equal parts on its own (``[gate; up]``: 2), every rank of
  the group taking its ``1/size`` of each part, in rank order; ``record(param, cut, kind)`` notes one (``kind``:
  ``"tensor"`` or ``"expert"``, the group it was cut over);
- ``slicing(model, parallel, what)``: for a model split by its plans alone, each parameter's ``Slicing`` (its cut
  and the group), None for the whole ones; refused, naming the layout, where the model is split some other way
  (pipeline stages, zeroplus's own tensor-parallel or expert layers);
- ``whole(slices, shape, cut)``: the whole tensor from the group's slices laid end to end (``save_pretrained``);
  ``cut_from(value, cut, group)``: this rank's slice of a whole (a meta-device model built whole, then cut);
  ``SlicePart``: which runs of a whole's flat elements a slice holds (``load_pretrained`` reads only those).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, TypeVar

import torch
from torch import nn

from ..comm import DataParallelGroup
from .moe import is_expert
from .registry import ParameterSet
from .tensor_layers import is_tensor_parallel

Kind = Literal["tensor", "expert"]
_P = TypeVar("_P", bound=torch.Tensor)


@dataclasses.dataclass(frozen=True)
class Cut:
    dim: int
    packed: int = 1


@dataclasses.dataclass(frozen=True)
class Slicing:
    cut: Cut
    group: DataParallelGroup  # the ranks whose slices make the whole
    replicas: DataParallelGroup  # the ranks that hold this same slice (ZeRO partitions it over them)


_CUTS: dict[tuple[Kind, Cut], ParameterSet] = {}


def cut_marks(cut: Cut, kind: Kind) -> ParameterSet:
    """The parameters recorded as cut by ``cut`` over the ``kind`` group."""
    return _CUTS.setdefault((kind, cut), ParameterSet())


def record(param: _P, cut: Cut, kind: Kind) -> _P:
    return cut_marks(cut, kind).add(param)


def cut_of(param: object) -> tuple[Kind, Cut] | None:
    """How a plan cut ``param`` (over which group), None where none did."""
    return next((key for key, params in _CUTS.items() if param in params), None)


def slicing(model: nn.Module, parallel: Any, what: str) -> Callable[[torch.Tensor], Slicing | None] | None:
    """Each parameter's ``Slicing`` for a model split by its plans alone; None where the model is not split; a
    ``ValueError`` starting with ``what`` where it is split some other way, whose slices whole-model names cannot
    address."""
    if parallel is None or (parallel.model.size == 1 and parallel.expert.size == 1):
        return None
    other = [p for p in model.parameters() if (is_tensor_parallel(p) or is_expert(p)) and cut_of(p) is None]
    if parallel.pipeline.size > 1 or other:
        raise ValueError(f"{what}, and this run splits the model ({parallel.topology.describe()}) in a way they "
                         f"do not address (only a Hugging Face model split by its plans: AutoTP at tensor sizes "
                         f"above 1, AutoEP at expert sizes above 1)")
    groups = {"tensor": (parallel.tensor, parallel.zero), "expert": (parallel.expert, parallel.expert_data)}

    def of(param: torch.Tensor) -> Slicing | None:
        found = cut_of(param)
        return None if found is None else Slicing(found[1], *groups[found[0]])
    return of


def slicer(of: Callable[[torch.Tensor], Slicing | None]) -> Callable[
        [torch.Tensor], tuple[Callable[[torch.Tensor], torch.Tensor], DataParallelGroup] | None]:
    """For a meta-device model built again from its config (``zero/meta_init.py``): for each parameter that is a
    slice, what cuts this rank's slice from the whole one and the ranks that hold the same slice; None for the
    others."""
    def cutter(param: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], DataParallelGroup] | None:
        found = of(param)
        return None if found is None else (functools.partial(cut_from, cut=found.cut, group=found.group),
                                           found.replicas)
    return cutter


def whole(slices: torch.Tensor, shape: torch.Size, cut: Cut) -> torch.Tensor:
    """The whole tensor from every rank's slice of shape ``shape``, in rank order, laid end to end in ``slices``
    (what an all-gather of the flattened slices gives)."""
    pieces = slices.view(-1, *shape).unbind(0)
    return torch.cat([torch.cat([p.chunk(cut.packed, cut.dim)[k] for p in pieces], cut.dim)
                      for k in range(cut.packed)], cut.dim)


def cut_from(value: torch.Tensor, cut: Cut, group: DataParallelGroup) -> torch.Tensor:
    """This rank's slice of a whole ``value`` (``whole``'s inverse), a copy."""
    return torch.cat([part.chunk(group.size, cut.dim)[group.rank] for part in value.chunk(cut.packed, cut.dim)],
                     cut.dim).clone()


@dataclasses.dataclass(frozen=True)
class SlicePart:
    """Which elements of the whole tensor a rank's slice (of ``shape``, cut by ``cut``) holds: runs of the whole's
    flat elements, one per index of the dimensions before the cut and per packed part, ascending, laid end to end
    in the slice's own flat order."""
    shape: tuple[int, ...]
    cut: Cut
    rank: int
    size: int

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return tuple(n * self.size if d == self.cut.dim else n for d, n in enumerate(self.shape))

    def windows(self, start: int, end: int, limit: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """Elements ``[start, end)`` of the slice as ranges of the whole, ``(first, last, [(a, b), ...])``: each
        window ``[first, last)`` spans at most ``limit`` elements (or one run's part) and holds its ranges."""
        whole_shape = self.whole_shape
        dim, packed = self.cut.dim, self.cut.packed
        inner = math.prod(whole_shape[dim + 1:])
        part = whole_shape[dim] // packed * inner  # one packed part's elements per outer index
        run = part // self.size
        out: list[tuple[int, int, list[tuple[int, int]]]] = []
        for j in range(start // run, (end - 1) // run + 1 if end > start else start // run):
            outer, k = divmod(j, packed)
            at = outer * packed * part + k * part + self.rank * run - j * run  # whole index of slice index 0 of run j
            a, b = max(start, j * run) + at, min(end, (j + 1) * run) + at
            if out and b - out[-1][0] <= limit:
                out[-1] = (out[-1][0], b, [*out[-1][2], (a, b)])
            else:
                out.append((a, b, [(a, b)]))
        return out


__all__ = ["Cut", "SlicePart", "Slicing", "cut_from", "cut_marks", "cut_of", "record", "slicer", "slicing", "whole"]

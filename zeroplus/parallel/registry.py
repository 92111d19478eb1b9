"""``ParameterSet``: which parameters have a property (split over the tensor group, an expert's), held by
weak reference and identity (tensors compare by value, so a ``WeakSet`` would compare their elements).
``carry_marks`` gives a copy of a parameter (the estimate's meta copy) the original's properties."""
from __future__ import annotations

import weakref
from typing import TypeVar

import torch

_ALL: list[ParameterSet] = []
_T = TypeVar("_T", bound=torch.Tensor)


class ParameterSet:
    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}
        _ALL.append(self)

    def add(self, param: _T) -> _T:
        key = id(param)
        self._refs[key] = weakref.ref(param, lambda _: self._refs.pop(key, None))
        return param

    def discard(self, param: torch.Tensor) -> None:
        if param in self:
            del self._refs[id(param)]

    def __contains__(self, param: object) -> bool:
        ref = self._refs.get(id(param))
        return ref is not None and ref() is param


def carry_marks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` in every set ``old`` is in (a copy of a model keeps its parameters' properties)."""
    for marks in _ALL:
        if old in marks:
            marks.add(new)


__all__ = ["ParameterSet", "carry_marks"]

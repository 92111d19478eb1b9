"""``ParameterSet``: which parameters have a property (split over the tensor group, an expert's), held by
weak reference and identity (tensors compare by value, so a ``WeakSet`` would compare their elements)."""
from __future__ import annotations

import weakref

import torch


class ParameterSet:
    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, param: torch.Tensor) -> torch.Tensor:
        key = id(param)
        self._refs[key] = weakref.ref(param, lambda _: self._refs.pop(key, None))
        return param

    def __contains__(self, param: object) -> bool:
        ref = self._refs.get(id(param))
        return ref is not None and ref() is param


__all__ = ["ParameterSet"]

"""``NewStorageBytes``: the peak bytes of tensors created while it is active and still alive (views and
in-place results excluded: they share an input's storage). Measures what a piece of engine code
copies, e.g. a checkpoint save."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NewStorageBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _died(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage()._cdata not in inputs:
            storage = out.untyped_storage()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._died, storage.nbytes())
        return out

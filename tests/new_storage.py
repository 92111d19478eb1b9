"""``NewStorageBytes``: the peak bytes of tensors created while it is active and still alive (views and
in-place results excluded: they share an input's storage). Measures what a piece of engine code
copies, e.g. a checkpoint save. A storage resized while it is active (stage 3 frees a gathered buffer
by resizing it to 0) counts at its new size."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NewStorageBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _died(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            self.live += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self.peak = max(self.peak, self.live)

    def __enter__(self) -> NewStorageBytes:
        original = self._original_resize = torch.UntypedStorage.resize_
        watcher = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            watcher._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage()._cdata not in inputs:
            storage = out.untyped_storage()
            key = storage._cdata
            if key not in self._sizes:
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._died, key)
        return out

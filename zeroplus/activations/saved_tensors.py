"""One ``saved_tensors_hooks`` context around the engine's forward, shared by the techniques.

Each technique (a *claimer*) is offered every tensor autograd saves for backward; the first that
returns a token keeps it, and that technique's ``unpack`` gives the tensor back when backward
needs it. Unclaimed tensors are kept as a detached alias (same storage, no reference cycle
through their grad_fn), which costs nothing, with their version: autograd checks no in-place
modification of what passes through hooks, so ``_unpack`` does. Installed only when some technique is enabled, so
the engine without them runs autograd untouched. Tensors saved inside
``torch.utils.checkpoint`` regions are the checkpoint's (its hooks are innermost).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (stable while its size changes; views share it)."""
    return t.untyped_storage()._cdata


class Claimer(Protocol):
    def begin_forward(self) -> None: ...
    def end_forward(self) -> None: ...
    def pack(self, tensor: torch.Tensor) -> Any | None: ...
    def unpack(self, token: Any) -> torch.Tensor: ...
    def end_backward(self) -> None: ...
    def remove(self) -> None: ...


class SavedTensorRouter:
    def __init__(self, claimers: list[Claimer], undo: list[Callable[[], None]] | None = None) -> None:
        """``undo``: what else was changed on the model (``engine/model_patches.py``'s record of the forwards
        and settings the techniques replaced), undone by ``remove``."""
        self.claimers = claimers
        self.undo = list(undo or [])

    def remove(self) -> None:
        """Remove every claimer's hooks from the model (``Engine.destroy``), and undo the other changes; the
        router then claims nothing."""
        for c in self.claimers:
            c.remove()
        self.claimers = []
        for give_back in reversed(self.undo):
            give_back()
        self.undo = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not self.claimers or not torch.is_grad_enabled():
            yield
            return
        for c in self.claimers:
            c.begin_forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            for c in self.claimers:
                c.end_forward()

    def _pack(self, tensor: torch.Tensor) -> tuple[Claimer | None, Any]:
        for c in self.claimers:
            token = c.pack(tensor)
            if token is not None:
                return c, token
        return None, (tensor.detach(), tensor._version)

    @staticmethod
    def _unpack(packed: tuple[Claimer | None, Any]) -> torch.Tensor:
        claimer, token = packed
        if claimer is not None:
            return claimer.unpack(token)
        alias, version = token
        if alias._version != version:  # (autograd checks no versions through hooks: this is its check)
            raise RuntimeError(f"a tensor of shape {tuple(alias.shape)} saved for backward was modified in place "
                               f"after the forward (version {version} -> {alias._version}); backward would use "
                               f"other values than the forward's")
        return alias

    def end_backward(self) -> None:
        for c in self.claimers:
            c.end_backward()

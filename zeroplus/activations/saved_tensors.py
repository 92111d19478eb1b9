"""One ``saved_tensors_hooks`` context around the engine's forward, shared by the techniques.

Each technique (a *claimer*) is offered every tensor autograd saves for backward; the first that
returns a token keeps it, and that technique's ``unpack`` gives the tensor back when backward
needs it. Unclaimed tensors are kept as a detached alias (same storage, no reference cycle
through their grad_fn), which costs nothing, with their version: autograd checks no in-place
modification of what passes through hooks, so ``_unpack`` does. Installed only when some technique is enabled, so
the engine without them runs autograd untouched, and only inside the partition's repeated blocks
(``scope``), where the techniques act: with hooks, autograd gives back every saved tensor as a new tensor
object, so a parameter saved by code outside the blocks (TRL's chunked log-probabilities save the head
weight and read its ``ds_status`` in backward) would come back without its attributes. Tensors saved inside
``torch.utils.checkpoint`` regions are the checkpoint's (its hooks are innermost). The router's ``forward`` also
enters the techniques that act on the forward's calls rather than on what it saves (``around``: the lean loss's
function mode), with or without claimers, until it says it is ``idle``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol

import torch

from ..eager import eager


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (stable while its size changes; views share it)."""
    return t.untyped_storage()._cdata


class Claimer(Protocol):
    stood_down: bool  # turned itself off for good at ``begin_forward`` (resize recompute finding a compiled model)
    lets_inner_hooks: bool  # hooks pushed inside the router's may take the saves of a region (it claims less)

    def begin_forward(self) -> None: ...
    def end_forward(self) -> None: ...
    def pack(self, tensor: torch.Tensor) -> Any | None: ...
    def unpack(self, token: Any) -> torch.Tensor: ...
    def end_backward(self) -> None: ...
    def remove(self) -> None: ...


class ForwardMode(Protocol):
    """A technique acting on the forward's calls (``around``), entered for each training forward."""

    kept: set[int]  # storage keys the current forward keeps for backward that the forward's output may hold
    idle: bool  # nothing to do in this model's forwards: no longer entered (see note: idle modes)

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> Any: ...


class SavedTensorRouter:
    def __init__(self, claimers: list[Claimer], undo: list[Callable[[], None]] | None = None,
                 scope: list[torch.nn.Module] | None = None,
                 around: list[ForwardMode] | None = None) -> None:
        """``undo``: what else was changed on the model (``engine/model_patches.py``'s record of the forwards
        and settings the techniques replaced), undone by ``remove``. ``scope``: the modules (the partition's
        repeated blocks) whose forwards alone run under the hooks; none: the whole forward (see note: hook
        scope). ``around``: contexts (re-entrant, such as a ``TorchFunctionMode``) every training forward runs in."""
        self.claimers = claimers
        self.around = list(around or [])
        self.undo = list(undo or [])
        self._open = False  # the engine's forward is running (``forward``): scope modules push the hooks
        self._pushed: list[Any] = []  # the hook contexts the scope modules entered, innermost last
        self._handles = [h for m in (scope or []) if claimers
                         for h in (m.register_forward_pre_hook(eager(self._enter_scope)),
                                   m.register_forward_hook(eager(self._leave_scope), always_call=True))]

    @property
    def lets_inner_hooks(self) -> bool:
        """Whether a mechanism that pushes its own saved-tensor hooks inside the router's may run rather than
        stand aside (``parallel/ulysses_output.py``, asked through the top hooks' owner): every claimer only
        claims less then (resize recompute), none loses what it was asked to move (swap attention)."""
        return all(c.lets_inner_hooks for c in self.claimers)

    def remove(self) -> None:
        """Remove every claimer's hooks from the model (``Engine.destroy``), and undo the other changes; the
        router then claims nothing."""
        for c in self.claimers:
            c.remove()
        self.claimers = []
        self.around = []
        for h in self._handles:
            h.remove()
        self._handles = []
        for give_back in reversed(self.undo):
            give_back()
        self.undo = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not torch.is_grad_enabled():
            yield
            return
        with contextlib.ExitStack() as stack:
            for context in self.around:
                if not context.idle:
                    stack.enter_context(context)
            with self._hooks():
                yield

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        if not self.claimers:
            yield
            return
        for c in self.claimers:
            c.begin_forward()
        self.claimers = [c for c in self.claimers if not c.stood_down]  # (it removed its own hooks)
        if not self.claimers:
            yield
            return
        try:
            if self._handles:
                self._open = True
                yield
            else:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield
        finally:
            self._open = False
            while self._pushed:  # (a forward that raised inside a scope module)
                self._pushed.pop()[1].__exit__(None, None, None)
            for c in self.claimers:
                c.end_forward()

    def kept(self) -> set[int]:
        """Storages the last training forward's ``around`` techniques keep for backward (``ForwardMode.kept``)."""
        return set().union(*(m.kept for m in self.around))

    def _enter_scope(self, module: torch.nn.Module, args: Any) -> None:
        if self._open and self.claimers:  # (not an activation-checkpoint replay in backward)
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            self._pushed.append((module, hooks))

    def _leave_scope(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._pushed and self._pushed[-1][0] is module:
            self._pushed.pop()[1].__exit__(None, None, None)

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

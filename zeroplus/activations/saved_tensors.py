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
function mode), with or without claimers, until it says it is ``idle``; one that only acts after the blocks
(``late``) is entered when the last scope module's forward ends, so the blocks' calls do not pass through it,
unless a claimer watches calls too (modes leave in stack order) or a forward took its calls before then (see
note: idle modes).
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
    watches_calls: bool  # enters a function mode of its own at ``begin_forward`` (no ``late`` entry beside it)
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
    late: bool  # its calls come after the blocks: may be entered when the last scope module's forward ends
    taken: int  # calls it acted on so far (whether any came before the blocks ended)

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> Any: ...


class SavedTensorRouter:
    def __init__(self, claimers: list[Claimer], undo: list[Callable[[], None]] | None = None,
                 scope: list[torch.nn.Module] | None = None,
                 around: list[ForwardMode] | None = None, late: bool = True) -> None:
        """``undo``: what else was changed on the model (``engine/model_patches.py``'s record of the forwards
        and settings the techniques replaced), undone by ``remove``. ``scope``: the modules (the partition's
        repeated blocks) whose forwards alone run under the hooks; none: the whole forward (see note: hook
        scope). ``around``: contexts (re-entrant, such as a ``TorchFunctionMode``) every training forward runs in;
        ``late``: those that may be entered at the end of the last scope module's forward are (a forward hook on it;
        false for a model compiled as a whole, where the hook would break the graph)."""
        self.claimers = claimers
        self.around = list(around or [])
        self.undo = list(undo or [])
        self._open = False  # the engine's forward is running (``forward``): scope modules push the hooks
        self._pushed: list[Any] = []  # the hook contexts the scope modules entered, innermost last
        self._handles = [h for m in (scope or []) if claimers
                         for h in (m.register_forward_pre_hook(eager(self._enter_scope)),
                                   m.register_forward_hook(eager(self._leave_scope), always_call=True))]
        # the late modes: entered at the end of the last scope module's forward, once a forward showed that is safe
        self._tail = ([scope[-1].register_forward_hook(eager(self._tail_ended))]
                      if late and scope and any(m.late for m in self.around) else [])
        self.late_safe = False  # the first forward took every call after the tail ended (see note: idle modes)
        self.decided = False  # whether the first training forward has ended (and the modes' use was read off it)
        self._waiting: list[ForwardMode] = []  # late modes to enter at the tail's end (this forward)
        self._entered: list[ForwardMode] = []  # late modes entered (this forward)
        self._taken_at_tail: int | None = None  # (an early forward) calls taken when the tail ended

    @property
    def waits_on_tail(self) -> bool:
        """Whether a hook on the last scope module still waits to enter the late modes (it comes off once the
        first forward showed they take nothing there: see note: idle modes)."""
        return bool(self._tail)

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
        for h in self._handles + self._tail:
            h.remove()
        self._handles, self._tail = [], []
        for give_back in reversed(self.undo):
            give_back()
        self.undo = []

    @contextlib.contextmanager
    def forward(self, compiled: Callable[[], bool] | None = None) -> Iterator[None]:
        """The context of one forward of the engine. ``compiled``: whether the model runs compiled, asked once, at
        the end of the first training forward: then the ``around`` modes are entered from the start of every
        forward, as in the first (TorchDynamo guards on the mode stack: a change would recompile)."""
        if not torch.is_grad_enabled():
            yield
            return
        active = [m for m in self.around if not m.idle]
        if self.decided and not active and not self.claimers:  # (every technique idle or stood down: nothing to do)
            yield
            return
        late = self.late_safe and not any(c.watches_calls for c in self.claimers)
        self._waiting = [m for m in active if late and m.late]
        self._taken_at_tail = None
        taken = None if self.decided else sum(m.taken for m in active)  # (the first forward's observation)
        exc: tuple[Any, Any, Any] = (None, None, None)
        with contextlib.ExitStack() as stack:
            for context in active:
                if context not in self._waiting:
                    stack.enter_context(context)
            try:
                with self._hooks():
                    yield
            except BaseException as err:
                exc = (type(err), err, err.__traceback__)
                raise
            finally:
                while self._entered:
                    self._entered.pop().__exit__(*exc)
                self._waiting = []
        if not self.decided:  # see note: idle modes
            self.decided = True
            if compiled is None or not compiled():
                for m in self.around:
                    m.idle = not m.taken
                self.late_safe = self._taken_at_tail == taken  # (None: no tail, or it never ran)
                if all(m.idle for m in self.around):  # no late mode to enter: the tail's hook goes
                    for h in self._tail:
                        h.remove()
                    self._tail = []

    def _tail_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The last scope module's forward ended: enter the late modes (once a forward), or note the calls taken."""
        if self._waiting and torch.is_grad_enabled():
            for m in self._waiting:
                m.__enter__()
                self._entered.append(m)
            self._waiting = []
        elif not self.decided and self._taken_at_tail is None:
            self._taken_at_tail = sum(m.taken for m in self.around if not m.idle)

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        if not self.claimers:
            yield
            return
        for c in self.claimers:
            c.begin_forward()
        self.claimers = [c for c in self.claimers if not c.stood_down]  # (it removed its own hooks)
        if not self.claimers:  # every claimer stood down, before this forward ran: the scope hooks go too
            for h in self._handles:
                h.remove()
            self._handles = []
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

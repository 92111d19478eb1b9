"""A norm written out keeps only its input for backward: what it computed is recomputed there.

A norm written in several ops (``(x - m) / sqrt(v + eps) * w + b``, Hugging Face's ``LlamaRMSNorm``) has autograd
keep the tensors it computed: ``x - m`` and the quotient, the normalised input, in bf16 an fp32 copy of the input;
torch's fused norms keep the input and a mean and a scale per row. For a norm found to keep such intermediates
(``module_roles.keeps_intermediates``, by what it computes), each tensor autograd saves while its forward runs
under the engine's saved-tensor hooks, other than its tensor inputs and parameters (as the module holds them then,
after every pre-hook), is *claimed*: autograd keeps a token instead, and the tensor dies with the forward. The first
token unpacked in backward runs the module's forward again (not its hooks, which ran in the forward: a parameter's
gather or gradient routing) on the same inputs (detached, with the same ``requires_grad``; under the forward's
autocast state; gradients on) under hooks that collect every tensor its ops save, and hands each token the tensor
saved at its place in that order.
The ops, inputs and flags are the forward's, so the order and values are too: gradients are bitwise the run
without it; a different count, shape or dtype raises rather than hand backward something else, as does an input
written in place since the forward.

Memory: the claimed bytes (distinct storages) are not held from the norm's forward to its backward (the ledger's
``resize_recompute`` / ``activation``); the inputs are held as a fused norm holds them. During a recompute, one
norm's intermediates. Time: one more forward of the norm, in backward. See note: norms written out
(docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ..ledger import Category, Ledger
from .saved_tensors import storage_key


class _Call:
    """One forward of a norm whose intermediates were claimed."""

    __slots__ = ("module", "args", "inputs", "versions", "autocast", "own", "count", "claimed", "nbytes", "values")

    def __init__(self, module: torch.nn.Module, args: tuple, inputs: list[torch.Tensor], autocast: Any) -> None:
        self.module, self.args, self.inputs, self.autocast = module, args, inputs, autocast
        self.versions = tuple(a._version for a in inputs)
        self.own: set[int] | None = None  # its inputs' and parameters' storages, read at its first save
        self.count = 0  # tensors autograd saved in this forward, in order
        self.claimed: dict[int, tuple[torch.Size, torch.dtype]] = {}  # their place -> shape, dtype
        self.nbytes: dict[int, int] = {}  # claimed storages -> bytes
        self.values: dict[int, torch.Tensor] | None = None  # the recompute's tensors by place, until unpacked


class _Token:
    """What autograd keeps for a claimed tensor: its call and its place there; the tensor once recomputed."""

    __slots__ = ("call", "place", "value")

    def __init__(self, call: _Call, place: int) -> None:
        self.call, self.place = call, place
        self.value: torch.Tensor | None = None


class NormInternals:
    """The claims of one engine (``ResizeRecompute`` asks ``claim`` first for each tensor offered)."""

    def __init__(self, ledger: Ledger, technique: str, restore_inputs: Callable[[list[torch.Tensor]], None],
                 autocast_state: Callable[[torch.device], Any]) -> None:
        """``restore_inputs``: brings back any input whose storage resize recompute dropped, before a recompute;
        ``autocast_state``: autocast as it is now for a device (replayed by the recompute)."""
        self.ledger, self.technique = ledger, technique
        self.restore_inputs, self.autocast_state = restore_inputs, autocast_state
        self.current: _Call | None = None  # the norm whose forward runs now
        self.pending: list[_Call] = []  # calls with claims not yet recomputed (this forward and backward)
        self.recomputing = False

    def begin(self, module: torch.nn.Module, args: tuple, inputs: list[torch.Tensor]) -> None:
        if self.recomputing or not torch.is_grad_enabled() or not inputs:
            return
        self.current = _Call(module, args, inputs, self.autocast_state(inputs[0].device))

    def end(self) -> None:
        call, self.current = self.current, None
        if call is not None and call.claimed:
            self.pending.append(call)

    def claim(self, tensor: torch.Tensor) -> _Token | None:
        call = self.current
        if call is None:
            return None
        place = call.count
        call.count += 1
        if call.own is None:  # (after every pre-hook: a parameter another hook put in the module's place is its own)
            held = [t for t in call.module._parameters.values() if t is not None]
            call.own = {storage_key(t) for t in (*call.inputs, *held)}
        key = storage_key(tensor)
        if key in call.own:
            return None
        call.claimed[place] = (tensor.shape, tensor.dtype)
        if key not in call.nbytes:
            call.nbytes[key] = tensor.untyped_storage().nbytes()
            self.ledger.save(self.technique, Category.ACTIVATION, call.nbytes[key])
        return _Token(call, place)

    def unpack(self, token: _Token) -> torch.Tensor:
        if token.value is None:  # (kept once unpacked: a backward with retain_graph unpacks it again)
            call = token.call
            if call.values is None:
                self._recompute(call)
            assert call.values is not None
            token.value = call.values.pop(token.place)
        return token.value

    def _recompute(self, call: _Call) -> None:
        name = type(call.module).__name__
        now = tuple(a._version for a in call.inputs)
        if now != call.versions:
            raise RuntimeError(
                f"zeroplus.resize_recompute: an input of {name} was modified in place after its forward (versions "
                f"{list(call.versions)}, now {list(now)}), so what it kept for backward cannot be recomputed as it "
                f"was computed; turn resize_recompute's norms off or do not write its inputs in place")
        self.restore_inputs(call.inputs)
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:  # (detached: a saved output kept itself would hold its grad_fn, and
            saved.append(t.detach())  # through it the tensor, a cycle autograd cannot free)
            return saved[-1]

        args = tree_map(lambda a: a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a,
                        call.args)
        self.recomputing = True
        try:
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in call.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t))
                call.module.forward(*args)  # (its hooks ran in the forward: gathering, routing gradients)
        finally:
            self.recomputing = False
        bad = len(saved) != call.count or any(saved[place].shape != shape or saved[place].dtype != dtype
                                              for place, (shape, dtype) in call.claimed.items())
        if bad:
            raise RuntimeError(
                f"zeroplus.resize_recompute: recomputing {name} for backward saved {len(saved)} tensors where its "
                f"forward saved {call.count}, or of other shapes or dtypes; turn resize_recompute's norms off for it")
        call.values = {place: saved[place] for place in call.claimed}
        self.ledger.unsave(self.technique, Category.ACTIVATION, sum(call.nbytes.values()))
        call.args, call.inputs = (), []
        self.pending.remove(call)

    def end_backward(self) -> None:
        """Calls backward never reached (a branch without gradient) are given up: their bytes held again as not."""
        for call in self.pending:
            self.ledger.unsave(self.technique, Category.ACTIVATION, sum(call.nbytes.values()))
            call.args, call.inputs = (), []
        self.pending.clear()

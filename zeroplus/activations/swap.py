"""Swap attention: the tensors autograd saves inside chosen modules go to a lower tier after
forward and come back one layer ahead in backward.

Chosen modules: by class name (default: the modules that attend, found by what they compute,
``module_roles.attends``: the built-in GPT's ``CausalSelfAttention``, Hugging Face's ``LlamaAttention``, a
block that writes its attention out) or by qualified-name pattern. While one of them runs its forward (in the
engine's forward), every tensor autograd saves of at least ``min_bytes`` is handed to the tier (``offload/tiers.py``),
except parameters (at stage 3 they are gathered again for backward anyway). In backward, the
first time a layer's tensor is needed, the previous layer's tensors are prefetched, so their
transfer overlaps this layer's backward; the last layer's are prefetched when forward ends.

Memory: the device keeps none of a swapped tensor once its move has finished and nothing else
refers to it (the ledger records the bytes under ``swap_attention`` / ``activation``, not
held); at most two layers' tensors are on the device again at once in backward. Values come
back bit for bit, so gradients are identical to a run without swapping.
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch

from ..eager import eager
from ..ledger import Category, Ledger
from ..offload.tiers import Tier
from .module_roles import attends
from .saved_tensors import storage_key

TECHNIQUE = "swap_attention"


class _Token:
    __slots__ = ("layer", "stored", "nbytes", "stride")

    def __init__(self, layer: int, stored: Any, nbytes: int, stride: tuple[int, ...] | None) -> None:
        """``stride``: the saved tensor's strides when it was not contiguous (a compiled graph's backward
        asserts them; the tier gives back contiguous values), else None."""
        self.layer, self.stored, self.nbytes, self.stride = layer, stored, nbytes, stride


class SwapAttention:
    stood_down = False  # (it runs compiled too)
    watches_calls = False  # (no function mode)
    lets_inner_hooks = False  # what attention saves is what it swaps

    def __init__(self, model: torch.nn.Module, class_names: list[str] | None, name_patterns: list[str],
                 tier: Tier, ledger: Ledger, min_bytes: int) -> None:
        self.tier = tier
        self.ledger = ledger
        self.min_bytes = min_bytes
        self.targets: list[str] = []
        self._param_storages = {storage_key(p) for p in model.parameters()}
        self._layers: list[list[_Token]] = []
        self._current: int | None = None
        self._active = False
        self._handles = []
        for name, module in model.named_modules():
            by_class = attends(module) if class_names is None else type(module).__name__ in class_names
            if name and (by_class or any(fnmatch.fnmatchcase(name, p) for p in name_patterns)):
                if any(name.startswith(t + ".") for t in self.targets):
                    continue  # inside a chosen module already
                self.targets.append(name)
                self._handles.append(module.register_forward_pre_hook(eager(self._enter)))
                self._handles.append(module.register_forward_hook(eager(self._leave)))

    # -- forward -------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._active = True
        self._layers = []

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if self._active:
            self._current = len(self._layers)
            self._layers.append([])

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._current = None

    def end_forward(self) -> None:
        self._active = False
        self._current = None
        if self._layers:
            for token in self._layers[-1]:
                self.tier.prefetch(token.stored)

    # -- saved tensors -------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any | None:
        if self._current is None or not self._active:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or storage_key(tensor) in self._param_storages:
            return None
        if tensor.device.type == "cpu" and self.tier.name == "host" and self.tier.saves_memory:
            return None  # in host memory already, beside a device (flash attention's RNG state on CUDA)
        stride = None if tensor.is_contiguous() else tuple(tensor.stride())
        token = _Token(self._current, self.tier.put(tensor.detach()), nbytes, stride)
        self._layers[self._current].append(token)
        if self.tier.saves_memory:
            self.ledger.save(TECHNIQUE, Category.ACTIVATION, nbytes)
        return token

    def unpack(self, token: _Token) -> torch.Tensor:
        if token.stored is None:
            raise RuntimeError("swap_attention: a swapped tensor was needed a second time (backward with "
                               "retain_graph=True is not supported with swap_attention)")
        if token.layer > 0:  # one layer ahead: the previous layer's backward comes next
            for other in self._layers[token.layer - 1]:
                self.tier.prefetch(other.stored)
        value = self.tier.get(token.stored)
        if token.stride is not None and tuple(value.stride()) != token.stride:  # the layout it was saved in
            value = torch.empty_strided(value.shape, token.stride, dtype=value.dtype,
                                        device=value.device).copy_(value)
        if self.tier.saves_memory:
            self.ledger.unsave(TECHNIQUE, Category.ACTIVATION, token.nbytes)
        token.stored = None
        return value

    def end_backward(self) -> None:
        for layer in self._layers:  # tensors backward never asked for
            for token in layer:
                if token.stored is not None:
                    self.tier.discard(token.stored)
                    if self.tier.saves_memory:
                        self.ledger.unsave(TECHNIQUE, Category.ACTIVATION, token.nbytes)
                    token.stored = None
        self._layers = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

"""Parameters and modules attached to the model after ``initialize``: refused at the next forward.

The engine partitions, reduces and steps the parameters the model had when it was assembled. A parameter or module
set on one of the model's modules later (``model.head = nn.Linear(...)``, ``resize_token_embeddings``, an adapter
added by hand) would run in the forward without ever being averaged over the ranks or stepped: each rank would
train its own copy, or none at all, without a word. torch's global registration hooks (every ``register_parameter``
and ``setattr`` of a parameter or module) record such a change on any module of the model, and the next forward
raises on every rank that made it, naming it. Setting a parameter the model already held, or a module holding only
such parameters (a wrapper around its own modules), is no change.
The hooks are listed here and removed by ``destroy()`` (or the engine's finalizer).
See note: model changes (docs/design-notes.md). Held by ``tests/engine/test_misuse.py``.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class ModelChanges:
    """Watches the modules of ``model`` for parameters and modules attached after the engine was assembled."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary(
            {m: n or "<model>" for n, m in model.named_modules()})
        self._known = {id(p) for p in model.parameters()}
        self.changes: list[str] = []
        self._handles = [register_module_parameter_registration_hook(self._parameter),
                         register_module_module_registration_hook(self._module)]

    def _parameter(self, module: torch.nn.Module, name: str, param: Any) -> None:
        where = self._names.get(module)
        if where is not None and param is not None and id(param) not in self._known:
            self.changes.append(f"parameter {where}.{name} {tuple(param.shape)}")

    def _module(self, module: torch.nn.Module, name: str, sub: Any) -> None:
        where = self._names.get(module)
        if where is None or sub is None:
            return
        new = [n for n, p in sub.named_parameters() if id(p) not in self._known]
        if new:  # (a wrapper around modules the model held, the engine's tiled loss among them, adds nothing)
            self.changes.append(f"module {where}.{name} ({type(sub).__name__}: {', '.join(new[:3])}"
                                f"{', ...' if len(new) > 3 else ''})")

    def refuse_if_changed(self, rank: int) -> None:
        if self.changes:
            changed = "; ".join(self.changes)
            raise RuntimeError(f"rank {rank}: the model was changed after zeroplus.initialize ({changed}): the "
                               f"engine partitions, reduces and steps only the parameters the model had then, so "
                               f"these would train apart on each rank or not at all. Change the model before "
                               f"initialize (destroy() the engine first and initialize it again)")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

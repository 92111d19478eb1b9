"""What one real forward leaves for backward, outside the engine's ledger."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

import zeroplus
from zeroplus.activations.forward_census import ForwardCensus

_NewStorages = ForwardCensus  # every storage an operation creates while active, weakly referenced


def saved_in_real_step(engine: zeroplus.Engine, loss_of: Callable[[], torch.Tensor]) -> int:
    """Bytes of the storages ``loss_of()`` creates (running the engine's forward) that are still alive when
    it returns the loss, each once, not counting the ledger's buffers (the parameters' flat buffers): what
    autograd saved for backward, and the loss. Then backward and step. A dispatch mode, not saved-tensor
    hooks: those would make the mechanisms that stand aside under other hooks (``ulysses_output.py``) do so."""
    held = engine.ledger.storage_keys()
    with _NewStorages() as mode:
        loss = loss_of()
    alive = mode.alive_bytes(held)
    engine.backward(loss)
    engine.step()
    return alive


class PeakOfNewStorages(_NewStorages):
    """The largest number of bytes that storages created while active held at once, checked after every
    operation (what a mechanism holds beside its inputs). An output that shares an input's storage (a view,
    an in-place result) is not new."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.storages = {key: (ref, n) for key, (ref, n) in self.storages.items() if not ref.expired()}
        self.record(out, inputs)
        self.peak = max(self.peak, sum(n for _, n in self.storages.values()))
        return out

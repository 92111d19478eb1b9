"""What autograd saves for backward in one real forward, outside the engine's ledger."""
from __future__ import annotations

from typing import Callable

import torch

import zeroplus


def saved_in_real_step(engine: zeroplus.Engine, loss_of: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd saves for backward while ``loss_of()`` runs the engine's forward, each storage once,
    not counting the ledger's buffers (the parameters are its flat buffers); then backward and step."""
    held = engine.ledger.storage_keys()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in held and t.device.type != "meta":
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of()
    engine.backward(loss)
    engine.step()
    return sum(saved.values())

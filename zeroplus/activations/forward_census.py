"""Measuring the activations once: what the first training forward leaves alive outside the ledger, as
the memory report's ``activation`` row (the ledger holds only the activations the engine moves itself).

The first forward with gradients in training mode runs under ``ForwardCensus``, a dispatch mode that
records, weakly, every storage an operation creates. When the forward returns, the storages still
alive that neither the ledger counts nor the output holds (the logits a Hugging Face output carries
live as long as the caller keeps the output) are what autograd saved for backward: what the budget
predicts as ``saved_for_backward``, measured the same way, tensor by tensor,
on every device (CPU's resident memory moves by pages and with what glibc keeps, so it cannot tell
them apart). Later forwards run untouched; one of the same shapes leaves the same bytes.

Not saved-tensor hooks around every forward: autograd checks no in-place modification of what passes
through them, and mechanisms that stand aside under other hooks (``parallel/ulysses_output.py``)
would. Not for compiled modules (a dispatch mode changes what TorchDynamo traces) or pipeline
stages; a compiled function inside the model runs eagerly in the census's forward (``EagerWhileActive``), so
TorchDynamo does not remember it as refused (see note: dispatch modes and compiled functions). Memory: one
weak reference per storage the forward creates, dropped when it ends; time: one Python call per operation in
that forward only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..eager import EagerWhileActive


class ForwardCensus(EagerWhileActive, TorchDispatchMode):
    """Every storage an operation creates while active, weakly referenced, with its size (``storages``)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.record(out, set())
        return out

    def record(self, out: Any, skip: set[int]) -> None:
        """Record the storages of ``out``'s tensors not seen yet and not in ``skip`` (identities)."""
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in skip and key not in self.storages and storage.nbytes():
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())

    def alive_bytes(self, excluded: set[int]) -> int:
        """Bytes the recorded storages still alive hold now (one resized to 0 by resize recompute holds
        nothing), but for those whose identity is in ``excluded``."""
        return sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()  # type: ignore[attr-defined]
                   for key, (ref, _) in self.storages.items() if key not in excluded and not ref.expired())


def storage_keys_of(output: Any) -> set[int]:
    """Identities of the storages of the tensors in ``output`` (a tensor, or a structure of them: tuples,
    dicts, a Hugging Face ``ModelOutput``)."""
    values = list(output.values()) if isinstance(output, dict) else output  # (ModelOutput is a dict)
    return {t.untyped_storage()._cdata for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)}

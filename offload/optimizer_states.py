"""Optimizer states of one flat group, in sub-groups, partly or wholly on a lower tier.

The owned range is cut into sub-groups of ``sub_group_size`` elements. The first
``resident_count`` sub-groups keep their states resident (the step picks them so that at most
``1 - ratio`` of all owned elements, over every group, stay resident); the others live on the tier
(``offload/tiers.py``) between steps and are streamed through a window: while sub-group k steps,
the next ``buffer_count - 1`` are being read and the previous ones written back. A sub-group's
states are what the optimizer keeps for it (per-element tensors and scalars such as ``step``).

Memory (per group): resident sub-groups' states, plus at most ``buffer_count`` sub-groups' states
on the device while streaming (the ledger's ``offload_buffer``), plus writes not yet finished.
"""
from __future__ import annotations

from typing import Any

import torch

from ..ledger import Category, Ledger
from .tiers import Stored


class TieredStates:
    def __init__(self, tier: Any, chunks: list[tuple[int, int]], resident_count: int, buffer_count: int,
                 ledger: Ledger) -> None:
        self.tier, self.chunks, self.ledger = tier, chunks, ledger
        self.window = max(1, buffer_count)
        self.resident_count = resident_count
        self._resident: dict[int, dict[str, Any]] = {}
        self._stored: dict[int, dict[str, Any]] = {}   # chunk -> {key: Stored or scalar}

    def _tracked(self, k: int) -> bool:
        return k >= self.resident_count

    def prefetch(self, k: int) -> None:
        for j in range(k, min(k + self.window - 1, len(self.chunks))):
            for value in self._stored.get(j, {}).values():
                if isinstance(value, Stored):
                    self.tier.prefetch(value)

    def get(self, k: int) -> dict[str, Any]:
        """Chunk k's states on the device ({} before the first step)."""
        if not self._tracked(k):
            return self._resident.get(k, {})
        out = {}
        for key, value in self._stored.pop(k, {}).items():
            if isinstance(value, Stored):
                out[key] = self.tier.get(value)  # counted as offload_buffer by the tier
            else:
                out[key] = value
        return out

    def put(self, k: int, states: dict[str, Any]) -> None:
        """Keep chunk k's states (after its step): resident, or start writing them to the tier."""
        if not self._tracked(k):
            self.ledger.track_new_states(states, Category.OPTIM_STATE)
            self._resident[k] = states
            return
        self._stored[k] = {key: self.tier.put(v) if isinstance(v, torch.Tensor) and v.numel() > 1 else v
                           for key, v in states.items()}

    def full(self, owned: int) -> dict[str, Any]:
        """Every chunk's states concatenated (a checkpoint save): per-element tensors of ``owned``
        elements, scalars from the last chunk."""
        out: dict[str, Any] = {}
        for k, (a, b) in enumerate(self.chunks):
            states = self.get(k)
            for key, value in states.items():
                if isinstance(value, torch.Tensor) and value.numel() == b - a > 1:
                    if key not in out:
                        out[key] = torch.zeros(owned, dtype=value.dtype, device=value.device)
                    out[key][a:b].copy_(value)
                else:
                    out[key] = value
            self.put(k, states)
        return out

    def load_full(self, states: dict[str, Any], owned: int) -> None:
        """Replace every chunk's states from full-size ones (a checkpoint load)."""
        self._resident.clear()
        self._stored.clear()
        for k, (a, b) in enumerate(self.chunks):
            self.put(k, {key: (v[a:b].clone() if isinstance(v, torch.Tensor) and v.numel() == owned > 1 else
                               (v.clone() if isinstance(v, torch.Tensor) else v)) for key, v in states.items()})

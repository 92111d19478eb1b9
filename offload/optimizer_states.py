"""Optimizer states of one flat group, in sub-groups, partly or wholly on a lower tier.

The owned range is cut into sub-groups of ``sub_group_size`` elements. The first
``resident_count`` sub-groups keep their states resident (the step picks them so that at most
``1 - ratio`` of all owned elements, over every group, stay resident); the others live on the tier
(``offload/tiers.py``) between steps and are streamed through a window: while sub-group k steps,
the next ``buffer_count - 1`` (in this group or the next ones) are being read and at most
``buffer_count`` earlier ones are being written back. A sub-group's states are what the
optimizer keeps for it (per-element tensors and scalars such as ``step``).

Memory (all groups together): the resident sub-groups' states, plus at most ``2 * buffer_count``
sub-groups' states on the device while streaming (``buffer_count`` read or stepping, up to
``buffer_count`` being written; the ledger's ``offload_buffer``).
See note: offload ratio (docs/design-notes.md).
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from zeroplus.ledger import Category, Ledger

from .tiers import Stored, Tier


def plan_sub_groups(owned: list[int], sub_group_size: int, ratio: float,
                    block: int = 1) -> list[tuple[list[tuple[int, int]], int]]:
    """Each group's sub-groups ``[(a, b), ...]`` and how many of its first ones stay resident:
    whole sub-groups, in group order, while the resident elements stay within ``1 - ratio`` of all
    owned elements (``ratio`` counts elements over every group, not sub-groups per group). ``block``
    (``scale_block``): every sub-group starts at a multiple of it, so one whose states keep a scale per
    block of elements holds the blocks the whole shard would."""
    budget = (1.0 - ratio) * sum(owned)
    sub_group_size = max(block, int(sub_group_size) // block * block)
    plan = []
    for n in owned:
        chunks = [(a, min(a + sub_group_size, n)) for a in range(0, n, sub_group_size)]
        resident = 0
        while resident < len(chunks) and chunks[resident][1] - chunks[resident][0] <= budget:
            budget -= chunks[resident][1] - chunks[resident][0]
            resident += 1
        plan.append((chunks, resident))
    return plan


StateForm = Callable[[dict[str, Any]], dict[str, Any]]  # one chunk's states into another form of them


def scale_block(optimizer: Any) -> int:
    """Elements per scale of an optimizer whose states keep one per block (fp8 moments: ``block_scaled``), else 1."""
    return int(optimizer.block) if getattr(optimizer, "block_scaled", False) else 1


class Window:
    """What every offloaded group's sub-groups share: the order they step in (group by group) and
    the bound on what is in memory. ``ahead`` starts reading the ``size - 1`` sub-groups after the
    one stepping, across group boundaries (a group of one sub-group still gets the next groups'
    reads in flight); ``written`` keeps at most ``size`` sub-groups' write-backs pending, waiting
    for the oldest beyond that, so a disk slower than the step cannot pile up written-out states
    in memory."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.order: list[tuple[TieredStates, int]] = []
        self._first: dict[int, int] = {}  # id(states) -> position of its sub-group 0 in ``order``
        self._pending: collections.deque = collections.deque()

    def add(self, states: TieredStates) -> None:
        self._first[id(states)] = len(self.order)
        self.order.extend((states, k) for k in range(len(states.chunks)))

    def ahead(self, states: TieredStates, k: int, count: int | None = None) -> None:
        """Start reading ``count`` (default ``size - 1``) sub-groups from the one after ``(states, k)``;
        ``k = -1`` starts at the group's first sub-group."""
        start = self._first[id(states)] + k + 1
        for other, j in self.order[start:start + (self.size - 1 if count is None else count)]:
            other.prefetch(j)

    def written(self, tier: Tier, stored: list[Stored]) -> None:
        self._pending.append((tier, stored))
        while len(self._pending) > self.size:
            old_tier, old = self._pending.popleft()
            for item in old:
                old_tier.wait_written(item)


class TieredStates:
    def __init__(self, tier: Tier, chunks: list[tuple[int, int]], resident_count: int, window: Window,
                 ledger: Ledger) -> None:
        self.tier, self.chunks, self.ledger = tier, chunks, ledger
        self.window = window
        self.resident_count = resident_count
        self._resident: dict[int, dict[str, Any]] = {}
        self._stored: dict[int, dict[str, Any]] = {}   # chunk -> {key: Stored or scalar}
        window.add(self)

    def _tracked(self, k: int) -> bool:
        return k >= self.resident_count

    def prefetch(self, k: int) -> None:
        """Start reading sub-group k's states (if they are on the tier)."""
        for value in self._stored.get(k, {}).values():
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
        self.window.written(self.tier, [v for v in self._stored[k].values() if isinstance(v, Stored)])

    def full(self, owned: int, per_element_form: StateForm | None = None) -> dict[str, Any]:
        """Every chunk's states concatenated (a checkpoint save): per-element tensors of ``owned``
        elements, scalars from the last chunk. Per-element: a tensor with dimensions as long as its chunk; a
        scalar (Adam's ``step``) has none, so a last chunk of one element is concatenated too (taking its
        one-element states for scalars put them in place of the whole tensors). ``per_element_form``: a
        chunk's states as one value per element (fp8 moments dequantized, their scales gone), applied to
        each chunk before it is concatenated."""
        out: dict[str, Any] = {}
        for k, (a, b) in enumerate(self.chunks):
            states = self.get(k)
            given = states if per_element_form is None else per_element_form(states)
            for key, value in given.items():
                if per_element(value, b - a):
                    if key not in out:
                        out[key] = torch.zeros(owned, dtype=value.dtype, device=value.device)
                    out[key][a:b].copy_(value)
                else:
                    out[key] = value
            self.put(k, states)
        return out

    def load_full(self, states: dict[str, Any], owned: int, stored_form: StateForm | None = None) -> None:
        """Replace every chunk's states from full-size ones (a checkpoint load); ``stored_form``: a chunk's
        per-element states as the optimizer keeps them (fp8 moments quantized with the chunk's blocks)."""
        self._resident.clear()
        self._stored.clear()
        for k, (a, b) in enumerate(self.chunks):
            chunk = {key: (v[a:b].clone() if per_element(v, owned) else (v.clone() if isinstance(v, torch.Tensor)
                                                                           else v)) for key, v in states.items()}
            self.put(k, chunk if stored_form is None else stored_form(chunk))


def per_element(value: Any, size: int) -> bool:
    """A state with one value per element of a range of ``size``: a tensor with dimensions, that long. (Adam's
    ``step`` has none; a range of one element still holds per-element states, which ``numel == size > 1``
    took for scalars.) Sub-group steps, their tier and checkpoint saves all decide with this."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == size

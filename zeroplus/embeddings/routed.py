"""What one lookup of an ``EmbeddingBagCollection`` keeps between its forward and its backward.

Per table, on the rank holding rows or columns of it: the ids routed to this rank (as local rows), the global
bag each belongs to (``source rank * B + bag``) and their per-sample weights; for row-wise tables pooled by
mean, this rank's bag lengths. Memory: 8 + 8 (+ 4 weighted) bytes per routed id, 8 per bag; freed with the
backward that uses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# one feature's input: (ids, offsets) or (ids, offsets, per-id weights or None)
Bag = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass
class Routed:
    """One table's ids on a holder: local rows, global bags, weights (None: unweighted)."""
    rows: torch.Tensor
    bags: torch.Tensor
    weights: torch.Tensor | None


@dataclass
class LookupState:
    """What one forward keeps for its backward."""
    batch: int
    routed: dict[str, Routed] = field(default_factory=dict)
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)  # row-wise mean tables: this rank's bag sizes


__all__ = ["LookupState", "Routed"]

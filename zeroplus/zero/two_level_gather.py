"""MiCS's hierarchical parameter gather (``zero_optimization.mics_hierarchical_params_gather``): an all-gather over a
partition group that spans nodes, in two levels.

The partition group (MiCS's shard group, or every rank ZeRO partitions over) holds M nodes of L consecutive ranks,
group rank ``r = m * L + p`` (node ``m``, place ``p``); each rank holds ``c`` elements, and the gathered buffer is the
``M * L`` parts in group-rank order. One level, every rank receives ``(M L - 1) c`` elements, ``(M - 1) L c`` of them
from other nodes. Two levels:

1. across: the M ranks at this rank's place, one in each node, all-gather their parts into a buffer of ``M c``
   (``(M - 1) c`` elements from other nodes: L times fewer);
2. within the node: for each node ``m``, the node's L ranks all-gather part ``m`` of that buffer into the
   ``[m L c, (m + 1) L c)`` range of the output, which is node ``m``'s parts in place order: the output is in group
   order with no copy (M collectives of ``L c`` each).

The second level is issued once the first has landed: its ``wait()`` runs when the gather is issued (a stream wait on
a device, a host wait on gloo), so only the second level overlaps whatever runs before the handle is waited.
Memory: the ``M c`` buffer (ledger ``comm_buffer``) from the issue to the handle's landing.
See note: mics hierarchical gather (docs/design-notes.md).
"""
from __future__ import annotations

import torch

from ..collectives import Collectives, Handle
from ..ledger import Category, Ledger


class TwoLevelGather:
    """An all-gather over the partition group whose rank is ``across.rank * node.size + node.rank``, in two levels
    (the module docstring). ``rank`` and ``size`` are the partition group's; only ``all_gather`` is offered."""

    def __init__(self, node: Collectives, across: Collectives, ledger: Ledger) -> None:
        self.node, self.across, self.ledger = node, across, ledger
        self.size = node.size * across.size
        self.rank = across.rank * node.size + node.rank

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """Every rank's ``input`` (``c`` elements) into ``output`` (``size * c``) in group-rank order."""
        L, M, c = self.node.size, self.across.size, input.numel()
        if output.numel() != self.size * c:
            raise ValueError(f"two-level all-gather: output of {output.numel()} elements for {self.size} parts of {c}")
        mine = self.ledger.empty(M * c, input.dtype, Category.COMM_BUFFER, input.device)
        self.across.all_gather(mine, input.reshape(-1)).wait()
        flat = output.view(-1)
        handles = [self.node.all_gather(flat[m * L * c:(m + 1) * L * c], mine[m * c:(m + 1) * c]) for m in range(M)]

        def land() -> None:
            for handle in handles:
                handle.wait()
            handles.clear()
            del held[:]

        held = [mine]  # (the buffer lives until the second level lands)
        return Handle(None, land)

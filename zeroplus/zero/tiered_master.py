"""Parameter offload at stage 3 (``zero_optimization.offload_param``): the master shard on a tier.

At stage 3 the fp32 master shard *is* the parameter shard (no low-precision shard is kept: every
gather casts the master), so offloading parameters moves the master store to a tier
(``offload/tier_tensor.py``), keeping its interface (``master_store.py``):

- whole master: one fp32 tier tensor; a gather reads it (4 bytes per owned element) and casts it
  into the all-gather's send buffer;
- shared master (``shared_master_weights``): the bf16 high halves and the int16 residuals are two
  tier tensors; a gather reads only the high halves (2 bytes), straight into the send buffer,
  and the residuals are read only by the optimizer step.

``prefetch`` starts reading what the next gather sends (the stage-3 scheduler calls it one unit
ahead of its all-gathers), so the read overlaps the compute of the units before. The optimizer
step reads and rewrites the master chunk by chunk (``chunked_step.py``), the next chunk's read
started while the current one steps.

Memory on the device per group: nothing between uses; a prefetched gather source (4 or 2 bytes
per owned element) until its gather; during the step one chunk being read, one stepping and the
writes in flight (``offload_buffer`` in the ledger). Bytes moved per step: two reads of the
gather source (forward and backward) and one read and one write of the master.
See note: parameter offload (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any

import torch

from ..kernels import bf16_split
from ..ledger import Category, Ledger
from ..offload.tier_tensor import keep
from ..offload.tiers import Tier
from .master_store import FullMaster, MasterStore, SharedMaster

TECHNIQUE = "offload_param"


class TieredMaster:
    tiered = True
    copied = True
    scratch_rows = 1

    def __init__(self, store: MasterStore, tier: Tier, ledger: Ledger, max_writes: int = 4) -> None:
        self.shared, self.numel, self.ledger = store.shared, store.numel, ledger
        self.high: Any = None  # shared: the two halves on the tier
        self.low: Any = None
        self.tensor: Any = None  # whole: the fp32 master on the tier
        if isinstance(store, SharedMaster):
            self.device, self.round_like_shared = store.high.device, False
            self.high = keep(tier, store.high, max_writes)
            self.low = keep(tier, store.low, max_writes)
        elif isinstance(store, FullMaster):
            self.device, self.round_like_shared = store.tensor.device, store.round_like_shared
            self.tensor = keep(tier, store.tensor, max_writes)
        else:
            raise TypeError(f"offload_param keeps a resident master store on a tier, not {type(store).__name__}")
        self.saved = 4 * self.numel if tier.saves_memory else 0
        ledger.save(TECHNIQUE, Category.MASTER, self.saved)
        self._gather_read: Any = None
        self._range_reads: dict[tuple[int, int], Any] = {}

    def begin_step(self) -> None:
        return None

    def set_step_count(self, count: int) -> None:
        return None

    # -- gathers --------------------------------------------------------------------------------
    def _source(self) -> Any:
        return self.high if self.shared else self.tensor

    def prefetch(self) -> None:
        """Start reading what the next gather sends."""
        if self._gather_read is None:
            source = self._source()
            buf = self.ledger.empty(self.numel, source.dtype, Category.OFFLOAD_BUFFER, self.device)
            self._gather_read = source.read(0, self.numel, buf)

    def to_compute(self, dst: torch.Tensor) -> torch.Tensor:
        """Write the master, in the compute dtype, into ``dst`` (the gather's send buffer)."""
        source = self._source()
        if self._gather_read is None and source.dtype == dst.dtype:
            return source.read(0, self.numel, dst).result()
        self.prefetch()
        values, self._gather_read = self._gather_read.result(), None
        if self.round_like_shared and dst.dtype == torch.bfloat16 and values.dtype == torch.float32:
            return bf16_split.round_like_shared(values, dst)
        return dst.copy_(values)

    # -- the optimizer step ---------------------------------------------------------------------
    def prefetch_range(self, a: int, b: int) -> None:
        if (a, b) not in self._range_reads and a < b:
            self._range_reads[(a, b)] = self._start_range(a, b)

    def _start_range(self, a: int, b: int) -> Any:
        if self.shared:
            return (self.high.read(a, b), self.low.read(a, b))
        return self.tensor.read(a, b)

    def read_into(self, a: int, b: int, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The exact fp32 master of ``[a, b)`` in ``out``."""
        pending = self._range_reads.pop((a, b), None) or self._start_range(a, b)
        if self.shared:
            high, low = pending[0].result(), pending[1].result()
            return bf16_split.merge_into(high, low, out, scratch)
        return out.copy_(pending.result())

    def read(self, a: int, b: int) -> torch.Tensor:
        return self.read_into(a, b, torch.empty(b - a, dtype=torch.float32, device=self.device))

    def write(self, at: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """Replace ``[at, at + len)`` with ``values`` (which the caller may reuse afterwards)."""
        self._gather_read = None  # a read started before the step holds old values
        n = values.numel()
        if self.shared:
            high = self.ledger.empty(n, torch.bfloat16, Category.OFFLOAD_BUFFER, self.device)
            low = self.ledger.empty(n, torch.int16, Category.OFFLOAD_BUFFER, self.device)
            bf16_split.split_into(values, high, low, scratch)
            self.high.write(at, high)
            self.low.write(at, low)
        else:
            own = self.ledger.empty(n, torch.float32, Category.OFFLOAD_BUFFER, self.device).copy_(values)
            self.tensor.write(at, own)

    def close(self) -> None:
        for t in ([self.high, self.low] if self.shared else [self.tensor]):
            t.close()
        self.ledger.unsave(TECHNIQUE, Category.MASTER, self.saved)

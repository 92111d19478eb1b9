"""Where a flat group keeps the fp32 master values of its owned range: whole, or shared (bf16 halves plus residuals).

``FullMaster``: one fp32 tensor (4 bytes per owned element; in fp32 training it *is* the
low-precision shard, so 0 extra bytes). After a step the compute-dtype copy is the master cast
with torch's rounding (to nearest even), or with the shared master's rounding (ties away from zero) when
``zeroplus.master_rounding`` asks for it, so a run can be compared bit for bit with shared storage.

``SharedMaster`` (``zeroplus.shared_master_weights``, bf16 only): the bf16 high halves *are* the
compute-dtype shard (at stages 0-2 a view of the full parameter buffer, at stage 3 the shard
that all-gathers send), and an int16 residual holds the low halves (``kernels/bf16_split.py``).
Owned bytes: 2 (residual) instead of 4 (fp32 master) at stages 0-2, where the bf16 copy exists
anyway; at stage 3, 2 + 2 instead of 4 + a 2-byte cast buffer per all-gather in flight. Reading
merges into a new fp32 tensor (checkpoints and exports only); the optimizer step merges chunk by
chunk into one bounded buffer (``chunked_step.py``).

``Bf16Master`` (``zeroplus.master_weights.dtype`` bf16, or DeepSpeed's ``bf16.bf16_master_weights_and_grads``): the
master *is* the bf16 shard, with nothing beside it: 0 bytes beyond the bf16 weights at stages 0-2 (4 less than an fp32
master), 2 at stage 3 (2 less). The step reads each chunk widened to fp32 (exact), steps it there, and stores it back
rounded (``kernels/stochastic_round.py``: to nearest, or stochastically by a hash of the value and the store's step
count). Lossy: an update below half a bf16 step is lost to nearest rounding; stochastic rounding keeps it in
expectation. See note: bf16 master weights (docs/design-notes.md).
See note: shared master (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..kernels import bf16_split, stochastic_round


class MasterStore(Protocol):
    """What the step, the gathers and checkpoints ask of a master store (whole, shared or tiered)."""

    shared: bool
    tiered: bool
    copied: bool        # the step reads the master into an fp32 work buffer and writes it back (not a tensor in place)
    scratch_rows: int   # int32 rows of scratch that ``read_into`` and ``write`` take
    numel: int

    def begin_step(self) -> None: ...

    def set_step_count(self, count: int) -> None: ...

    def prefetch(self) -> None: ...

    def prefetch_range(self, a: int, b: int) -> None: ...

    def read(self, a: int, b: int) -> torch.Tensor: ...

    def read_into(self, a: int, b: int, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor: ...

    def write(self, at: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None: ...

    def to_compute(self, dst: torch.Tensor) -> torch.Tensor: ...


class _Resident:
    """What a store on the device does where a tiered one works: nothing to bring back, no step count kept (a
    ``Bf16Master`` keeps one)."""

    tiered = False  # ``tiered_master.TieredMaster`` keeps a resident store on a tier (offload_param)

    def begin_step(self) -> None:
        return None

    def set_step_count(self, count: int) -> None:
        return None

    def prefetch(self) -> None:
        return None

    def prefetch_range(self, a: int, b: int) -> None:
        return None


class FullMaster(_Resident):
    shared = False
    copied = False
    scratch_rows = 1

    def __init__(self, tensor: torch.Tensor, round_like_shared: bool) -> None:
        self.tensor = tensor
        self.numel = tensor.numel()
        self.round_like_shared = round_like_shared

    def read(self, a: int, b: int) -> torch.Tensor:
        return self.tensor[a:b]

    def read_into(self, a: int, b: int, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        return out.copy_(self.tensor[a:b])

    def write(self, at: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        self.tensor[at:at + values.numel()].copy_(values)

    def to_compute(self, dst: torch.Tensor) -> torch.Tensor:
        """Write the master into the compute-dtype tensor ``dst`` (same length); return ``dst``."""
        if dst is self.tensor:
            return dst
        if self.round_like_shared and dst.dtype == torch.bfloat16:
            return bf16_split.round_like_shared(self.tensor, dst)
        return dst.copy_(self.tensor)


class SharedMaster(_Resident):
    shared = True
    copied = True
    scratch_rows = 1

    def __init__(self, high: torch.Tensor, low: torch.Tensor) -> None:
        if high.dtype != torch.bfloat16 or low.dtype != torch.int16 or high.numel() != low.numel():
            raise ValueError(f"shared master needs bf16 high and int16 low halves of one length, got "
                             f"{high.dtype}[{high.numel()}] and {low.dtype}[{low.numel()}]")
        self.high, self.low = high, low
        self.numel = high.numel()

    def read(self, a: int, b: int) -> torch.Tensor:
        return self.read_into(a, b, torch.empty(b - a, dtype=torch.float32, device=self.high.device))

    def read_into(self, a: int, b: int, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        return bf16_split.merge_into(self.high[a:b], self.low[a:b], out, scratch)

    def write(self, at: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        n = values.numel()
        bf16_split.split_into(values, self.high[at:at + n], self.low[at:at + n], scratch)

    def to_compute(self, dst: torch.Tensor) -> torch.Tensor:
        if dst is self.high:
            return dst
        return dst.copy_(self.high)


class Bf16Master(_Resident):
    shared = False
    copied = True

    def __init__(self, high: torch.Tensor, rounding: str) -> None:
        if high.dtype != torch.bfloat16 or rounding not in ("nearest", "stochastic"):
            raise ValueError(f"a bf16 master needs bf16 values and 'nearest' or 'stochastic' rounding, got "
                             f"{high.dtype} and {rounding!r}")
        self.high, self.rounding = high, rounding
        self.numel = high.numel()
        self.scratch_rows = 2 if rounding == "stochastic" else 1
        self.count = torch.zeros((), dtype=torch.int32, device=high.device)  # steps taken: the rounding's draw

    def begin_step(self) -> None:
        self.count += 1

    def set_step_count(self, count: int) -> None:
        """The steps taken before (a checkpoint load): the next draw is the one the uninterrupted run makes."""
        self.count.fill_(count)

    def read(self, a: int, b: int) -> torch.Tensor:
        return self.high[a:b].float()

    def read_into(self, a: int, b: int, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        return out.copy_(self.high[a:b])

    def write(self, at: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """``values`` (fp32) stored rounded from ``at``; stochastic rounding works through ``scratch`` (int32, two rows)
        a row's length at a time."""
        n = values.numel()
        if self.rounding == "nearest" or scratch is None:
            stochastic_round.store(self.high[at:at + n], values, self.rounding, self.count)
            return
        rows = scratch.view(2, -1)
        piece = rows.shape[1]
        for a in range(0, n, piece):
            b = min(n, a + piece)
            stochastic_round.store(self.high[at + a:at + b], values[a:b], self.rounding, self.count, rows)

    def to_compute(self, dst: torch.Tensor) -> torch.Tensor:
        if dst is self.high:
            return dst
        return dst.copy_(self.high)

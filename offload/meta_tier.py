"""The estimator's tier: answers like a file tier, keeps nothing, on the meta device.

``zeroplus estimate`` runs the engine on the meta device (``zeroplus/budget/simulate.py``), where
no bytes exist to write. This tier stands in for ``FileTier`` (and for ``HostTier`` where the
host is not the device) with the same memory behaviour on the device side, the side the budget
predicts:

- ``put`` holds the tensor (and, for direct I/O, the staging buffer ``direct_io.write``
  allocates, padded) while it is one of the ``WRITERS`` latest puts, the writes the file tier's
  threads have in flight, until ``wait_written``, ``get`` or ``discard``, and at the latest until
  the step is over (``writes_landed``, called by the estimator after each step): a disk that
  keeps up with the step. A slower disk holds more: the window lets up to ``buffer_count``
  sub-groups wait for their writes;
- ``prefetch``/``get`` allocate the buffer the real read lands in (``offload_buffer``);
- ``keep`` tensors (``MetaTierTensor``) read into ``out`` or a new tensor, and write nothing.

Memory: none of its own beyond those buffers, all counted by the ledger and the tracker.
"""
from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING

import torch

from zeroplus.ledger import Category, Ledger

from . import direct_io
from .tier_tensor import _Done
from .tiers import Stored, Tier

WRITERS = 2  # FileTier's write threads
_tiers: weakref.WeakSet[MetaTier] = weakref.WeakSet()


def writes_landed() -> None:
    """Every write of every meta tier has landed (the end of a step)."""
    for tier in list(_tiers):
        while tier.writing:
            tier.writing.popleft().data = None


class MetaTier:
    name = "meta"
    saves_memory = True
    directory = None

    def __init__(self, ledger: Ledger, direct: bool) -> None:
        self.ledger, self.direct = ledger, direct
        self.writing: collections.deque[Stored] = collections.deque()
        _tiers.add(self)

    def keep_tensor(self, t: torch.Tensor) -> MetaTierTensor:
        """``tier_tensor.keep`` on this tier."""
        return MetaTierTensor(self, t)

    def put(self, t: torch.Tensor) -> Stored:
        stored = Stored(t)
        staging = direct_io.aligned_empty(stored.nbytes, self.ledger, "meta") if self._is_direct(stored) else None
        stored.data = (t, staging)
        self.writing.append(stored)
        while len(self.writing) > WRITERS:
            self.writing.popleft().data = None
        return stored

    def _is_direct(self, stored: Stored) -> bool:
        return self.direct and stored.nbytes >= direct_io.MIN_BYTES

    def prefetch(self, stored: Stored) -> None:
        if stored.back is None:
            if self._is_direct(stored):  # as direct_io.read: an aligned buffer of the padded size
                buf = direct_io.aligned_empty(stored.nbytes, self.ledger, "meta")[:stored.nbytes]
            else:
                buf = self.ledger.empty(stored.nbytes, torch.uint8, Category.OFFLOAD_BUFFER, "meta")
            stored.back = buf.view(stored.dtype).view(stored.shape)

    def get(self, stored: Stored) -> torch.Tensor:
        self.prefetch(stored)
        value, stored.back, stored.data = stored.back, None, None
        return value

    def wait_written(self, stored: Stored) -> None:
        stored.data = None

    def discard(self, stored: Stored) -> None:
        stored.back, stored.data = None, None

    def close(self) -> None:
        return None


class MetaTierTensor:
    def __init__(self, tier: MetaTier, t: torch.Tensor) -> None:
        self.tier, self.numel, self.dtype, self.device = tier, t.numel(), t.dtype, t.device
        self.nbytes = self.numel * t.element_size()

    def read(self, a: int, b: int, out: torch.Tensor | None = None) -> _Done:
        return _Done(out if out is not None else torch.empty(b - a, dtype=self.dtype, device="meta"))

    def write(self, at: int, values: torch.Tensor) -> None:
        return None

    def close(self) -> None:
        return None


if TYPE_CHECKING:  # mypy proves the estimator's tier provides what a real one does
    _: type[Tier] = MetaTier

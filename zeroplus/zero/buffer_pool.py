"""Freed buffers reused within one pass on a CPU rank: stage 3's gathered units.

A CPU process has no caching allocator. glibc hands a freed block above its mmap threshold (128 KiB, rising to at most
32 MiB) back to the kernel, and the next allocation of that size faults its pages in again, each one zeroed by the
kernel: about 1.7 us per 4 KiB page on the benchmark host. A two-rank ZeRO-3 step of GPT 111m gathers every unit twice:
with the flat gradients and the root, 97-114K such faults a step (about 200 ms of system time). CUDA and NPU allocators
cache blocks themselves, so the pool takes only CPU buffers.

A pass (``open(name)`` to ``close()``: a forward with gradients up to its last gather, a backward) asks for the same
buffers in the same order every step. The pool records the byte size and ledger category of each request in a pass, in
order (``take`` is asked for every one). In the next run of that pass a buffer being freed is parked instead (``park``)
for the next request of its category that no buffer is parked for yet, when that request asks for its size and is at
most ``lookahead`` requests ahead. Parking moves the bytes into a spare storage by swapping the two storages' data
pointers, so the storage object the parameters' views and autograd's saved tensors hold stays the same one, now empty,
exactly as after ``resize_(0)``; that request then swaps them into its own empty storage, with whatever values they
held: a gather writes the whole buffer before anything reads it. A request that asks for something else than what was
parked for it (the pass went another way) frees it and allocates.

Memory: a parked buffer stays counted in the ledger under the category it was freed from until its request takes it (the
freed tensor first drops to 0 bytes, then the spare is counted: never both at once). Each one is taken by the next
request of its category, which would have allocated its size anyway, so within the category nothing is allocated in
between and its level only stops dipping from the release to that request: each category's peak is the one without
the pool. The total can end higher only where a temporary of another category is made and freed in between: in a
forward nothing runs between a unit's release and the next gather (the next unit's pre-hook); in a backward the rest
of the unit's own backward does (its input's gradient, activation-sized). Flat gradients are not parked: a reduced
one's next request is the next unit's first gradient, a whole unit's backward away, and parking them added 6 MiB to
the harness's fp32 peak (``bench_harness.py``: 957 against 951). ``close()`` (the end of the pass) frees what is still
parked. Storages are swapped with torch's ``UntypedStorage._swap_data_ptr_``; a torch without it gets a pool that is
never on.
See note: buffer pool (docs/design-notes.md).
"""
from __future__ import annotations

import enum

import torch

from ..ledger import Category, Ledger

SWAPS = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class PoolState(enum.Enum):
    """``CLOSED``: no pass is recorded, nothing is parked, ``park`` refuses (a freed buffer is freed); ``OPEN``: one
    pass is recorded and freed buffers its next requests ask for are parked. ``open(name)`` CLOSED -> OPEN (an open
    pass is closed first), ``close()`` -> CLOSED."""

    CLOSED = "closed"
    OPEN = "open"


class BufferPool:
    """One partition's parked CPU buffers and each pass's recorded requests (see the module docstring)."""

    def __init__(self, ledger: Ledger, lookahead: int) -> None:
        """``lookahead``: how many requests ahead a parked buffer's request may be (the partition gives two per
        flat group of its largest unit)."""
        self.ledger = ledger
        self.lookahead = lookahead
        self.enabled = SWAPS  # (benchmarks switch it off to compare)
        self.state = PoolState.CLOSED
        self._plans: dict[str, list[tuple[int, Category]]] = {}  # pass -> its last run's requests, in order
        self._pass = ""
        self._asked: list[tuple[int, Category]] = []  # this run's requests so far: (nbytes, category)
        self._parked: dict[int, torch.Tensor] = {}  # the request (its index in the pass) -> the spare that serves it
        self.takes = 0  # requests served from the pool since construction (tests read it)

    def open(self, name: str) -> None:
        """Start recording pass ``name``; its last run's record says what to park."""
        self.close()
        if self.enabled:
            self.state, self._pass, self._asked = PoolState.OPEN, name, []

    def close(self) -> None:
        """End the pass: its record replaces the last one, and every parked buffer is freed."""
        if self.state is PoolState.OPEN:
            self._plans[self._pass] = self._asked
        self.state = PoolState.CLOSED
        if self._parked:
            self._free([*self._parked])

    def _free(self, requests: list[int]) -> None:
        spares = [self._parked.pop(r) for r in requests]
        self.ledger.release_all(list(spares))  # (their storages die with the list)

    def park(self, tensor: torch.Tensor, category: Category) -> bool:
        """Move ``tensor``'s bytes into the pool (True), leaving its storage empty as ``resize_(0)`` would, when the
        next request of the pass's record for ``category`` with no buffer parked for it yet is within ``lookahead``
        and asks for its size; the ledger then counts ``tensor`` (if it tracks it) at 0 bytes and the parked bytes
        under ``category``. No such request: False, and nothing is done."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if self.state is not PoolState.OPEN or nbytes == 0 or storage.device.type != "cpu":
            return False
        plan, now = self._plans.get(self._pass, []), len(self._asked)
        due = next((j for j in range(now, min(len(plan), now + self.lookahead))
                    if plan[j][1] is category and j not in self._parked), None)  # its category's next request
        if due is None or plan[due][0] != nbytes:
            return False
        spare = torch.empty(0, dtype=torch.uint8)
        _swap(spare.untyped_storage(), storage)
        self._parked[due] = spare
        if hasattr(tensor, "_zeroplus_ledger_key"):
            self.ledger.resized(tensor)
        self.ledger.count(spare, category)
        return True

    def take(self, storage: torch.UntypedStorage, nbytes: int, category: Category) -> bool:
        """A request for ``nbytes`` of ``category`` into the empty ``storage``: filled from the pool (True) when a
        buffer was parked for it (the request of this index in the record asked for the same); else False and the
        caller allocates. A buffer parked for this request or an earlier one that is not taken (the pass went
        another way) is freed. The spare's count ends here; the caller counts the tensor it fills."""
        if self.state is not PoolState.OPEN or storage.device.type != "cpu":
            return False
        index = len(self._asked)
        self._asked.append((nbytes, category))
        spare = self._parked.get(index)
        plan = self._plans.get(self._pass, [])
        if spare is None or plan[index] != (nbytes, category):
            self._free([r for r in self._parked if r <= index])
            return False
        if storage.nbytes() != 0:
            raise RuntimeError(f"buffer pool: take into a storage of {storage.nbytes()} bytes; it must be empty")
        del self._parked[index]
        self.ledger.release(spare)
        _swap(storage, spare.untyped_storage())
        self.takes += 1
        return True


def _swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the bytes (data pointer and size) of two storages; each object stays what holds it."""
    getattr(a, "_swap_data_ptr_")(b)  # (private, not in torch's stubs)

"""The ledger's bookkeeping (``zeroplus/ledger.py``): live and peak bytes per category, and each category's live
bytes at the moment the total peaked (``at_peak``), which per-category peaks cannot give (they need not
coincide): a buffer freed before a later, smaller one keeps the peak's breakdown; ``reset_peaks`` starts it
again from what is live."""
from __future__ import annotations

import threading

import pytest
import torch

from zeroplus.ledger import Category, Ledger

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def test_the_breakdown_at_the_total_peak():
    ledger = Ledger()
    grad = ledger.empty(100, torch.float32, Category.GRAD)
    master = ledger.empty(50, torch.float32, Category.MASTER)
    assert ledger.at_peak == {Category.GRAD: 400, Category.MASTER: 200}
    del grad  # (the storage's finalizer forgets it)
    more = ledger.empty(60, torch.float32, Category.MASTER)  # 440 bytes live: below the 600 of the peak
    assert ledger.peak_bytes(Category.MASTER) == 440 and ledger.peak_bytes() == 600
    assert ledger.at_peak == {Category.GRAD: 400, Category.MASTER: 200}
    ledger.reset_peaks()
    assert ledger.at_peak == {Category.MASTER: 440}
    del master, more


def test_a_storage_dying_while_the_ledger_is_locked_is_counted_off_without_deadlock():
    """The garbage collector can run a tracked storage's finalizer inside the ledger's own locked section (an
    allocation in ``_add`` triggers it, on the same thread): that removal is deferred to the section's end.
    With a plain lock this deadlocked (a hang seen in the checkpoint tests); run in a thread so it fails."""
    ledger = Ledger()
    held = [ledger.zeros(1000, torch.float32, Category.PARAM)]

    def inside() -> None:
        with ledger.locked():
            held.clear()  # the storage dies here, its finalizer runs now
    worker = threading.Thread(target=inside, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the ledger deadlocked on a finalizer run inside its lock"
    assert ledger.live_bytes(Category.PARAM) == 0 and ledger.live_bytes() == 0


def test_entries_counted_together_reach_the_counts_and_peaks_of_entries_counted_one_by_one():
    """``count_each`` raises its category once for all its entries: the live bytes, the peaks and the breakdown at the
    total peak are those its entries counted one at a time reach, and each key releases its own entry's bytes."""
    tensors = [[torch.zeros(n) for n in (3, 5)], [torch.zeros(7)], [torch.zeros(2) for _ in range(3)]]
    entries = [(t, sum(x.nbytes for x in t)) for t in tensors]
    together, apart = Ledger(), Ledger()
    masters = [ledger.empty(10, torch.float32, Category.MASTER) for ledger in (together, apart)]  # (held)
    keys = together.count_each(entries, Category.GRAD)
    apart_keys = [apart.count_each([entry], Category.GRAD)[0] for entry in entries]
    assert len(set(keys)) == len(entries)
    assert together.live_bytes(Category.GRAD) == apart.live_bytes(Category.GRAD) == 4 * (3 + 5 + 7 + 6)
    assert together.peak_bytes(Category.GRAD) == apart.peak_bytes(Category.GRAD) == 84
    assert together.peak_bytes() == apart.peak_bytes() == 124
    assert together.at_peak == apart.at_peak == {Category.MASTER: 40, Category.GRAD: 84}
    together.release_key(keys[1])
    apart.release_key(apart_keys[1])
    assert together.live_bytes(Category.GRAD) == apart.live_bytes(Category.GRAD) == 4 * (3 + 5 + 6)
    del masters

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

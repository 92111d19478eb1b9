"""The row-block cross-entropy against its reference twin, ``F.cross_entropy`` (``kernels/cross_entropy_rows.py``).

Covers: the loss and the logits' gradient bitwise equal to the reference in fp32, bf16 and fp16, for every
reduction, with ignored rows and an ``ignore_index`` that is a class (0), over several blocks with a ragged
last one; the bytes alive in backward (a dispatch-mode tracker of every storage): the reference holds three
logits' worth at once, this two plus two blocks' temporaries; ``supported`` says no to what it does not compute.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zeroplus.budget.tracker import MemoryTracker
from zeroplus.kernels.cross_entropy_rows import (
    BLOCK_ELEMENTS,
    DEVICE_BLOCKS,
    block_rows,
    cross_entropy_rows,
    reference,
    supported,
)
from zeroplus.ledger import Ledger

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_loss_and_gradient_are_the_references_bit_for_bit(dtype, reduction, ignore_index):
    g = torch.Generator().manual_seed(0)
    n, classes = 300, 5000
    assert n // block_rows(classes) >= 2 and n % block_rows(classes)  # several blocks, the last ragged
    logits = (torch.randn(n, classes, generator=g) * 4).to(dtype)
    targets = torch.randint(0, classes, (n,), generator=g)
    targets[::7] = ignore_index
    targets[1::11] = 0
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want, got = reference(a, targets, ignore_index, reduction), cross_entropy_rows(b, targets, ignore_index, reduction)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    upstream = torch.rand(want.shape, generator=g).to(dtype) + 0.5
    want.backward(upstream)
    got.backward(upstream)
    assert torch.equal(b.grad, a.grad)


def _backward_peak(loss_fn, logits: torch.Tensor, targets: torch.Tensor) -> int:
    """Most bytes alive at once during backward, above what was alive when it began."""
    tracker = MemoryTracker(Ledger())
    with tracker:
        leaf = logits.clone().requires_grad_()
        loss = loss_fn(leaf * 1, targets)  # (the logits a head made: kept only by the loss, as in a model)
        tracker.enter("backward")
        start = tracker.live
        tracker.peaks["backward"].total = 0
        loss.backward()
    return tracker.peaks["backward"].total - start


def test_backward_holds_two_logits_worth_instead_of_three():
    n, classes = 512, 8192
    logits, targets = torch.randn(n, classes), torch.randint(0, classes, (n,))
    one = n * classes * 4
    block = block_rows(classes) * classes * 4
    want, got = _backward_peak(reference, logits, targets), _backward_peak(cross_entropy_rows, logits, targets)
    # above the start (the reference keeping its log-softmax, this the logits: one each): the reference makes
    # nll's gradient and log-softmax's while its log-softmax lives, this the gradient and a block's temporaries
    assert want >= 2 * one
    assert got <= one + 2 * block + one // 64, (got / one, want / one)


@pytest.mark.parametrize("rows,classes", [(512, 32000), (16384, 128256), (5, 7), (1, 3)])
def test_blocks_are_cache_sized_on_the_cpu_and_eight_on_an_accelerator(rows, classes):
    """On the CPU about BLOCK_ELEMENTS elements a block; on an accelerator, where each block costs about ten kernel
    launches whatever its size, DEVICE_BLOCKS blocks (an H100 ran 2^19-element blocks 30x slower than torch)."""
    assert block_rows(classes, rows, "cpu") == max(1, BLOCK_ELEMENTS // classes)
    assert block_rows(classes, rows, "meta") == block_rows(classes, rows, "cpu")  # the estimate, on a CPU process
    for device in ("cuda", torch.device("cuda", 0)):
        r = block_rows(classes, rows, device)
        assert -(-rows // r) <= DEVICE_BLOCKS and r * DEVICE_BLOCKS >= rows and r >= 1


def test_supported_says_no_to_what_it_does_not_compute():
    logits, targets = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    assert supported(logits, targets)
    assert supported(logits, targets, reduction="sum", ignore_index=1)
    assert not supported(logits, targets, weight=torch.ones(3))
    assert not supported(logits, targets, label_smoothing=0.1)
    assert not supported(logits, torch.rand(4, 3))  # class probabilities
    assert not supported(logits.view(4, 3, 1), targets.view(4, 1))  # (N, C, d)
    assert not supported(logits, targets, reduce=False)
    assert not supported(logits, targets.bool())
    with pytest.raises(ValueError, match="reduction 'avg'"):
        cross_entropy_rows(logits, targets, reduction="avg")
    assert torch.equal(cross_entropy_rows(logits, targets), F.cross_entropy(logits, targets))

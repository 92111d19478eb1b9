"""Cross-entropy over given logits, a block of rows at a time, keeping the logits instead of the log-softmax.

    loss = cross_entropy_rows(logits, targets, ignore_index=-100, reduction="mean")   # logits (N, C), targets (N,)

``F.cross_entropy`` over ``(N, C)`` logits with class targets is ``log_softmax`` then ``nll_loss``: autograd
keeps the log-softmax ``(N, C)`` for backward, where ``nll_loss``'s backward makes a dense ``(N, C)`` gradient
and ``log_softmax``'s another, while the kept one still lives: three logits' worth at once. Here the forward
takes each block of ``r`` rows' log-softmax, picks the targets' entries and frees the block; only the logits
are kept (the caller's tensor, no copy). The backward takes each block's log-softmax again and writes its
gradient into one ``(N, C)`` output: the logits and their gradient, two logits' worth, plus a block's
temporaries.

Memory, with ``b`` bytes per element: forward ``2 r C b`` of temporaries (none kept beyond the logits);
backward ``2 N C b`` (kept logits and the gradient) plus ``2 r C b``, against ``3 N C b`` for the reference.
On the CPU ``r = max(1, BLOCK_ELEMENTS // C)``: cache-sized blocks, faster than the reference there. On an
accelerator ``r = ceil(N / DEVICE_BLOCKS)``: each block costs about ten kernel launches, and blocks of 2^19
elements made the loss 30 times slower than the reference on an H100 (docs/benchmark.md); eight blocks cost
about eighty launches and hold ``2 N C b / 8`` of temporaries, so backward peaks at ``2.25 N C b``.

Reference twin: ``F.cross_entropy(logits, targets, ignore_index=..., reduction=...)``. The blocks call the
same ATen operators as the reference on fewer rows (``log_softmax``, ``nll_loss_forward`` over the picked
entries as ``(N, 1)`` in the same row order, ``nll_loss_backward`` with the whole batch's total weight,
``_log_softmax_backward_data``); each of them computes a row independently of the others, so the loss and
the gradient are bitwise the reference's (``tests/kernels/test_cross_entropy_rows.py``, fp32, bf16, fp16,
every reduction, ignored rows). Only class-index targets without ``weight`` or ``label_smoothing``:
``supported`` says which calls this is.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..accelerator import get_accelerator

BLOCK_ELEMENTS = 1 << 19  # elements of one block of rows on the CPU (2 MiB in fp32)
DEVICE_BLOCKS = 8  # blocks of rows on an accelerator, whatever the size (launches, not caches, set its cost)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # ATen's enum
_aten = torch.ops.aten


def block_rows(classes: int, rows: int = 0, device: torch.device | str = "cpu") -> int:
    """Rows per block for ``rows`` rows of ``classes`` columns on ``device``: about ``BLOCK_ELEMENTS`` elements on
    the CPU, ``DEVICE_BLOCKS`` blocks elsewhere. The meta device (the memory estimate's simulated run) blocks as
    this process's accelerator does, so the prediction holds what the run will."""
    kind = torch.device(device).type
    if kind == "meta":
        kind = get_accelerator().name
    if kind != "cpu":
        return max(1, -(-rows // DEVICE_BLOCKS))
    return max(1, BLOCK_ELEMENTS // max(1, classes))


class _CrossEntropyRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                reduction: str) -> torch.Tensor:
        n = logits.shape[0]
        rows = block_rows(logits.shape[1], n, logits.device)
        ignored = targets == ignore_index
        safe = targets.masked_fill(ignored, 0)  # (an ignored row picks column 0; nll_loss skips it)
        # the picked entries as the one column of (N, 1) that ignore_index is not: column 1 of (N, 2) if it is 0
        column = 1 if ignore_index == 0 else 0
        picked = logits.new_zeros((n, column + 1))
        for s in range(0, n, rows):
            torch.gather(torch.log_softmax(logits[s:s + rows], 1), 1, safe[s:s + rows, None],
                         out=picked[s:s + rows, column:])
        counted = torch.full_like(targets, column).masked_fill_(ignored, ignore_index)
        loss, total_weight = _aten.nll_loss_forward(picked, counted, None, _REDUCTIONS[reduction], ignore_index)
        ctx.save_for_backward(logits, targets, total_weight)
        ctx.ignore_index, ctx.reduction = ignore_index, _REDUCTIONS[reduction]
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets, total_weight = ctx.saved_tensors
        rows = block_rows(logits.shape[1], logits.shape[0], logits.device)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for s in range(0, logits.shape[0], rows):
            block = torch.log_softmax(logits[s:s + rows], 1)
            upstream = grad_loss if grad_loss.dim() == 0 else grad_loss[s:s + rows]
            g = _aten.nll_loss_backward(upstream, block, targets[s:s + rows], None, ctx.reduction, ctx.ignore_index,
                                        total_weight)
            _aten._log_softmax_backward_data.out(g, block, 1, block.dtype, out=grad[s:s + rows])
            del block, g
        return grad, None, None, None


def supported(logits: Any, targets: Any, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
              reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> bool:
    """Whether ``F.cross_entropy`` called with these arguments is what ``cross_entropy_rows`` computes: plain
    tensors, floating ``(N, C)`` logits, integer ``(N,)`` targets, no class weights, no label smoothing, no
    legacy ``size_average``/``reduce``."""
    return (type(logits) is torch.Tensor and type(targets) is torch.Tensor and logits.dim() == 2
            and logits.is_floating_point() and targets.dim() == 1 and targets.shape[0] == logits.shape[0]
            and not targets.is_floating_point() and targets.dtype != torch.bool and weight is None
            and size_average is None and reduce is None and reduction in _REDUCTIONS and label_smoothing == 0.0
            and isinstance(ignore_index, int) and logits.shape[1] > 0)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                       reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)``, bitwise, holding
    two logits' worth in backward instead of three (module docstring)."""
    if not supported(logits, targets, ignore_index=ignore_index, reduction=reduction):
        raise ValueError(f"cross_entropy_rows takes floating (N, C) logits and integer (N,) targets with reduction "
                         f"'none', 'mean' or 'sum'; got logits {tuple(logits.shape)} {logits.dtype}, targets "
                         f"{tuple(targets.shape)} {targets.dtype}, reduction {reduction!r}")
    return _CrossEntropyRows.apply(logits, targets, int(ignore_index), reduction)


def reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
              reduction: str = "mean") -> torch.Tensor:
    """The reference twin."""
    return nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


__all__ = ["BLOCK_ELEMENTS", "DEVICE_BLOCKS", "block_rows", "cross_entropy_rows", "reference", "supported"]

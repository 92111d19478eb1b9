"""The cross-entropy of a linear head, one tile of rows or one vocabulary slice at a time (pure kernels).

``tile_loss_`` is the forward of one tile of ``t`` rows: its fp32 logits ``rows @ weight.T + bias``, their
log-sum-exp per row written into ``lse`` (in the logits' own buffer: ``4 t V`` bytes), and the tile's summed
loss ``lse - logits[target]`` over the rows whose target is not ``ignore_index``. ``slice_backward_`` makes
one vocabulary slice ``w`` ``(s, d)`` of the gradient from the forward's log-sum-exps, over blocks of ``b``
rows: the slice's logits again, in place their gradient ``(exp(logits - lse) - onehot(target)) * dloss``,
from which the rows' share ``g @ w`` (added into an fp32 ``d_rows``), the bias gradient ``g.sum(0)`` and the
slice's head gradient ``g.T @ rows`` (summed over blocks in fp32). Memory: one block of logits, ``4 b s``
bytes (``vocab_slice`` keeps ``b s <= t V``), and the slice's fp32 head gradient, ``4 s d``; a 16-bit head
adds the block's logits in its dtype. ``zeroplus/activations/linear_cross_entropy.py`` drives them (tiles,
slices, where each slice's gradient goes).

Reference twin: ``reference_sum``, ``F.cross_entropy(F.linear(rows, weight, bias), targets, reduction="sum")``
with the same ``ignore_index``. The kernels compute the same arithmetic in another order (the maximum taken
out of the log-sum-exp, the rows' gradient summed over slices): equal within fp32 rounding
(``tests/kernels/test_cross_entropy.py``: relative 1e-5 for the loss and every gradient).
"""
from __future__ import annotations

import torch
from torch import nn

# A slice of the head's gradient is at most this fraction of one tile's logits (``4 s d <= 4 t V / 8``).
SLICE_FRACTION = 8


def vocab_slice(vocab: int, width: int, tile: int) -> tuple[int, int]:
    """``(s, b)``: vocabulary rows per slice of the head's gradient (``s * width <= tile * vocab /
    SLICE_FRACTION``, at least one row) and rows per block of logits (``b * s <= tile * vocab``)."""
    s = max(1, min(vocab, tile * vocab // (SLICE_FRACTION * width)))
    return s, max(1, tile * vocab // s)


def log_sum_exp_(logits: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp ``(t,)`` of fp32 ``logits`` ``(t, V)``, overwriting them."""
    top = logits.amax(-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(-1, keepdim=True)
    return (top + total.log()).squeeze(-1)


def tile_loss_(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               ignore_index: int, lse: torch.Tensor) -> torch.Tensor:
    """The summed loss (fp32 scalar) of one tile of ``rows`` ``(t, d)``; its rows' log-sum-exps written into
    ``lse`` ``(t,)``. One tile's fp32 logits are alive inside, none after."""
    keep = targets != ignore_index
    logits = nn.functional.linear(rows, weight, bias).float()
    picked = logits.gather(1, torch.where(keep, targets, 0).unsqueeze(1)).squeeze(1)
    lse.copy_(log_sum_exp_(logits))
    return ((lse - picked) * keep).sum()


def slice_backward_(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                    lse: torch.Tensor, scale: torch.Tensor, block: int, d_rows: torch.Tensor | None,
                    d_bias: torch.Tensor | None, want_weight: bool) -> torch.Tensor | None:
    """One vocabulary slice ``w`` ``(s, d)`` over blocks of ``block`` rows: adds the rows' share into
    ``d_rows`` and writes ``d_bias``; returns the slice's fp32 head gradient (if ``want_weight``).
    ``target``: each row's target minus the slice's first row (outside ``[0, s)``: not in this slice);
    ``scale``: each row's ``dloss`` (0 on ignored rows)."""
    s = w.shape[0]
    d_w: torch.Tensor | None = None
    for a in range(0, rows.shape[0], block):
        x = rows[a:a + block]
        g = nn.functional.linear(x, w, b).float()
        g.sub_(lse[a:a + block].unsqueeze(1)).exp_()  # softmax probabilities of this slice
        t = target[a:a + block]
        inside = (t >= 0) & (t < s)
        g.scatter_add_(1, t.clamp(0, s - 1).unsqueeze(1), -inside.unsqueeze(1).float())
        g.mul_(scale[a:a + block].unsqueeze(1))
        g_low = g if w.dtype == torch.float32 else g.to(w.dtype)
        if d_rows is not None:
            if w.dtype == torch.float32:
                d_rows[a:a + block].addmm_(g_low, w)
            else:
                d_rows[a:a + block].add_(torch.matmul(g_low, w))
        if want_weight:
            x_w = x.to(w.dtype)
            if d_w is None:
                d_w = torch.matmul(g_low.t(), x_w).float()
            elif w.dtype == torch.float32:
                d_w.addmm_(g_low.t(), x_w)  # into the accumulator: no second slice-sized buffer
            else:
                d_w.add_(torch.matmul(g_low.t(), x_w))
        if d_bias is not None:
            if a == 0:
                torch.sum(g, 0, out=d_bias)
            else:
                d_bias.add_(g.sum(0))
        del g, g_low  # before the next block's
    return d_w


def reference_sum(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """The twin: torch's summed cross-entropy of the whole logits (``4 N V`` bytes, and as much for their
    gradient)."""
    logits = nn.functional.linear(rows, weight, bias).float()
    return nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
